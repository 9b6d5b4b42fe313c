"""clip_grad_norm_ folded into fused optimizers: the gradients are read twice and never written by us.

The oracle is torch's unfused path on identical models: torch.amp.GradScaler.unscale_ +
torch.nn.utils.clip_grad_norm_ + the same fused optimizer. The fold passes grad_scale =
scale / clip_coef, so the optimizer divides by a rounded quotient: equal within float tolerance.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from oracles.scaler_twins import bits, same_bits

from tritonscale import GradScaler
from tritonscale.torch_compat import FUSED_ADAGRAD_AMP_SCALING, has_torch

FUSED = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.Tanh(), torch.nn.Linear(24, 2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 10, generator=g), torch.randn(5, 2, generator=g)) for _ in range(10)]
    data[4][0][0, 0] = math.inf
    return model, data


ADAGRAD_BEFORE_2_12 = (
    "fused Adagrad declares amp scaling from torch 2.12; before, it is unscaled in place (tests/test_torch_compat.py)"
)


@pytest.mark.parametrize("name", list(FUSED))
def test_fold_matches_unfused_torch(backend, name):
    if name == "adagrad" and not has_torch(FUSED_ADAGRAD_AMP_SCALING):
        pytest.skip(ADAGRAD_BEFORE_2_12)
    # (torch's fused SGD with momentum never initialises its buffer if its very first step is
    # skipped; the overflow here is at step 4, after the buffer exists.)
    ours_model, data = model_and_data()
    ref_model, _ = model_and_data()
    ours_opt, ref_opt = FUSED[name](ours_model.parameters()), FUSED[name](ref_model.parameters())
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backend=backend)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for x, y in data:
        for model, opt, scaler, is_ours in ((ours_model, ours_opt, ours, True), (ref_model, ref_opt, theirs, False)):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if is_ours:
                raw = [p.grad.clone() for p in model.parameters()]
                norm = scaler.clip_grad_norm_(opt, 0.3)
                # Folded: clip_grad_norm_ wrote nothing (bitwise; the overflow step holds NaN).
                for p, r in zip(model.parameters(), raw):
                    torch.testing.assert_close(p.grad, r, rtol=0, atol=0, equal_nan=True)
            else:
                scaler.unscale_(opt)
                ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale()
        if math.isfinite(float(ref_norm)):
            assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fold_can_be_turned_off(backend):
    model, data = model_and_data()
    opt = FUSED["adamw"](model.parameters())
    scaler = GradScaler("cpu", init_scale=4.0, backend=backend, fold_into_optimizer=False)
    x, y = data[0]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    scaler.clip_grad_norm_(opt, 1e9)
    for p, r in zip(model.parameters(), raw):
        torch.testing.assert_close(p.grad, r / 4.0)  # unscaled in place, like torch


def test_fp16_gradients_go_through_the_fold(backend):
    # Pure-fp16 parameters: torch refuses to unscale them; the fold never writes unscaled fp16.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4).half()), torch.nn.Parameter(torch.randn(4).half())]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=256.0, backend=backend)
    grads = [torch.randn(6, 4), torch.randn(4)]
    for p, r, g in zip(params, ref, grads):
        p.grad = (g * 256.0).half()
        r.grad = p.grad.float() / 256.0
    scaler.scale(torch.ones(()))  # the scale exists from here
    norm = scaler.clip_grad_norm_(opt, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-3)
    scaler.step(opt)
    ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.float(), r, rtol=2e-3, atol=2e-3)


def _near_max_step(backend: str, ours: bool, init_scale: float = 2.0**126):
    """One step at a scale near float32's max whose clip coefficient is small: scale / clip_coef
    (what the fold hands the optimizer) overflows float32."""
    model, data = model_and_data()
    optimizer = FUSED["adamw"](model.parameters())
    x, y = data[0]
    scaler = (
        GradScaler("cpu", init_scale=init_scale, backend=backend)
        if ours
        else torch.amp.GradScaler("cpu", init_scale=init_scale)
    )
    optimizer.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y) * 1e-1).backward()
    if ours:
        norm = scaler.clip_grad_norm_(optimizer, 1e-3)
    else:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    scaler.step(optimizer)
    scaler.update()
    return model, norm, scaler.get_scale()


def test_a_fold_past_float32s_max_skips_never_steps_zeros(backend, forbid_host_reads):
    # No host read to see it: the step counts as an overflow (skipped, the scale backed off) where
    # the optimizer would have divided by inf (AdamW's weight decay alone would then move it).
    model, data = model_and_data()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = FUSED["adamw"](model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**126, backend=backend)
    x, y = data[0]
    with forbid_host_reads.armed():
        scaler.scale(torch.nn.functional.mse_loss(model(x), y) * 1e-1).backward()
        scaler.clip_grad_norm_(optimizer, 1e-3)
        scaler.step(optimizer)
        scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0**125


#: Fused optimizers whose step moves the parameters with zero gradients too: weight decay, momentum.
ZERO_CLIP_FUSED = {
    **FUSED,
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True),
}
#: Per iteration: max_norm 0 (every gradient zeroed, the step applied), then no clipping at all
#: (clip_coef 1: the fold divides by the scale itself, bit for bit torch's unscale); the overflow
#: (model_and_data's step 4) falls on a max_norm 0 iteration.
ZERO_CLIP_MAX_NORMS = (0.0, 1e9)


def _state_bits(optimizer: torch.optim.Optimizer) -> dict:
    return {k: {n: bits(v) for n, v in state.items()} for k, state in optimizer.state_dict()["state"].items()}


@pytest.mark.parametrize("paths", ["cpu", "gpu_paths"])
@pytest.mark.parametrize("tensor_max_norm", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("name", list(ZERO_CLIP_FUSED))
def test_max_norm_0_folds_a_step_of_zeros_as_torch_bit_for_bit(backend, name, tensor_max_norm, paths, request):
    """clip_grad_norm_(opt, 0) zeroes the gradients in torch (clip_coef 0 / (norm + 1e-6) = 0) and
    the step goes ahead; the fold hands the fused optimizer scale / 0 = inf, and a finite gradient
    divided by inf is the same signed zero (grad_passes.unfit_divisor). Against torch's
    GradScaler + clip_grad_norm_ on a twin, bit for bit: parameters, optimizer state, the gradients
    the step leaves, the scale and its tracker, on the CPU paths and on the GPU paths (nothing read
    on the host inside the step)."""
    if name == "adagrad" and not has_torch(FUSED_ADAGRAD_AMP_SCALING):
        pytest.skip(ADAGRAD_BEFORE_2_12)
    guard = request.getfixturevalue("forbid_host_reads") if paths == "gpu_paths" else None
    ours_model, data = model_and_data()
    ref_model, _ = model_and_data()
    ours_opt, ref_opt = ZERO_CLIP_FUSED[name](ours_model.parameters()), ZERO_CLIP_FUSED[name](ref_model.parameters())
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backend=backend)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for step, (x, y) in enumerate(data):
        max_norm = ZERO_CLIP_MAX_NORMS[step % 2]
        max_norm = torch.tensor(max_norm) if tensor_max_norm else max_norm
        for model, opt in ((ref_model, ref_opt), (ours_model, ours_opt)):
            opt.zero_grad()
        theirs.scale(torch.nn.functional.mse_loss(ref_model(x), y)).backward()
        theirs.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        theirs.step(ref_opt)
        theirs.update()
        ours.scale(torch.nn.functional.mse_loss(ours_model(x), y)).backward()
        with guard.armed() if guard is not None else contextlib.nullcontext():
            ours.clip_grad_norm_(ours_opt, max_norm)
            ours.step(ours_opt)
            ours.update()
        where = f"step {step}, max_norm {float(max_norm)}"
        assert ours.get_scale() == theirs.get_scale(), where
        assert ours._get_growth_tracker() == theirs._get_growth_tracker(), where
        for p, q in zip(ours_model.parameters(), ref_model.parameters()):
            assert same_bits(bits(p), bits(q)), f"{where}: parameters differ"
            if step != 4:  # the overflow: ours leaves the scaled gradients as they came (documented)
                assert same_bits(bits(p.grad), bits(q.grad)), f"{where}: gradients differ"
        assert same_bits(_state_bits(ours_opt), _state_bits(ref_opt)), f"{where}: optimizer state differs"
    assert ours.get_scale() == 2.0**11  # grown twice, backed off once: every max_norm 0 step counted as applied
