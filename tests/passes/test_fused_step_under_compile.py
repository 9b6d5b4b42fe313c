"""torch 2.13's fused optimizers, handed grad_scale / found_inf inside a compiled region.

The fold (``scaler/step_protocols.py``) sets ``grad_scale`` and ``found_inf`` on a fused optimizer for its
step. Eagerly the optimizer divides by ``grad_scale`` and skips on ``found_inf``; traced by Dynamo
(torch 2.13, ``aot_eager``) fused AdamW steps although ``found_inf`` is set, and fused SGD ignores
both ``grad_scale`` and ``found_inf``. That is why ``scaler.step`` hands over the step eagerly
(``scaler/compile_boundary.py``). These tests pin the quirks down: when one fails, a torch release
fixed it, and the hand-over may move into the compiled graph.
"""

from __future__ import annotations

import pytest
import torch

from tritonscale.torch_compat import has_torch

# torch 2.11's Dynamo cannot trace setting grad_scale on an optimizer at all (an AssertionError on
# the setattr), so the quirks pinned below are those of 2.12 and newer.
traces_the_hand_over = pytest.mark.skipif(
    not has_torch((2, 12)), reason="torch<2.12's Dynamo cannot trace optimizer.grad_scale = ...; the quirks are 2.12+'s"
)

LR = 0.1
GRAD, GRAD_SCALE = 2.0, 4.0


def step_delta(kind: str, found_inf: float, compiled: bool) -> torch.Tensor:
    """How far one fused step moves a parameter whose gradient is GRAD * GRAD_SCALE (scaled)."""
    torch._dynamo.reset()
    param = torch.nn.Parameter(torch.linspace(-1, 1, 8))
    optimizer = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)([param], lr=LR, fused=True)
    before = param.detach().clone()
    param.grad = torch.full_like(param, GRAD * GRAD_SCALE)
    grad_scale, flag = torch.tensor(GRAD_SCALE), torch.tensor(found_inf)

    def step() -> None:
        optimizer.grad_scale, optimizer.found_inf = grad_scale, flag
        optimizer.step()
        for name in ("grad_scale", "found_inf"):
            if hasattr(optimizer, name):
                delattr(optimizer, name)

    (torch.compile(step, backend="aot_eager") if compiled else step)()
    return (param.detach() - before).abs()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_eagerly_a_fused_step_skips_on_found_inf(kind):
    assert torch.equal(step_delta(kind, found_inf=1.0, compiled=False), torch.zeros(8))


def test_eagerly_fused_sgd_divides_by_grad_scale():
    torch.testing.assert_close(step_delta("sgd", found_inf=0.0, compiled=False), torch.full((8,), LR * GRAD))


@traces_the_hand_over
def test_torch_2_13_quirk_compiled_fused_adamw_steps_despite_found_inf():
    moved = step_delta("adamw", found_inf=1.0, compiled=True)
    assert (moved > 0).all(), "fixed in this torch: a compiled fused AdamW now skips on found_inf"


@traces_the_hand_over
def test_torch_2_13_quirk_compiled_fused_sgd_ignores_grad_scale_and_found_inf():
    torch.testing.assert_close(
        step_delta("sgd", found_inf=0.0, compiled=True), torch.full((8,), LR * GRAD * GRAD_SCALE)
    )
    moved = step_delta("sgd", found_inf=1.0, compiled=True)
    assert (moved > 0).all(), "fixed in this torch: a compiled fused SGD now skips on found_inf"
