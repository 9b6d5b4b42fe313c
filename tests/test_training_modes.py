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
