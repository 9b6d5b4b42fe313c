"""Loss-scale policies against hand-written references of the systems they come from.

Each reference (tests/oracles/scale_rules.py) restates, in plain Python, the update rule of one
framework's loss scaler (read from its source; the README names the file). tritonscale.GradScaler
is driven through its real API -- backward, inf/NaN injected into a gradient, clip/step/update --
and its scale must follow the reference step for step. All factors are powers of two or exact in
float32, so the comparison is exact.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from oracles.peer_rules import DeepSpeedZeroRule
from oracles.scale_rules import (
    ApexRef,
    Loop,
    MegatronRef,
    MindSporeRef,
    TensorFlowExponentialRef,
    overflow_pattern,
)

import tritonscale
from tritonscale import GradScaler, LossScalePolicy, ScalerConfigError
from tritonscale.policy.stop_rules import ConsecutiveSkipLimit


# ------------------------------------------------------------------ harness
def follow(scaler, ref, pattern, backend, clip=False):
    loop = Loop(scaler, backend, clip)
    for i, overflow in enumerate(pattern):
        loop.step(overflow)
        ref.update(overflow)
        assert scaler.get_scale() == ref.scale, f"step {i}: {scaler.get_scale()} != {ref.scale}"
    return loop


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_megatron_dynamic_grad_scaler(seed, hysteresis):
    scaler = GradScaler(
        "cpu", init_scale=2.0**8, growth_interval=4, min_scale=1.0, hysteresis=hysteresis, backend="torch"
    )
    ref = MegatronRef(2.0**8, 1.0, 2.0, 0.5, 4, hysteresis)
    follow(scaler, ref, overflow_pattern(seed, p=0.5), "torch")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("consecutive", [False, True], ids=["delayed_shift", "consecutive_hysteresis"])
def test_deepspeed_dynamic_loss_scaler(seed, consecutive):
    scaler = GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=3, min_scale=1.0, hysteresis=2,
        consecutive_hysteresis=consecutive, backend="torch",
    )  # fmt: skip
    # ZeRO's rule before 0.17.1 (the growth test torch's), without its error at the floor.
    ref = DeepSpeedZeroRule(2.0**10, 3, 1.0, 2, consecutive, stable_interval=False)
    ref.raise_error_at_min_scale = False
    follow(scaler, ref, overflow_pattern(seed), "torch")


@pytest.mark.parametrize("seed", SEEDS)
def test_tensorflow_exponential_update(seed):
    policy = LossScalePolicy.tensorflow_exponential(incr_every_n_steps=3, decr_every_n_nan_or_inf=2, decr_ratio=0.5)
    scaler = GradScaler("cpu", init_scale=2.0**6, policy=policy, backend="torch")
    follow(scaler, TensorFlowExponentialRef(2.0**6, 3, 2, 2.0, 0.5), overflow_pattern(seed, p=0.6), "torch")


@pytest.mark.parametrize("seed", SEEDS)
def test_apex_dynamic_loss_scaler_with_max(seed):
    scaler = GradScaler("cpu", init_scale=2.0**20, growth_interval=2, max_scale=2.0**24, backend="torch")
    follow(scaler, ApexRef(2.0**20, scale_window=2, max_loss_scale=2.0**24), overflow_pattern(seed, p=0.15), "torch")


def test_mindspore_bad_step_max_raises_naming_limit_scale_and_step(backend):
    # MindSpore raises once more than bad_step_max overflows happened in a row.
    scaler = GradScaler("cpu", init_scale=2.0**5, growth_interval=2, min_scale=1.0, max_consecutive_skips=3,
                        backend=backend)  # fmt: skip
    ref = MindSporeRef(2.0**5, 2.0, 2, bad_step_max=3)
    loop = Loop(scaler, backend)
    pattern = [False, True, True, False, True, True, True, True]
    for i, overflow in enumerate(pattern):
        if i == len(pattern) - 1:
            with pytest.raises(RuntimeError, match="too many"):
                ref.update(overflow)
            before = scaler.state_dict()
            with pytest.raises(
                RuntimeError,
                match=r"4 consecutive steps were skipped, more than max_consecutive_skips=3; loss scale 1 at step 7",
            ):
                loop.step(overflow)
            del before["counters"]  # the raising update changed nothing
            after = scaler.state_dict()
            del after["counters"]
            assert after == before
        else:
            loop.step(overflow)
            ref.update(overflow)
            assert scaler.get_scale() == ref.scale


def _first_raise(update, pattern) -> int | None:
    """The index of the first update in ``pattern`` that raises RuntimeError (None: none does)."""
    for i, overflow in enumerate(pattern):
        try:
            update(overflow)
        except RuntimeError:
            return i
    return None


@pytest.mark.parametrize("seed", range(4))
def test_the_consecutive_skip_limit_is_one_rule_in_the_policy_and_after_the_update(seed):
    """``max_consecutive_skips`` (checked inside the update) and ``ConsecutiveSkipLimit`` (MindSpore's
    ``bad_step_max``, checked after it) raise at the same update as MindSpore's own count."""
    limit = 1 + seed % 3
    pattern = overflow_pattern(seed, steps=40, p=0.6)
    expected = _first_raise(MindSporeRef(2.0**5, 2.0, 2, bad_step_max=limit).update, pattern)
    assert expected is not None  # the pattern reaches the limit
    scaler = GradScaler("cpu", init_scale=2.0**5, growth_interval=2, min_scale=1.0, max_consecutive_skips=limit,
                        backend="torch")  # fmt: skip
    assert _first_raise(Loop(scaler, "torch").step, pattern) == expected
    after = ConsecutiveSkipLimit(limit)
    count = {"in_a_row": 0}

    def update_then_check(overflow):
        count["in_a_row"] = count["in_a_row"] + 1 if overflow else 0
        after.after_update(lambda: count["in_a_row"], lambda: 1.0)

    assert _first_raise(update_then_check, pattern) == expected


def test_fixed_scale_never_changes_and_skips_overflows(backend):
    scaler = GradScaler("cpu", init_scale=128.0, policy=LossScalePolicy.fixed(), backend=backend)
    loop = Loop(scaler, backend)
    for overflow in overflow_pattern(5, steps=30, p=0.4):
        before = loop.param.detach().clone()
        loop.step(overflow)
        assert scaler.get_scale() == 128.0
        assert torch.equal(loop.param, before) == overflow  # skipped exactly on overflow


def test_fixed_scale_that_lets_overflowed_steps_through(backend):
    scaler = GradScaler("cpu", init_scale=1.0, policy=LossScalePolicy.fixed(skip_on_overflow=False), backend=backend)
    loop = Loop(scaler, backend)
    loop.step(overflow=True)
    assert scaler.get_scale() == 1.0
    assert math.isinf(loop.param[3].item()) or math.isnan(loop.param[3].item())  # the step went ahead


@pytest.mark.parametrize("mode", ["clamp", "warn", "raise"])
def test_what_happens_at_the_floor(backend, mode):
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=1.0, on_min_scale=mode, backend=backend)
    loop = Loop(scaler, backend)
    loop.step(True)
    loop.step(True)
    assert scaler.get_scale() == 1.0  # 4 -> 2 -> 1: reaching the floor is fine
    if mode == "raise":
        with pytest.raises(RuntimeError, match="already at min_scale=1"):
            loop.step(True)
    elif mode == "warn":
        with pytest.warns(RuntimeWarning, match="already at min_scale=1"):
            loop.step(True)
    else:
        loop.step(True)
    assert scaler.get_scale() == 1.0


def test_default_has_no_floor_like_torch(backend):
    scaler = GradScaler("cpu", init_scale=1.0, backend=backend)
    loop = Loop(scaler, backend)
    for _ in range(3):
        loop.step(True)
    assert scaler.get_scale() == 0.125


def test_growth_is_capped_by_max_scale(backend):
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=1, max_scale=2.0**6, backend=backend)
    loop = Loop(scaler, backend)
    scales = []
    for _ in range(4):
        loop.step(False)
        scales.append(scaler.get_scale())
    assert scales == [2.0**5, 2.0**6, 2.0**6, 2.0**6]


# --------------------------------------------------------- gradient-norm spikes
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_norm_spike_above_threshold_is_skipped_without_backoff(backend, fused):
    scaler = GradScaler("cpu", init_scale=2.0**4, growth_interval=1000, skip_norm_above=10.0, backend=backend)
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param], lr=0.1, fused=fused) if fused else torch.optim.SGD([param], lr=0.1)
    for grad_value, spike in [(1.0, False), (100.0, True), (2.0, False), (6.0, True)]:
        before = param.detach().clone()
        opt.zero_grad()
        scaler.scale((param * grad_value).sum()).backward()
        norm = scaler.clip_grad_norm_(opt, 1e9)
        assert float(norm) == pytest.approx(2 * grad_value)  # |(g, g, g, g)| = 2g
        scaler.step(opt)
        scaler.update()
        assert torch.equal(param, before) == spike
        assert scaler.get_scale() == 2.0**4  # a spike is not an overflow
    assert scaler.state_dict()["counters"]["skipped_steps"] == 2


def test_norm_spike_relative_to_running_average(backend):
    scaler = GradScaler("cpu", init_scale=1.0, skip_norm_factor=3.0, norm_warmup_steps=3, backend=backend)
    loop = Loop(scaler, backend, clip=True)
    # |g| of 8 equal entries: sqrt(8) * value. Warm-up takes 3 norms; then 5x the average skips.
    for value, skipped in [(1.0, False), (5.0, False), (1.0, False), (1.0, False), (8.0, True), (1.2, False)]:
        before = loop.param.detach().clone()
        loop.opt.zero_grad()
        loop.scaler.scale((loop.param * value).sum()).backward()
        loop.scaler.clip_grad_norm_(loop.opt, 1e9)
        loop.scaler.step(loop.opt)
        loop.scaler.update()
        assert torch.equal(loop.param, before) == skipped, value
    stats = scaler.state_dict()["norm_stats"]
    assert stats["count"] == 5  # the skipped norm did not enter the average


# ------------------------------------------------------------- state & errors
def test_policy_knobs_and_trackers_survive_state_dict(backend):
    kw = dict(init_scale=2.0**8, growth_interval=3, min_scale=2.0, hysteresis=3, backend=backend)
    a = GradScaler("cpu", **kw)
    loop = Loop(a, backend)
    pattern = overflow_pattern(7, steps=40, p=0.5)
    for overflow in pattern[:17]:
        loop.step(overflow)
    saved = a.state_dict()
    assert saved["policy"]["hysteresis"] == 3 and saved["policy"]["min_scale"] == 2.0
    b = GradScaler("cpu", backend=backend)  # default knobs: all come from the checkpoint
    b.load_state_dict(saved)
    loop_b = Loop(b, backend)
    for overflow in pattern[17:]:
        loop.step(overflow)
        loop_b.step(overflow)
        assert a.get_scale() == b.get_scale()
    assert a.state_dict() == b.state_dict()


def test_older_checkpoints_load_the_tolerance_counters_as_zero_and_a_delay_bounds_the_tracker():
    # A state_dict from before fairseq's counters existed (or torch's, which has no counters at all).
    old = GradScaler("cpu", overflow_tolerance=0.5).state_dict()
    old["counters"] = {
        k: v for k, v in old["counters"].items() if k not in ("overflows_since_backoff", "updates_since_rescale")
    }
    loaded = GradScaler("cpu", overflow_tolerance=0.5)
    loaded.load_state_dict(old)
    assert loaded.state_dict()["counters"]["updates_since_rescale"] == 0
    # DeepSpeed's count starts at -growth_delay: such a tracker loads where the delay allows it.
    delayed = GradScaler("cpu", policy="deepspeed").state_dict()
    assert delayed["_growth_tracker"] == -1
    GradScaler("cpu").load_state_dict(delayed)  # the checkpoint's policy comes with it
    del delayed["policy"]
    with pytest.raises(ScalerConfigError, match=r"_growth_tracker'\] must be an int in \[0, "):
        GradScaler("cpu").load_state_dict(delayed)


def test_torch_state_dict_loads_with_configured_knobs():
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ours = GradScaler("cpu", hysteresis=2, min_scale=1.0)
    ours.load_state_dict(theirs.state_dict())
    sd = ours.state_dict()
    assert sd["scale"] == 512.0 and sd["growth_interval"] == 7
    assert sd["policy"]["hysteresis"] == 2 and sd["counters"]["hysteresis_left"] == 2


def test_numpy_policy_knobs_are_their_python_values(backend):
    # Every numeric knob beyond torch's, as numpy scalars: the same policy (and state_dict, of plain
    # Python numbers) and the same scale trajectory as with numpy's own .item() of each.
    numbers = {
        "hysteresis": np.int64(2),
        "min_scale": np.float32(2.0),
        "max_scale": np.float64(2.0**12),
        "max_consecutive_skips": np.int32(99),
        "skip_norm_above": np.float16(6e4),
        "skip_norm_factor": np.float32(8.0),
        "norm_average_decay": np.float32(0.5),
        "norm_warmup_steps": np.int64(3),
        "growth_delay": np.int64(1),
        "overflow_tolerance": np.float32(0.0),  # a tolerance and hysteresis exclude each other
        "raise_at_scale": np.float64(2.0**-20),
    }
    plain = {name: value.item() for name, value in numbers.items()}
    ours = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend, **numbers)
    twin = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend, **plain)
    assert ours.state_dict() == twin.state_dict()
    assert {k: type(v) for k, v in ours.state_dict()["policy"].items()} == {
        k: type(v) for k, v in twin.state_dict()["policy"].items()
    }
    loops = Loop(ours, backend), Loop(twin, backend)
    for overflow in overflow_pattern(3, steps=12, p=0.5):
        for loop in loops:
            loop.step(overflow)
        assert ours.get_scale() == twin.get_scale()


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": np.bool_(True)}, "hysteresis"),
        ({"min_scale": np.bool_(True)}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "above max_scale"),
        ({"on_min_scale": "ignore"}, "on_min_scale"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"skip_norm_factor": 0.5}, "skip_norm_factor"),
        ({"dynamic": "yes"}, "dynamic"),
        ({"growth_delay": -1}, "growth_delay must be an int >= 0"),
        ({"growth_delay": 1.5}, "growth_delay"),
        ({"overflow_tolerance": -0.1}, "overflow_tolerance must be a finite number >= 0"),
        ({"overflow_tolerance": math.nan}, "overflow_tolerance"),
        ({"overflow_tolerance": 0.25, "hysteresis": 2}, "set one of them"),
        ({"raise_at_scale": -1.0}, "raise_at_scale"),
        ({"raise_at_scale": math.inf}, "raise_at_scale"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_policy_knobs_raise(knobs, match):
    with pytest.raises(ScalerConfigError, match=match):
        GradScaler("cpu", **knobs)


def test_unknown_keyword_and_conflicting_policy_arguments():
    with pytest.raises(TypeError, match="unexpected keyword"):
        GradScaler("cpu", hysterisis=2)
    # torch's knobs beside a policy override it, as the others do (tests/scaler/test_grad_scaler_api.py)
    assert GradScaler("cpu", growth_interval=5, policy=LossScalePolicy()).get_policy().growth_interval == 5


def test_policy_update_is_device_resident_and_in_place(backend):
    scaler = GradScaler("cpu", hysteresis=2, skip_norm_factor=2.0, backend=backend)
    loop = Loop(scaler, backend, clip=True)
    loop.step(False)
    addresses = [t.data_ptr() for t in (scaler._scale, scaler._growth_tracker, scaler._counters, scaler._norm_stats)]
    for overflow in (True, False, True, True, False):
        loop.step(overflow)
    # Fixed addresses: the step can be captured in a CUDA graph.
    assert addresses == [
        t.data_ptr() for t in (scaler._scale, scaler._growth_tracker, scaler._counters, scaler._norm_stats)
    ]
    assert tritonscale.GradScaler is GradScaler


@pytest.mark.parametrize("seed", SEEDS)
def test_deepspeed_raise_error_at_min_scale(seed):
    # DeepSpeed raises when an overflow would back off a scale already at min_scale.
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=3, min_scale=1.0, hysteresis=2, on_min_scale="raise",
                        backend="torch")  # fmt: skip
    ref = DeepSpeedZeroRule(8.0, 3, 1.0, 2, consecutive_hysteresis=False, stable_interval=False)
    loop = Loop(scaler, "torch")
    for overflow in overflow_pattern(seed, p=0.7):
        try:
            ref.update(overflow)
        except Exception as error:  # DeepSpeed raises a bare Exception
            assert "already at minimum" in str(error)
            with pytest.raises(RuntimeError, match="already at min_scale"):
                loop.step(overflow)
            return
        loop.step(overflow)
        assert scaler.get_scale() == ref.scale
    pytest.fail("the pattern never reached the floor")


COMPILED_KNOBS = {
    "megatron+spike": dict(init_scale=2.0**8, growth_interval=3, min_scale=1.0, hysteresis=2, skip_norm_factor=4.0,
                           norm_warmup_steps=2),
    "floor": dict(init_scale=2.0**16, backoff_factor=1e-20, growth_interval=2),  # backs off to 2**-126
    # DeepSpeed's delayed growth and fairseq's tolerance (a float64 share of the counters)
    "peers": dict(init_scale=2.0**8, growth_interval=2, growth_delay=1, overflow_tolerance=0.3),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("knobs", list(COMPILED_KNOBS))
def test_compiled_rule_equals_eager_rule(knobs):
    # On a GPU the rule runs through torch.compile (one fused kernel); here inductor compiles it for
    # the CPU (~15-30 s), which checks the same traced graph against the eager ops.
    kw = dict(**COMPILED_KNOBS[knobs], backend="torch")
    eager, compiled = GradScaler("cpu", **kw), GradScaler("cpu", compile_policy=True, **kw)
    loops = [Loop(eager, "torch", clip=True), Loop(compiled, "torch", clip=True)]
    rng, scales = random.Random(3), set()
    for overflow in overflow_pattern(3, steps=25, p=0.4):
        value = rng.choice([1.0, 1.0, 2.0, 20.0])
        for loop in loops:
            loop.step(overflow, grad_value=value)
        assert eager.state_dict() == compiled.state_dict()
        scales.add(eager.get_scale())
    assert knobs != "floor" or 2.0**-126 in scales


# ------------------------------------------------- the scale never backs off to 0 (unlike torch)
FLOOR = 2.0**-126  # the smallest normal float32: README, "Differences from torch"


def f32_times(scale: float, factor: float) -> float:
    """torch's backoff: the float32 scale times the float64 factor, rounded once to float32."""
    return torch.tensor(scale * factor, dtype=torch.float64).float().item()


def test_backoff_that_torch_rounds_to_zero_stops_at_the_floor(backend):
    # Hand-worked: 2**16 backs off by 1e-20 twice (still normal numbers), the third backoff rounds
    # to 0 in float32 -- where torch's scale stays for good -- and ours stops at 2**-126, grows from
    # there after growth_interval good steps, and backs off to the floor again.
    scaler = GradScaler("cpu", backoff_factor=1e-20, growth_interval=2, backend=backend)
    theirs = torch.amp.GradScaler("cpu", backoff_factor=1e-20, growth_interval=2)
    first = f32_times(2.0**16, 1e-20)
    pattern = [True, True, True, False, False, True, True]
    expected = [first, f32_times(first, 1e-20), FLOOR, FLOOR, 2 * FLOOR, FLOOR, FLOOR]
    assert f32_times(expected[1], 1e-20) == 0.0  # where torch's rule leaves the scale
    ours_loop, their_loop = Loop(scaler, backend), Loop(theirs, backend)
    for i, (overflow, scale) in enumerate(zip(pattern, expected)):
        ours_loop.step(overflow)
        their_loop.step(overflow)
        assert scaler.get_scale() == scale, f"step {i}"
    assert theirs.get_scale() == 0.0  # torch's is stuck at 0
    assert 1.0 / scaler.get_scale() == 2.0**126 and torch.tensor(1.0 / FLOOR, dtype=torch.float32).isfinite()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "init_scale, backoff",
    [(2.0**16, 1e-20), (2.0**-124, 0.5), (1.0, 1e-30), (2.0**-120, 1e-3)],
    ids=["2**16-by-1e-20", "2**-124-by-0.5", "1-by-1e-30", "2**-120-by-1e-3"],
)
def test_tiny_backoffs_follow_torch_down_to_the_floor(backend, seed, init_scale, backoff):
    # Oracle: torch's own GradScaler, step for step (scale and growth tracker bit for bit). Where a
    # torch backoff lands below 2**-126 (0 included), ours holds 2**-126, and torch is set there too
    # before the next step (its rule plus the documented floor).
    kw = dict(init_scale=init_scale, backoff_factor=backoff, growth_interval=2)
    scaler, theirs = GradScaler("cpu", backend=backend, **kw), torch.amp.GradScaler("cpu", **kw)
    ours_loop, their_loop = Loop(scaler, backend), Loop(theirs, backend)
    floored = 0
    for i, overflow in enumerate(overflow_pattern(seed, steps=40, p=0.5)):
        ours_loop.step(overflow)
        their_loop.step(overflow)
        if overflow and theirs.get_scale() < FLOOR:
            floored += 1
            assert scaler.get_scale() == FLOOR, f"step {i}"
            theirs._scale.fill_(FLOOR)
        assert scaler.get_scale() == theirs.get_scale(), f"step {i}"
        assert scaler._get_growth_tracker() == theirs._get_growth_tracker(), f"step {i}"
    assert floored > 0  # the pattern reached the floor


@pytest.mark.parametrize("min_scale", [None, 2.0**-140, 1.0], ids=["none", "2**-140", "1"])
def test_checkpoint_with_a_zero_scale_loads_at_the_floor(backend, min_scale):
    # torch writes scale 0 after backing off to it; ours loads it as its own rule would have left it
    # (2**-126, or min_scale when that is higher), and continues as torch from there.
    theirs = torch.amp.GradScaler("cpu", backoff_factor=1e-20, growth_interval=2)
    their_loop = Loop(theirs, backend)
    for _ in range(3):
        their_loop.step(True)
    saved = theirs.state_dict()
    assert saved["scale"] == 0.0
    scaler = GradScaler("cpu", min_scale=min_scale, backend=backend)
    scaler.load_state_dict(saved)
    floor = FLOOR if min_scale in (None, 2.0**-140) else min_scale
    assert scaler.get_scale() == floor and scaler.get_backoff_factor() == 1e-20
    theirs._scale.fill_(floor)
    ours_loop = Loop(scaler, backend)
    for overflow in (False, False, False, True, False):
        ours_loop.step(overflow)
        their_loop.step(overflow)
        assert scaler.get_scale() == max(theirs.get_scale(), floor)


def test_floor_on_the_device_reads_nothing_back(backend, forbid_host_reads):
    # The GPU form of the rule: the floor is a tensor op after torch's _amp_update_scale_.
    scaler = GradScaler("cpu", backoff_factor=1e-20, backend=backend)
    scaler.scale(torch.ones(()))
    forbid_host_reads.on = True
    for _ in range(4):
        scaler.update(found_inf=torch.ones(()))
    forbid_host_reads.on = False
    assert scaler.get_scale() == FLOOR
