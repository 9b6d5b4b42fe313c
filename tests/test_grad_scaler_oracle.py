"""tritonscale.GradScaler against torch.amp.GradScaler (+ torch.nn.utils.clip_grad_norm_).

Identical models, data and injected inf/NaN; both backends. With power-of-two scales every
elementwise result is bit-identical to torch, so parameters, optimizer state and the scale
trajectory are compared exactly; returned norms within the tolerance table.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from oracles.tolerances import NORM_RTOL

import tritonscale

STEPS = 14
BAD_STEPS = {3: "inf", 4: "nan", 5: "inf", 9: "-inf"}  # two consecutive overflows, then recovery


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)
    )
    return model.to(dtype)


def batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        x = torch.randn(6, 12, generator=g)
        y = torch.randn(6, 3, generator=g)
        bad = BAD_STEPS.get(step)
        if bad is not None:
            x[2, 5] = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[bad]
        out.append((x, y))
    return out


def train(scaler, make_opt, *, clip=None, norm_type=2.0, ours: bool, model=None, init_grads_flat=False):
    """Run STEPS iterations; return per-step (scale, norm, tracker), final params and opt state."""
    model = model if model is not None else make_model()
    opt = make_opt(model.parameters())
    if init_grads_flat:
        tritonscale.flatten_grads_(model.parameters())
    history = []
    dtype = next(model.parameters()).dtype
    for x, y in batches():
        opt.zero_grad(set_to_none=not init_grads_flat)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
        scaler.scale(loss).backward()
        norm = None
        if clip is not None:
            if ours:
                norm = scaler.clip_grad_norm_(opt, clip, norm_type)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type)
            assert norm.dim() == 0 and (norm.dtype == torch.float32 or not ours)
        scaler.step(opt)
        scaler.update()
        history.append((scaler.get_scale(), None if norm is None else float(norm), scaler._get_growth_tracker()))
    return history, model, opt


def assert_same_training(ours, theirs, exact=True):
    """Scale trajectory exact; parameters and optimizer state bit-identical when ``exact``.

    With clipping active the clip coefficient is computed from the norm, which differs from
    torch's by summation order (~1e-7 relative), so the parameters then agree to that order.
    """
    (h1, m1, o1), (h2, m2, o2) = ours, theirs
    assert [h[0] for h in h1] == [h[0] for h in h2], "scale trajectories differ"
    assert [h[2] for h in h1] == [h[2] for h in h2], "growth trackers differ"
    for (_, n1, _), (_, n2, _) in zip(h1, h2):
        if n2 is None:
            continue
        if math.isfinite(n2):
            assert n1 == pytest.approx(n2, rel=NORM_RTOL[torch.float32])
        else:
            assert (math.isnan(n1) and math.isnan(n2)) or n1 == n2
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert same(p1, p2)
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert same(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name])), name


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def scalers(backend, **kw):
    kw = {"init_scale": 2.0**12, "growth_interval": 3, **kw}
    return tritonscale.GradScaler("cpu", backend=backend, **kw), torch.amp.GradScaler("cpu", **kw)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_step_and_update_match_torch(backend, opt_name):
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS[opt_name], ours=True)
    b = train(theirs, OPTIMIZERS[opt_name], ours=False)
    assert_same_training(a, b)
    scales = [h[0] for h in a[0]]
    assert min(scales) < 2.0**12 < max(scales), "the run must both back off and grow"


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "linf"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_clip_grad_norm_matches_unscale_plus_torch_clip(backend, opt_name, norm_type):
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS[opt_name], clip=0.25, norm_type=norm_type, ours=True)
    b = train(theirs, OPTIMIZERS[opt_name], clip=0.25, norm_type=norm_type, ours=False)
    # The inf-norm is a max: exactly torch's, so the whole run is bit-identical.
    assert_same_training(a, b, exact=norm_type == math.inf)
    clipped = [n for _, n, _ in a[0] if n is not None and math.isfinite(n) and n > 0.25]
    assert clipped, "the test must exercise clipping"


def test_clip_with_fused_optimizer_passes_found_inf_on_device(backend):
    # After clip_grad_norm_ the fused optimizer gets grad_scale=None and the device found_inf.
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS["adamw_fused"], clip=0.25, ours=True)
    b = train(theirs, OPTIMIZERS["adamw_fused"], clip=0.25, ours=False)
    assert_same_training(a, b, exact=False)


def test_flat_gradient_buffers_match_torch(backend):
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS["sgd"], clip=0.25, ours=True, init_grads_flat=True)
    b = train(theirs, OPTIMIZERS["sgd"], clip=0.25, ours=False)
    assert_same_training(a, b, exact=False)


def test_non_power_of_two_factors_follow_torch(backend):
    ours, theirs = scalers(backend, init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3)
    a = train(ours, OPTIMIZERS["sgd"], ours=True)
    b = train(theirs, OPTIMIZERS["sgd"], ours=False)
    assert [h[0] for h in a[0]] == [h[0] for h in b[0]]
    for p1, p2 in zip(a[1].parameters(), b[1].parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_bf16_gradients_clip(backend):
    # torch's GradScaler accepts bf16 gradients too: compare the whole run.
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS["sgd"], clip=0.25, ours=True, model=make_model(torch.bfloat16))
    b = train(theirs, OPTIMIZERS["sgd"], clip=0.25, ours=False, model=make_model(torch.bfloat16))
    assert [h[0] for h in a[0]] == [h[0] for h in b[0]]
    for (_, n1, _), (_, n2, _) in zip(a[0], b[0]):
        if math.isfinite(n2):
            # torch's norm of bf16 gradients is rounded to bf16; ours stays float32.
            assert n1 == pytest.approx(n2, rel=2**-8)
    for p1, p2 in zip(a[1].parameters(), b[1].parameters()):
        torch.testing.assert_close(p1, p2, rtol=2**-7, atol=1e-3)


def test_several_optimizers_share_one_scaler(backend):
    def run(scaler, ours):
        model = make_model()
        opt1 = torch.optim.SGD(list(model.parameters())[:2], lr=0.05)
        opt2 = torch.optim.AdamW(list(model.parameters())[2:], lr=1e-2)
        scales = []
        for x, y in batches():
            opt1.zero_grad()
            opt2.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if ours:
                scaler.clip_grad_norm_(opt1, 0.5)
            else:
                scaler.unscale_(opt1)
                torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 0.5)
            scaler.step(opt1)
            scaler.step(opt2)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, model

    ours, theirs = scalers(backend)
    (s1, m1), (s2, m2) = run(ours, True), run(theirs, False)
    assert s1 == s2
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)  # opt1 is clipped


def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(backend):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = tritonscale.GradScaler("cpu", backend=backend)
    x, y = batches()[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    params = copy.deepcopy([p.detach() for p in model.parameters()])
    state = copy.deepcopy(opt.state_dict())
    scale = scaler.get_scale()
    opt.zero_grad()
    x = x.clone()
    x[0, 0] = math.nan
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isnan(float(norm))
    scaler.step(opt)
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(after["state"][k][name]), torch.as_tensor(t))
    scaler.update()
    assert scaler.get_scale() == scale * 0.5


def test_gradient_accumulation_over_micro_batches(backend):
    def run(scaler, ours):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = batches()
        norms = []
        for i in range(0, 8, 2):
            opt.zero_grad()
            for x, y in data[i : i + 2]:
                scaler.scale(torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            if ours:
                norms.append(float(scaler.clip_grad_norm_(opt, 0.3)))
            else:
                scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
            scaler.step(opt)
            scaler.update()
        return norms, model, scaler.get_scale()

    ours, theirs = scalers(backend)
    (n1, m1, s1), (n2, m2, s2) = run(ours, True), run(theirs, False)
    assert s1 == s2
    for a, b in zip(n1, n2):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=NORM_RTOL[torch.float32])
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_disabled_scaler_is_a_passthrough_that_still_clips(backend):
    model, ref = make_model(), make_model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    scaler = tritonscale.GradScaler("cpu", enabled=False, backend=backend)
    x, y = batches()[0]
    for m in (model, ref):
        loss = torch.nn.functional.mse_loss(m(x), y)
        (scaler.scale(loss) if m is model else loss).backward()
    assert scaler.scale(torch.tensor(3.0)).item() == 3.0
    norm = scaler.clip_grad_norm_(opt, 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    scaler.step(opt)
    ref_opt.step()
    scaler.update()
    for p1, p2 in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_scale_of_nested_outputs_matches_torch():
    ours, theirs = tritonscale.GradScaler("cpu", init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    outputs = [torch.tensor(1.0), (torch.tensor([2.0, 3.0]), [torch.tensor(4.0)])]
    a, b = ours.scale(outputs), theirs.scale(outputs)
    assert type(a) is list and type(a[1]) is tuple and type(a[1][1]) is list

    def flat(o):
        return [o.reshape(-1)] if isinstance(o, torch.Tensor) else [v for x in o for v in flat(x)]

    assert torch.equal(torch.cat(flat(a)), torch.cat(flat(b)))
    gen = ours.scale(t for t in [torch.tensor(1.0), torch.tensor(2.0)])
    assert [float(t) for t in gen] == [8.0, 16.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        ours.scale([1.0])


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_optimizer_without_gradients(backend, fused):
    # torch's outcome is the oracle: with no gradient there is no inf check to record, so a plain
    # optimizer's step() raises (after unscale_), a fused one steps, and update() raises either way.
    outcomes = []
    for scaler in (torch.amp.GradScaler("cpu"), tritonscale.GradScaler("cpu", backend=backend)):
        model = make_model()
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(torch.tensor(1.0))
        if isinstance(scaler, tritonscale.GradScaler):
            assert float(scaler.clip_grad_norm_(opt, 1.0)) == 0.0
        else:
            scaler.unscale_(opt)
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
        outcome = []
        for call, args in ((scaler.step, (opt,)), (scaler.update, ())):
            try:
                call(*args)
                outcome.append("ok")
            except AssertionError as error:
                outcome.append(str(error))
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        outcomes.append((outcome, scaler.get_scale()))
    assert outcomes[0] == outcomes[1]
