"""step_protocols.py: how a step is handed the scale is decided once, from one object, and
clip_grad_norm_ and step() ask the same one.

A wrapper whose ``step`` takes ``grad_scaler=`` (apex's and TransformerEngine's protocol) around
torch's fused AdamW: the wrapper's step divides by the plain scale itself, so a clip must not fold
``scale / clip_coef`` into the inner optimizer (no one would hand it over). The oracle is torch's
GradScaler: ``unscale_`` and ``torch.nn.utils.clip_grad_norm_`` leave the gradients unscaled and
clipped in memory.
"""

from __future__ import annotations

import pytest
import torch

from tritonscale import GradScaler
from tritonscale.scaler.step_protocols import StepProtocol

SCALE = 2.0**10


class GradScalerArgumentWrapper:
    """An optimizer wrapper whose step takes ``grad_scaler=`` (torch's older protocol)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def step(self, closure=None, grad_scaler=None):
        return self.optimizer.step()


def _setup(seed: int):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p) * 3 * SCALE
    return params, GradScalerArgumentWrapper(torch.optim.AdamW(params, fused=True))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_clip_through_a_grad_scaler_argument_wrapper_does_not_fold(seed):
    params, wrapper = _setup(seed)
    expected = [p.grad.clone() for p in params]
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    torch_scaler.scale(torch.ones(()))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for twin, grad in zip(twins, expected):
        twin.grad = grad.clone()
    torch_scaler.unscale_(torch.optim.SGD(twins, lr=0.1))
    torch_norm = torch.nn.utils.clip_grad_norm_(twins, max_norm=1.0)

    scaler = GradScaler("cpu", init_scale=SCALE, backend="torch")
    scaler.scale(torch.ones(()))
    assert StepProtocol.of(wrapper, wrapper.optimizer) is StepProtocol.GRAD_SCALER_ARGUMENT
    assert not scaler.folds_clip_into(wrapper)
    norm = scaler.clip_grad_norm_(wrapper, max_norm=1.0)
    assert scaler.folded_grad_scale(wrapper) is None
    torch.testing.assert_close(norm, torch_norm)
    for p, twin in zip(params, twins):
        torch.testing.assert_close(p.grad, twin.grad)  # unscaled and clipped in memory, as torch's


def test_the_fused_optimizer_itself_folds():
    params, wrapper = _setup(2)
    scaler = GradScaler("cpu", init_scale=SCALE, backend="torch")
    scaler.scale(torch.ones(()))
    assert StepProtocol.of(wrapper.optimizer, wrapper.optimizer) is StepProtocol.AMP_ATTRIBUTES
    assert scaler.folds_clip_into(wrapper.optimizer)
    scaler.clip_grad_norm_(wrapper.optimizer, max_norm=1.0)
    assert scaler.folded_grad_scale(wrapper.optimizer) is not None
