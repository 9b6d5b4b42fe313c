"""Training set-ups beyond the basic loop: bf16 without scaling, torch.compile, norm type 1."""

from __future__ import annotations

import math

import pytest
import torch
from test_grad_scaler_oracle import OPTIMIZERS, assert_same_training, make_model, scalers, train

from tritonscale import GradScaler, LossScalePolicy


@pytest.mark.parametrize("how", ["enabled=False", "fixed scale 1"])
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_bf16_without_scaling_still_checks_and_skips(backend, how, fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    if how == "enabled=False":
        scaler = GradScaler("cpu", enabled=False, backend=backend)
    else:
        scaler = GradScaler("cpu", init_scale=1.0, policy=LossScalePolicy.fixed(), backend=backend)
    for bad in (False, True, False):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 6, dtype=torch.bfloat16)).float().sum()).backward()
        if bad:
            model.weight.grad[0, 0] = math.inf
        norm = scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert unchanged == bad and math.isinf(float(norm)) == bad
        assert scaler.get_scale() == 1.0


def test_disabled_scaler_without_clip_is_torchs_plain_step(backend):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False, backend=backend)
    model(torch.ones(1, 3)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    scaler.step(opt)  # no clip_grad_norm_, no check: exactly torch's disabled behaviour
    assert math.isnan(model.weight[0, 0].item())


def test_compiled_model_with_the_scaler_outside(backend):
    # aot_eager runs dynamo and AOT autograd without a C++ toolchain: the scaler sees ordinary grads.
    ours, theirs = scalers(backend)
    compiled = torch.compile(make_model(), backend="aot_eager")
    a = train(ours, OPTIMIZERS["adamw"], clip=0.25, ours=True, model=compiled)
    b = train(theirs, OPTIMIZERS["adamw"], clip=0.25, ours=False)
    assert_same_training(a, b, exact=False)


def test_norm_type_1_matches_torch(backend):
    ours, theirs = scalers(backend)
    a = train(ours, OPTIMIZERS["sgd"], clip=0.25, norm_type=1.0, ours=True)
    b = train(theirs, OPTIMIZERS["sgd"], clip=0.25, norm_type=1.0, ours=False)
    assert_same_training(a, b, exact=False)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_unscaled_torch_backend_clip_is_torchs_bit_for_bit(norm_type):
    # With no scale (a bf16-autocast run, float32 gradients) the torch backend's clip is torch's
    # clip_grad_norm_ op for op: the same per-tensor norms, the same float32 combination, the same
    # coefficient and multiply. (bfloat16 gradients differ on purpose: our norm is float32, torch's
    # is combined and returned in bfloat16; README, "Differences from torch".)
    dtype = torch.float32
    # 40 one-element gradients: each tensor's norm is its value exactly, and these values' float32
    # 2-norm is one ulp from their float64 2-norm rounded (seed 1): a combination in another
    # precision than torch's shows (it did: the lm-bf16 experiment drifted from torch's run).
    torch.manual_seed(1)
    values = torch.rand(40) * 3
    shapes = [(1,)] * len(values)
    grads = [v.reshape(1) for v in values]
    results = []
    for ours in (False, True):
        params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if ours:
            opt = torch.optim.SGD(params, lr=0.1)
            norm = GradScaler("cpu", enabled=False, backend="torch").clip_grad_norm_(opt, 1.0, norm_type)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type)
        results.append((norm.float(), [p.grad for p in params]))
    (their_norm, their_grads), (our_norm, our_grads) = results
    assert torch.equal(our_norm, their_norm)
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))
