"""The spike rules (tritonscale/policy/spike_rules.py) against their projects' own rules.

OLMo-core's z-score skip decision for decision and ZClip's clip value for clip value
(tests/oracles/spike_rules.py, transcribed with repository, path and commit), on norm traces with a
warm-up, planted spikes and an overflow, and on random traces (hypothesis); real GradScaler runs
against torch's GradScaler and clip_grad_norm_ at the reference's clip value; no host read on the
GPU paths; checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracles.spike_rules import OlmoSkip, ZClipRef
from oracles.tolerances import NORM_RTOL, SPIKE_CLIP_RTOL, TORCH_CLIP_COEF_RTOL

import tritonscale
from tritonscale import LossScalePolicy
from tritonscale.errors import ScalerConfigError
from tritonscale.policy.spike_rules import zclip_max_norm
from tritonscale.policy.state import HostState

CPU = torch.device("cpu")


def norm_trace(steps: int = 160, spikes=(40, 41, 97, 130), overflow=(70,), seed: int = 0) -> list[float]:
    """Norms as training leaves them: decaying, noisy (float32), planted spikes (8 times the norm,
    then, from step 90 on, 40 times), an overflow (inf)."""
    g = torch.Generator().manual_seed(seed)
    base = 4.0 * torch.exp(-torch.arange(steps) / 80.0) + 1.0
    norms = (base * torch.exp(0.1 * torch.randn(steps, generator=g))).float().tolist()
    for i in spikes:
        norms[i] *= 8.0 if i < 90 else 40.0
    for i in overflow:
        norms[i] = math.inf
    return norms


def run_rule(policy: LossScalePolicy, norms: list[float], max_norm: float = math.inf):
    """The policy's rule over ``norms`` as the scaler runs it: (skip flags, clip limits, final state)."""
    state = HostState.initial(1.0, policy).to_device(CPU)
    skips, limits = [], []
    for value in norms:
        norm = torch.tensor(value, dtype=torch.float32)
        found_inf = torch.tensor(0.0 if math.isfinite(value) else 1.0)
        if policy.clip_norm_z is not None:
            limits.append(zclip_max_norm(policy, state.spike_stats, norm, max_norm).item())
        skip = policy.skip_decision(found_inf, norm, state.norm_stats, spike_stats=state.spike_stats)
        policy.update_(
            state.scale, state.growth_tracker, state.counters, state.norm_stats, found_inf, skip, norm,
            spike_stats=state.spike_stats,
        )  # fmt: skip
        skips.append(bool(float(skip)))
        assert state.spike_stats.dtype is torch.float64
    return skips, limits, state


def olmo_skips(norms: list[float], reference: OlmoSkip) -> list[bool]:
    """The reference's decisions, an overflow skipped as the scaler skips it."""
    return [reference.skip(n) or not math.isfinite(n) for n in norms]


@pytest.mark.parametrize("window,sigma,min_steps", [(128, 6, 2), (128, 6, 20), (16, 2, 2), (32, 2.5, 20), (4, 1, 2)])
def test_zscore_skip_decides_as_olmo_core(window, sigma, min_steps):
    norms = norm_trace()
    policy = LossScalePolicy(skip_norm_sigma=sigma, skip_norm_window=window, skip_norm_min_steps=min_steps).validate()
    skips, _, _ = run_rule(policy, norms)
    expected = olmo_skips(norms, OlmoSkip(window, sigma, min_steps))
    assert skips == expected
    assert sum(expected) > 1  # the planted spikes (and the overflow) are skipped: not a vacuous trace


def _borderline_trace(window: int = 8, sigma: float = 2.0) -> list[float]:
    """A trace whose last norm is above ``sigma`` population std but below ``sigma`` Bessel std."""
    previous = torch.tensor(norm_trace(window, spikes=(), overflow=())).double()
    mean, population, bessel = previous.mean(), previous.std(correction=0), previous.std()
    return previous.float().tolist() + [float(mean + sigma * (population + bessel) / 2)]


def test_the_oracle_catches_a_wrong_rule():
    """The transcription is what decides: population std (or OLMo-core's older minimum of 20 steps)
    gives other decisions on traces where the rule as written does not skip."""
    norms = _borderline_trace()
    policy = LossScalePolicy(skip_norm_sigma=2.0, skip_norm_window=8).validate()
    skips, _, _ = run_rule(policy, norms)
    assert skips == olmo_skips(norms, OlmoSkip(8, 2.0)) and not skips[-1]
    wrong = OlmoSkip(8, 2.0)
    wrong.std = lambda x: torch.std_mean(x, correction=0)
    assert olmo_skips(norms, wrong) != skips
    trace = norm_trace(40, spikes=(17,), overflow=())  # a spike after window // 2 = 16 norms, before 20
    ours = run_rule(LossScalePolicy(skip_norm_sigma=2, skip_norm_window=32).validate(), trace)[0]
    assert ours[17] and olmo_skips(trace, OlmoSkip(32, 2, 20)) != ours


def test_overflow_is_kept_out_of_the_window():
    """An overflowed step's inf in the window (OLMo-core appends every norm) makes the mean inf and
    the std NaN: every step of the next `window` is skipped. Kept out, only the overflow and the
    planted spike are."""
    norms = norm_trace(70, spikes=(50,), overflow=(45,))
    policy = LossScalePolicy(skip_norm_sigma=3, skip_norm_window=16).validate()
    skips, _, _ = run_rule(policy, norms)
    assert [i for i in range(45, 62) if skips[i]] == [45, 50]
    appended = olmo_skips(norms, OlmoSkip(16, 3, keep_nonfinite=True))
    assert all(appended[45:62])


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"clip_norm_option": "mean"},
        {"clip_norm_mode": "percentile"},
        {"clip_norm_factor": 0.7, "clip_norm_skip_update_on_spike": True},
        {"clip_norm_alpha": 0.9, "clip_norm_z": 1.5, "clip_norm_warmup_steps": 3},
    ],
    ids=["adaptive", "mean", "percentile", "factor-skip-update", "alpha-z-warmup"],
)
@pytest.mark.parametrize("max_norm", [math.inf, 5.0], ids=["no-max", "max5"])
def test_zclip_clip_value_is_zclips(knobs, max_norm):
    norms = norm_trace()
    policy = LossScalePolicy(clip_norm_z=knobs.pop("clip_norm_z", 2.5), **knobs).validate()
    _, limits, state = run_rule(policy, norms, max_norm=max_norm)
    names = {"clip_norm_alpha": "alpha", "clip_norm_warmup_steps": "warmup_steps", "clip_norm_mode": "mode",
             "clip_norm_option": "clip_option", "clip_norm_factor": "clip_factor",
             "clip_norm_skip_update_on_spike": "skip_update_on_spike"}  # fmt: skip
    reference = ZClipRef(z_thresh=policy.clip_norm_z, **{names[k]: getattr(policy, k) for k in names})
    expected = [reference.clip_value(n, max_norm) for n in norms]
    clipped = [i for i, value in enumerate(expected) if value < max_norm]
    assert clipped and clipped == [i for i, value in enumerate(limits) if value < max_norm]
    for i, (ours, theirs) in enumerate(zip(limits, expected)):
        assert ours == pytest.approx(theirs, rel=SPIKE_CLIP_RTOL), f"step {i}"
    assert state.spike_stats[1].item() == pytest.approx(reference.mean, rel=SPIKE_CLIP_RTOL)


TRACES = st.lists(
    st.one_of(st.floats(0.015625, 100.0, width=32), st.sampled_from([math.inf, math.nan, 1e4])), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    norms=TRACES,
    window=st.integers(2, 24),
    sigma=st.sampled_from([1.0, 2.0, 3.0, 6.0]),
    min_steps=st.sampled_from([2, 3, 20]),
    z=st.sampled_from([1.0, 2.5]),
    warmup=st.integers(1, 5),
)
def test_random_traces_match_the_references(norms, window, sigma, min_steps, z, warmup):
    assume(min_steps <= window + 1)  # else refused (test_bad_knobs_are_refused_by_name)
    policy = LossScalePolicy(
        skip_norm_sigma=sigma, skip_norm_window=window, skip_norm_min_steps=min_steps,
        clip_norm_z=z, clip_norm_warmup_steps=warmup,
    ).validate()  # fmt: skip
    device_run = run_rule(policy, norms)
    assert device_run[0] == olmo_skips(norms, OlmoSkip(window, sigma, min_steps))
    reference = ZClipRef(z_thresh=z, warmup_steps=warmup)
    expected = [reference.clip_value(n) for n in norms]
    assert device_run[1] == pytest.approx(expected, rel=SPIKE_CLIP_RTOL)


# ----------------------------------------------------------------- real GradScaler runs
def _model_and_batches(steps: int, spikes: tuple[int, ...]):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    batches = [torch.randn(6, 8) * (30.0 if i in spikes else 1.0) for i in range(steps)]
    return model, batches


def _loss(model, x):
    return model(x).pow(2).mean()


def _optimizer(model, fused: bool):
    params = model.parameters()
    return torch.optim.AdamW(params, lr=1e-2, fused=True) if fused else torch.optim.SGD(params, lr=1e-2)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_scaler_skips_planted_spikes_and_keeps_the_scale(fused):
    """The steps OLMo-core's rule skips (on the norms the scaler reports) are skipped: parameters
    unchanged there, moved elsewhere; the scale moves as torch's GradScaler's beside it (a spike
    skip is no overflow: no backoff, and it counts toward growth, as torch's step there would)."""
    steps, spikes = 42, (22, 40)  # the second spike after the first left the window
    model, batches = _model_and_batches(steps, spikes)
    twin_model = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model, fused), _optimizer(twin_model, fused)
    policy = LossScalePolicy(skip_norm_sigma=6, skip_norm_window=16, growth_interval=4)
    scaler = tritonscale.GradScaler("cpu", policy=policy, backend="torch")  # the rule is the backends' same
    twin = torch.amp.GradScaler("cpu", growth_interval=4)
    reference, skipped = OlmoSkip(16, 6), []
    for x in batches:
        for m, o, s in ((model, opt, scaler), (twin_model, twin_opt, twin)):
            o.zero_grad()
            s.scale(_loss(m, x)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        norm = scaler.clip_grad_norm_(opt, max_norm=math.inf)
        scaler.step(opt)
        scaler.update()
        twin.step(twin_opt)
        twin.update()
        skipped.append(scaler.last_step_skipped())
        assert skipped[-1] == reference.skip(norm.item())
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())) != skipped[-1]
        assert scaler.get_scale() == twin.get_scale()
    assert [i for i, s in enumerate(skipped) if s] == list(spikes)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_scaler_clips_as_zclip_then_torch_clip(fused):
    """ZClip's clip value becomes the clip's max_norm: the run equals torch's GradScaler with
    ``unscale_`` and ``torch.nn.utils.clip_grad_norm_`` at the reference's clip value, step for step
    (parameters within the clip coefficient's tolerance, the same steps clipped adaptively)."""
    steps, spikes, max_norm = 24, (12, 19), 50.0
    model, batches = _model_and_batches(steps, spikes)
    twin_model = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model, fused), _optimizer(twin_model, fused)
    policy = LossScalePolicy(clip_norm_z=2.5, clip_norm_warmup_steps=5)
    scaler, twin = tritonscale.GradScaler("cpu", policy=policy, backend="torch"), torch.amp.GradScaler("cpu")
    reference, adaptive = ZClipRef(warmup_steps=5), []
    for x in batches:
        for m, o, s in ((model, opt, scaler), (twin_model, twin_opt, twin)):
            o.zero_grad()
            s.scale(_loss(m, x)).backward()
        norm = scaler.clip_grad_norm_(opt, max_norm=max_norm)
        twin.unscale_(twin_opt)
        twin_norm = torch.nn.utils.clip_grad_norm_(twin_model.parameters(), max_norm=math.inf)
        limit = reference.clip_value(norm.item(), max_norm)
        torch.nn.utils.clip_grad_norm_(twin_model.parameters(), max_norm=limit)
        adaptive.append(limit < max_norm)
        assert norm.item() == pytest.approx(twin_norm.item(), rel=NORM_RTOL[torch.float32])
        for s, o in ((scaler, opt), (twin, twin_opt)):
            s.step(o)
            s.update()
        for ours, theirs in zip(model.parameters(), twin_model.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=TORCH_CLIP_COEF_RTOL[torch.float32], atol=1e-6)
    assert set(spikes) <= {i for i, a in enumerate(adaptive) if a}


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_no_host_read_in_clip_step_update(forbid_host_reads, fused):
    """Both spike rules on, on the GPU paths (host_reads.are_free off): clip_grad_norm_, step (a
    fused one) and update read nothing on the host; and the spike is still skipped."""
    model, batches = _model_and_batches(24, (20,))
    opt = _optimizer(model, fused)
    policy = LossScalePolicy(skip_norm_sigma=6, skip_norm_window=16, clip_norm_z=2.5, clip_norm_warmup_steps=5)
    scaler, skipped = tritonscale.GradScaler("cpu", policy=policy), []
    for x in batches:
        opt.zero_grad()
        scaler.scale(_loss(model, x)).backward()
        with forbid_host_reads.armed():
            scaler.clip_grad_norm_(opt, max_norm=50.0)
            if fused:
                scaler.step(opt)
            scaler.update() if fused else None
        if not fused:  # a plain optimizer's step reads the skip flag, as torch's: outside the guard
            scaler.step(opt)
            with forbid_host_reads.armed():
                scaler.update()
        skipped.append(scaler.last_step_skipped())
    assert [i for i, s in enumerate(skipped) if s] == [20]


# ----------------------------------------------------------------------- checkpoints
def _trained_scaler(policy: LossScalePolicy, steps: int):
    model, batches = _model_and_batches(steps, (steps - 1,))
    opt = _optimizer(model, False)
    scaler = tritonscale.GradScaler("cpu", policy=policy, backend="torch")
    for x in batches:
        _step(scaler, opt, model, x)
    return scaler


def _step(scaler, opt, model, x) -> None:
    """One scaled, clipped (max_norm 50) training step."""
    opt.zero_grad()
    scaler.scale(_loss(model, x)).backward()
    scaler.clip_grad_norm_(opt, max_norm=50.0)
    scaler.step(opt)
    scaler.update()


SPIKE_POLICY = dict(skip_norm_sigma=3, skip_norm_window=8, clip_norm_z=2.5, clip_norm_warmup_steps=4)


def test_state_dict_round_trip_and_older_checkpoints():
    scaler = _trained_scaler(LossScalePolicy(**SPIKE_POLICY), 12)
    saved = scaler.state_dict()
    restored = tritonscale.GradScaler("cpu")
    restored.place_state("cpu")
    restored.load_state_dict(saved)
    assert torch.equal(restored._tensors.spike_stats, scaler._tensors.spike_stats)
    assert restored.state_dict() == saved
    older = {k: v for k, v in saved.items() if k != "spike_stats"}  # a checkpoint from before the spike rules
    fresh = tritonscale.GradScaler("cpu")
    fresh.load_state_dict(older)
    assert fresh.state_dict()["spike_stats"]["norms"] == [0.0] * 12 and fresh.state_dict()["spike_stats"]["seen"] == 0


@pytest.mark.parametrize(
    "change",
    [{"norms": [1.0] * 3}, {"seen": -1.0}, {"ema_var": math.nan}, {"norms": "x"}],
    ids=["length", "negative", "nan", "not-a-list"],
)
def test_bad_spike_state_is_refused_and_nothing_changes(change):
    scaler = _trained_scaler(LossScalePolicy(**SPIKE_POLICY), 10)
    saved, before = scaler.state_dict(), scaler.state_dict()
    bad = {**saved, "spike_stats": {**saved["spike_stats"], **change}}
    with pytest.raises(ScalerConfigError, match="spike_stats"):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_spike_state_without_a_spike_rule_is_refused():
    scaler = _trained_scaler(LossScalePolicy(**SPIKE_POLICY), 6)
    saved = scaler.state_dict()
    bad = {**saved, "policy": {**saved["policy"], "skip_norm_sigma": None, "clip_norm_z": None}}
    plain = tritonscale.GradScaler("cpu")
    with pytest.raises(ScalerConfigError, match="no spike rule"):
        plain.load_state_dict(bad)
    assert plain.state_dict() == tritonscale.GradScaler("cpu").state_dict()


@pytest.mark.parametrize(
    "knob,value",
    [("skip_norm_sigma", 0), ("skip_norm_sigma", math.inf), ("skip_norm_window", 1), ("skip_norm_min_steps", 1),
     ("skip_norm_min_steps", 200), ("clip_norm_z", -1.0), ("clip_norm_alpha", 1.0), ("clip_norm_warmup_steps", 0),
     ("clip_norm_mode", "median"), ("clip_norm_option", "max"), ("clip_norm_factor", 0.0), ("clip_norm_eps", -1e-6),
     ("clip_norm_skip_update_on_spike", 1)],
)  # fmt: skip
def test_bad_knobs_are_refused_by_name(knob, value):
    with pytest.raises(ScalerConfigError, match=knob):
        tritonscale.GradScaler("cpu", policy=LossScalePolicy(**{knob: value}))


def test_compiled_rule_equals_eager():
    """The rule compiled (as on CUDA: ``compile_policy``) gives the eager run's skips, state and
    parameters, bit for bit."""
    runs = []
    for compiled in (False, True):
        model, batches = _model_and_batches(20, (17,))
        opt = _optimizer(model, False)
        policy = LossScalePolicy(skip_norm_sigma=6, skip_norm_window=8, clip_norm_z=2.5, clip_norm_warmup_steps=4)
        scaler = tritonscale.GradScaler("cpu", policy=policy, compile_policy=compiled, backend="torch")
        skipped = []
        for x in batches:
            _step(scaler, opt, model, x)
            skipped.append(scaler.last_step_skipped())
        runs.append((skipped, scaler.state_dict(), [p.detach().clone() for p in model.parameters()]))
    (eager_skips, eager_state, eager_params), (skips, state, params) = runs
    assert skips == eager_skips and 17 in [i for i, s in enumerate(skips) if s]
    assert state == eager_state
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


# ------------------------------------------------------------------- update(new_scale)
NEW_SCALE_NORMS = (1.0, 1.1, 0.9, 1.0, 10.0, 3.0)
NEW_SCALE_KNOBS = dict(skip_norm_sigma=3.0, skip_norm_window=4, clip_norm_z=2.5, clip_norm_warmup_steps=3,
                       skip_norm_factor=100.0)  # fmt: skip


def _norm_run(set_by_hand: tuple[int, ...], guard=None):
    """A scaler clipping gradients whose unscaled norm is each of NEW_SCALE_NORMS (scale 16 throughout),
    ``update(new_scale=16.0)`` at the steps ``set_by_hand``, plain ``update()`` elsewhere:
    (skips, norms, scaler). ``guard``: forbid_host_reads, armed around clip and update."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=16.0, backend="torch", **NEW_SCALE_KNOBS)
    skips, norms = [], []
    for step, value in enumerate(NEW_SCALE_NORMS):
        opt.zero_grad()
        scaler.scale(param.sum() * 0.0).backward()
        param.grad.fill_(value / 2 * 16.0)  # four equal entries: the unscaled norm is `value`
        with guard.armed() if guard else contextlib.nullcontext():
            norms.append(scaler.clip_grad_norm_(opt, max_norm=100.0))
        scaler.step(opt)  # SGD's step reads its skip flag on the host, as torch's
        with guard.armed() if guard else contextlib.nullcontext():
            scaler.update(16.0) if step in set_by_hand else scaler.update()
        skips.append(scaler.last_step_skipped())
    return skips, [n.item() for n in norms], scaler


@pytest.mark.parametrize("form", ["host_form", "device_form"])
def test_update_with_new_scale_feeds_the_norm_rules(request, form):
    """update(new_scale=...) (mmengine's static scale calls it every step) counts the iteration as
    update() does, the scale aside: OLMo-core fed every norm applies the 3.0 after the 10.0 (with
    the 10.0 kept out of the window, 3.0 is 20 std above 1.0, 1.1, 0.9, 1.0 and would be skipped);
    ZClip's average takes the 10.0's clip value, skip_norm_factor's average the 1.0 of step 3.
    ``device_form``: the rule on device tensors (host reads forbidden), as on a GPU."""
    guard = request.getfixturevalue("forbid_host_reads") if form == "device_form" else None
    skips, norms, scaler = _norm_run((3, 4), guard)
    assert skips == olmo_skips(norms, OlmoSkip(4, 3.0)) and skips[4] and not skips[5]
    _, plain_norms, plain = _norm_run((), guard)
    assert norms == plain_norms
    for name in ("counters", "norm_stats", "spike_stats"):
        assert torch.equal(getattr(scaler._tensors, name), getattr(plain._tensors, name)), name
    reference = ZClipRef(warmup_steps=3)
    for value in norms:
        reference.clip_value(value, 100.0)
    stats = scaler.state_dict()["spike_stats"]
    assert (stats["ema_mean"], stats["ema_var"]) == pytest.approx((reference.mean, reference.var), rel=1e-12)
