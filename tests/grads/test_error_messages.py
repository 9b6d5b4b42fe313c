"""Errors that say what works instead, for the two mix-ups a new user meets first."""

from __future__ import annotations

import pytest
import torch

import tritonscale


@pytest.mark.parametrize(
    "given",
    [
        lambda model: model.parameters(),
        lambda model: list(model.parameters()),
        lambda model: model,
        lambda model: model.weight,
    ],
    ids=["parameters()", "list", "module", "tensor"],
)
def test_parameters_where_the_optimizer_goes(given):
    """torch.nn.utils.clip_grad_norm_ takes parameters; the scaler's takes the optimizer."""
    model = torch.nn.Linear(4, 2)
    scaler = tritonscale.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"take the optimizer.*scaler\.clip_grad_norm_\(optimizer, max_norm\)"):
        scaler.clip_grad_norm_(given(model), 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_other_wrong_objects_get_the_plain_message():
    scaler = tritonscale.GradScaler("cpu")
    with pytest.raises(TypeError, match="got dict$"):
        scaler.unscale_({})


def test_float16_parameters_with_a_plain_optimizer_name_what_works():
    """torch's message first (code matches on it), then the two ways that work."""
    model = torch.nn.Linear(4, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tritonscale.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients\. .*fused=True.*torch\.autocast"):
        scaler.clip_grad_norm_(optimizer, 1.0)
    # The first of them works: the same float16 model with a fused optimizer clips and steps.
    fused = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    scaler.clip_grad_norm_(fused, 1.0)
    scaler.step(fused)
    scaler.update()
