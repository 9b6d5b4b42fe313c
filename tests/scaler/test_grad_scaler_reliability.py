"""Nothing lost, nothing silent: each defect found by the adversarial pass (issue 10), as a test.

Every test names the item it keeps out. The oracle is torch.amp.GradScaler with
torch.nn.utils.clip_grad_norm_, or a hand computation where torch has no such feature.
"""

from __future__ import annotations

import math

import pytest
import torch

import tritonscale
from tritonscale import GradScaler, LossScalePolicy, OptState, ScalerConfigError, host_reads
from tritonscale.peer_apis.checkpoint_import import from_deepspeed

SCALE = 2.0**10


def make_params(seed=0, shapes=((6, 4), (5,), (3, 3))):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s)) for s in shapes]


def set_grads(params, grads, scale):
    for p, g in zip(params, grads):
        p.grad = (g * scale).clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32) if t.dtype == torch.float32 else t.detach().view(torch.int16)


def snapshot(params, optimizer, scaler):
    """Everything a rejected call must leave bitwise as it was."""
    return (
        [bits(p).clone() for p in params],
        [None if p.grad is None else bits(p.grad).clone() for p in params],
        repr(optimizer.state_dict()),
        scaler.state_dict() if scaler._scale is not None else None,
        # A READY record is what any access creates (torch's defaultdict too): not a change.
        {k: r["stage"] for k, r in scaler._per_optimizer_states.items() if r["stage"] is not OptState.READY},
    )


def assert_unchanged(before, params, optimizer, scaler):
    after = snapshot(params, optimizer, scaler)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "parameters changed"
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before[1], after[1])), "grads changed"
    assert before[2:] == after[2:], "optimizer or scaler state changed"


# --------------------------------------------------- 1. a second clip_grad_norm_
OPTIMIZERS = {
    "fold-sgd": lambda ps: torch.optim.SGD(ps, lr=1.0, fused=True),
    "fold-adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "apply-sgd": lambda ps: torch.optim.SGD(ps, lr=1.0),
    "flat-sgd": lambda ps: torch.optim.SGD(ps, lr=1.0),
}


@pytest.mark.parametrize("path", list(OPTIMIZERS))
@pytest.mark.parametrize("max_norms", [(1.0, 1.0), (1.0, 0.25), (0.25, 1.0)], ids=["same", "tighter", "looser"])
def test_second_clip_is_torchs_unscale_then_clip_twice(backend, path, max_norms):
    torch.manual_seed(1)
    true_grads = [torch.randn(6, 4) * 3, torch.randn(5) * 3, torch.randn(3, 3) * 3]
    results = []
    for ours in (False, True):
        params = make_params()
        if path == "flat-sgd":
            for p in params:
                p.grad = torch.zeros_like(p)
            tritonscale.flatten_grads_(params)
        optimizer = OPTIMIZERS[path](params)
        scaler = GradScaler("cpu", init_scale=SCALE, backend=backend) if ours else torch.amp.GradScaler("cpu", SCALE)
        scaler.scale(torch.ones(()))
        for p, g in zip(params, true_grads):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g * SCALE)
        norms = []
        if ours:
            norms = [scaler.clip_grad_norm_(optimizer, m) for m in max_norms]
        else:
            scaler.unscale_(optimizer)
            norms = [torch.nn.utils.clip_grad_norm_(params, m) for m in max_norms]
        scaler.step(optimizer)
        scaler.update()
        results.append(([float(n) for n in norms], [p.detach().clone() for p in params], scaler.get_scale()))
    (torch_norms, torch_params, torch_scale), (our_norms, our_params, our_scale) = results
    assert our_norms == pytest.approx(torch_norms, rel=1e-5)
    assert our_scale == torch_scale
    for ours, theirs in zip(our_params, torch_params):
        # The fold divides by scale / clip_coef where torch multiplies twice: ~1 ulp per factor.
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-7)


# ------------------------------------------- 2. large finite gradients, not inf
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no-clip"])
def test_norms_of_many_tensors_beyond_float32_are_not_overflows(backend, fused, clip):
    # Each tensor's scaled norm is in float32 range (1.5e19), the total is not (squares sum past
    # 3.4e38): torch unscales first and steps; so must we, on both backends.
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    optimizer = torch.optim.SGD(params, lr=1e-20, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**30, backend=backend)
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.full((1,), 1.5e19)
    if clip:
        norm = scaler.clip_grad_norm_(optimizer, 1e30)
        assert float(norm) == pytest.approx(2 * 1.5e19 / 2.0**30, rel=1e-6)
    scaler.step(optimizer)
    scaler.update()
    assert not scaler.last_step_skipped() and scaler.get_scale() == 2.0**30
    assert all(float(p.detach()) != 0.0 for p in params)  # the step was taken


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
@pytest.mark.parametrize("gpu_path", [False, True], ids=["host-probe", "no-host-read"])
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no-clip"])
def test_one_tensor_beyond_float32_norm(backend, fused, gpu_path, clip, monkeypatch):
    # 3e19 squared overflows float32. The Triton kernels scale each block by a power of two; the
    # torch backend recomputes that tensor's norm in float64 (on the CPU only that tensor, behind a
    # host probe; on a GPU every tensor, with no read). Either way: a finite gradient, a step.
    if gpu_path:
        monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD(params, lr=1e-20, fused=fused)
    scaler = GradScaler("cpu", init_scale=2.0**16, backend=backend)
    scaler.scale(torch.ones(()))
    params[0].grad = torch.tensor([3e19, 1.0, -2.0])
    params[1].grad = torch.tensor([4e19, 5.0])
    if clip:
        norm = scaler.clip_grad_norm_(optimizer, 1e30)
        assert float(norm) == pytest.approx(5e19 / 2.0**16, rel=1e-6)
    scaler.step(optimizer)
    scaler.update()
    assert not scaler.last_step_skipped() and scaler.get_scale() == 2.0**16
    assert float(params[0].detach()[0]) == pytest.approx(-3e19 / 2.0**16 * 1e-20, rel=1e-6)
    assert float(params[1].detach()[0]) == pytest.approx(-4e19 / 2.0**16 * 1e-20, rel=1e-6)


@pytest.mark.parametrize("gpu_path", [False, True], ids=["host-probe", "no-host-read"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_beside_a_large_finite_tensor_an_inf_is_still_an_overflow(gpu_path, bad, monkeypatch):
    # The float64 recomputation must tell "squares past float32" from a real inf/NaN, also when
    # both are present in one step (the inf in its own tensor and inside the large one).
    if gpu_path:
        monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    for where in (0, 1):
        p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
        optimizer = torch.optim.SGD(p, lr=1.0)
        scaler = GradScaler("cpu", init_scale=2.0**16, backend="torch")
        scaler.scale(torch.ones(()))
        p[0].grad = torch.tensor([3e19, 1.0, -2.0])
        p[1].grad = torch.tensor([1.0, 5.0])
        p[where].grad[1] = bad
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        assert scaler.last_step_skipped() and scaler.get_scale() == 2.0**15
        assert all(torch.equal(q.detach(), torch.zeros_like(q)) for q in p)


# --------------------------------- 3. skip_on_overflow=False: both paths the same
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_unskipped_overflow_applies_unscaled_gradients_on_every_path(backend, fused, bad):
    # MindSpore's drop_overflow_update=False: the step goes ahead with the unscaled gradients,
    # finite ones finite; clip_grad_norm_ (norm inf/NaN, nothing to clip by) must equal unscale_.
    torch.manual_seed(2)
    grads = [torch.randn(4, 3), torch.randn(5)]
    grads[0][1, 2] = bad
    outcomes = []
    for call in ("unscale_", "clip_grad_norm_"):
        params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))]
        optimizer = torch.optim.SGD(params, lr=0.5, fused=fused)
        scaler = GradScaler(
            "cpu", init_scale=SCALE, policy=LossScalePolicy.fixed(skip_on_overflow=False), backend=backend
        )
        scaler.scale(torch.ones(()))
        set_grads(params, grads, SCALE)
        if call == "unscale_":
            scaler.unscale_(optimizer)
        else:
            scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        outcomes.append([bits(p).clone() for p in params])
    expected = [bits(torch.ones_like(g) - 0.5 * (g * SCALE) * (1 / SCALE)) for g in grads]
    for got in outcomes:
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


# ------------------------------------------ 4. a disabled scaler forgets its skip
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
def test_disabled_scaler_skip_lasts_one_step(backend, fused):
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=0.1, fused=fused)
    scaler = GradScaler("cpu", enabled=False, backend=backend)
    for p in params:
        p.grad = torch.ones_like(p)
    params[0].grad[0, 0] = math.nan
    before = [p.detach().clone() for p in params]
    scaler.clip_grad_norm_(optimizer, 1.0)
    scaler.step(optimizer)  # skipped: the clip found a NaN
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for p in params:  # the next iteration, without update() in between (a no-op in torch when disabled)
        p.grad = torch.ones_like(p)
    scaler.step(optimizer)
    assert all(torch.equal(p, b - 0.1) for p, b in zip(params, before))


# --------------------------------------------------- 5. gradients that alias
def _aliased(kind):
    params = [
        torch.nn.Parameter(torch.zeros(8)),
        torch.nn.Parameter(torch.zeros(4)),
        torch.nn.Parameter(torch.zeros(4)),
    ]
    if kind == "same-tensor":
        shared = torch.ones(4)
        params[1].grad, params[2].grad = shared, shared
        params[0].grad = torch.ones(8)
    else:  # overlapping views of one buffer
        buffer = torch.ones(10)
        params[0].grad, params[1].grad, params[2].grad = buffer[:8], buffer[6:10], torch.ones(4)
    return params


@pytest.mark.parametrize("kind", ["same-tensor", "overlapping-views"])
@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_", "step"])
def test_aliasing_gradients_are_refused_naming_both(backend, kind, call):
    params = _aliased(kind)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    before = snapshot(params, optimizer, scaler)
    names = ("['params'][1]", "['params'][2]") if kind == "same-tensor" else ("['params'][0]", "['params'][1]")
    with pytest.raises(ValueError, match="share memory") as info:
        getattr(scaler, call)(optimizer, *((1.0,) if call == "clip_grad_norm_" else ()))
    assert all(name in str(info.value) for name in names)
    assert_unchanged(before, params, optimizer, scaler)


def test_views_of_one_buffer_that_do_not_overlap_are_fine(backend):
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    tritonscale.flatten_grads_(params)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    scaler.clip_grad_norm_(optimizer, 1.0)
    scaler.step(optimizer)


# ------------------------------ 7 and 8. state that does not fit, or breaks a rule
def _good_state():
    scaler = GradScaler("cpu", init_scale=4.0, hysteresis=2, skip_norm_factor=3.0)
    scaler.scale(torch.ones(()))
    return scaler.state_dict()


BAD_STATES = {
    "tracker-int32": ({"_growth_tracker": 2**31, "growth_interval": 2**31 + 5}, r"_growth_tracker"),
    "counter-int32": ({"counters": {"skipped_steps": 2**31}}, r"skipped_steps"),
    "scale-float32-inf": ({"scale": 1e39}, r"float32"),
    "scale-float32-zero": ({"scale": 1e-46}, r"float32"),
    "hysteresis-left": ({"counters": {"hysteresis_left": 3}}, r"hysteresis_left"),
    "last-skipped": ({"counters": {"last_skipped": 2}}, r"last_skipped"),
    "negative-count": ({"counters": {"updates": -1}}, r"updates"),
    "consecutive-over-total": ({"counters": {"consecutive_skips": 5, "skipped_steps": 2}}, r"consecutive_skips"),
    "nan-average": ({"norm_stats": {"average": math.nan, "count": 3.0}}, r"average"),
    "negative-norm-count": ({"norm_stats": {"average": 1.0, "count": -1.0}}, r"count"),
    "counters-list": ({"counters": [2, 0, 0, 0, 0]}, r"state_dict\['counters'\] must be a dict"),
    "policy-list": ({"policy": [("hysteresis", 2)]}, r"state_dict\['policy'\] must be a dict"),
    "norm-stats-str": ({"norm_stats": "average=1"}, r"state_dict\['norm_stats'\] must be a dict"),
    "scale-below-min": ({"scale": 0.5, "policy": {"min_scale": 1.0}}, r"below min_scale"),
    "scale-above-max": ({"scale": 64.0, "policy": {"max_scale": 32.0}}, r"above max_scale"),
}


@pytest.mark.parametrize("started", [False, True], ids=["before-scale", "after-scale"])
@pytest.mark.parametrize("case", list(BAD_STATES))
def test_bad_state_dict_is_refused_and_changes_nothing(case, started):
    patch, match = BAD_STATES[case]
    good = _good_state()
    bad = {**good, **{k: ({**good[k], **v} if isinstance(v, dict) and isinstance(good.get(k), dict) else v)
                      for k, v in patch.items()}}  # fmt: skip
    scaler = GradScaler("cpu", init_scale=8.0, hysteresis=2, skip_norm_factor=3.0)
    if started:
        scaler.scale(torch.ones(()))
    state = scaler.state_dict()
    with pytest.raises(ScalerConfigError, match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == state
    scaler.scale(torch.ones(()))  # still usable
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init_scale": 1e39}, "float32"),
        ({"init_scale": 1e-46}, "float32"),
        ({"init_scale": 2.0**16, "max_scale": 2.0**10}, "above max_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "below min_scale"),
    ],
    ids=["inf-in-float32", "zero-in-float32", "above-max", "below-min"],
)
def test_init_scale_that_the_rule_would_not_allow_is_refused(kwargs, match):
    with pytest.raises(ScalerConfigError, match=match):
        GradScaler("cpu", **kwargs)


# --------------------------------------------------------- 9. clear errors
def test_max_norm_beyond_float_range_is_a_clear_error(backend):
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    set_grads(params, [torch.ones_like(p) for p in params], 1.0)
    before = snapshot(params, optimizer, scaler)
    with pytest.raises(ValueError, match="max_norm"):
        scaler.clip_grad_norm_(optimizer, 10**400)
    assert_unchanged(before, params, optimizer, scaler)


def test_deepspeed_scale_window_zero_is_a_clear_error():
    state = {"cur_scale": 2.0**16, "cur_iter": 10, "last_overflow_iter": 3, "scale_window": 0}
    with pytest.raises(ScalerConfigError, match="scale_window"):
        from_deepspeed(state)


# ------------------------------------- skips reported when the scale is set by hand, or off
def _skip_step(scaler, bad, new_scale=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 4)).square().mean() * (math.inf if bad else 1.0)
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(optimizer, 1.0)
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update(new_scale)
    return torch.equal(before, model.weight)


@pytest.mark.parametrize("bad", [True, False])
def test_update_with_new_scale_still_counts_the_skip(backend, bad):
    # mmengine's static loss scale calls update(new_scale) every step; the skip must still show.
    scaler = GradScaler("cpu", init_scale=512.0, backend=backend)
    assert _skip_step(scaler, bad, new_scale=512.0) is bad
    assert scaler.last_step_skipped() is bad and scaler.get_scale() == 512.0
    assert int(scaler.stats()["skipped_steps"]) == int(bad)


@pytest.mark.parametrize("bad", [True, False])
def test_disabled_scaler_reports_the_step_its_clip_skipped(backend, bad):
    scaler = GradScaler("cpu", enabled=False, backend=backend)
    assert _skip_step(scaler, bad) is bad
    assert scaler.last_step_skipped() is bad
