"""The backend interface shared by the Triton and torch implementations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...policy.rounding import as_float32


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale with torch.amp.GradScaler's rounding: the reciprocal in float64, then float32
    (the kernels' finalize computes it the same way).

    Computed anew from the scale as it is now, on every call, as torch does: nothing is kept
    between calls. A cache keyed by the scale's version counter went stale where the counter does
    not move -- a write through ``scale.data``, or the scale read as a constant of a compiled
    graph -- and gave norms off by the scale's growth."""
    return scale.double().reciprocal().float()


def clip_coefficient(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient, op for op: min(max_norm / (norm + 1e-6), 1)
    (torch's ``max_norm / x`` is ``x.reciprocal() * max_norm``), on the float32 0-dim ``norm``.
    ``max_norm`` may be a symbolic float of a compiled caller (the multiply rounds it to float32),
    or a one-element tensor, multiplied as float32: torch's clip reads it with ``float()`` and
    multiplies by that, rounded to float32, so the bits are those of the same number passed as a
    float, and nothing is read on the host. The clip's finalize computes the same in the kernels
    (``kernels/finalize.py``). Example: ``clip_coefficient(torch.tensor(4.0), 1.0)`` is about 0.25."""
    shifted = norm + as_float32(1e-6)
    if isinstance(max_norm, torch.Tensor):
        max_norm = max_norm.to(shifted.device, torch.float32).reshape(())
    return torch.clamp(shifted.reciprocal() * max_norm, max=1.0)


def with_clip(result: CheckResult, scale: torch.Tensor, max_norm: float | torch.Tensor) -> CheckResult:
    """``result``, of a check made without clipping, clipped by ``max_norm``: its coefficient and
    factor made from its norm with torch ops, the bits the kernels' finalize gives. For a tensor
    ``max_norm``, and for any while Dynamo traces: the backends take a Python number, which the
    Triton ops would make a constant of the graph. Example: ``with_clip(backend.check(groups,
    scale, 2.0, None), scale, torch.tensor(1.0))``."""
    clip_coef = clip_coefficient(result.norm, max_norm)
    factor = gradient_factor(result.found_inf, inverse_scale(scale), clip_coef)
    return dataclasses.replace(result, clip_coef=clip_coef, factor=factor)


def gradient_factor(
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    clip_coef: torch.Tensor | None = None,
    *,
    unscale_on_overflow: bool = False,
) -> torch.Tensor:
    """What the apply pass multiplies the gradients by: ``inv_scale * clip_coef`` (``inv_scale``
    without clipping), and exactly 1 where ``found_inf``, so an overflowed step's gradients stay as
    they came (the step is skipped anyway) and the zero padding of flat buffers stays zero. With
    ``unscale_on_overflow`` (a policy whose overflowed steps go ahead) ``inv_scale`` there instead:
    unscaled, not clipped, what ``unscale_`` leaves.

    The one home of this rule in tensor ops (0-dim float32 tensors): every torch-op factor is made
    here (the backends, the rank combine, the clip); the kernels' finalize (``kernels/finalize.py``)
    computes the same in its launch. Example: ``gradient_factor(torch.tensor(0.0), torch.tensor(0.5),
    torch.tensor(0.25))`` is 0.125.
    """
    factor = inv_scale if clip_coef is None else inv_scale * clip_coef
    factor, inv_scale = factor.reshape(()), inv_scale.reshape(())
    kept = inv_scale if unscale_on_overflow else torch.full_like(factor, 1.0)
    return torch.where(found_inf > 0, kept, factor)


def unscaled_on_overflow(result: CheckResult, scale: torch.Tensor) -> CheckResult:
    """``result`` for a policy whose overflowed steps go ahead: where it overflowed, ``clip_coef``
    1 (so a fold hands the optimizer the plain scale) and the factor ``1 / scale`` (the gradients
    unscaled, not clipped: what ``unscale_`` leaves). Example: ``unscaled_on_overflow(result, scale)``."""
    clip_coef = torch.where(result.found_inf > 0, torch.ones_like(result.clip_coef), result.clip_coef)
    factor = gradient_factor(result.found_inf, inverse_scale(scale), clip_coef, unscale_on_overflow=True)
    return dataclasses.replace(result, clip_coef=clip_coef, factor=factor)


@dataclass
class CheckResult:
    """Device-side results of the check pass + finalize for one device (0-dim fp32 tensors)."""

    found_inf: torch.Tensor  # 1.0 if any gradient was +-inf or NaN
    norm: torch.Tensor  # total norm of the unscaled gradients
    clip_coef: torch.Tensor  # min(max_norm / (norm + 1e-6), 1), or 1 without clipping
    factor: torch.Tensor  # inv_scale * clip_coef (1 on overflow): what apply_ multiplies by
    plan: Any  # backend-private description of the gradients, reused by apply_
    grad_scale: Any = None  # a folded clip: what the fused optimizer divides by (grad_passes.clip_grads)
    #: The step's skip flag, where the finalize decided it (passes/step_decision.py); found_inf then
    #: holds the flags recorded earlier in the iteration too. None: the step decides.
    skip: Any = None


class Backend(Protocol):
    """Runs the passes for one device. ``groups`` must come from ``grads.groups.collect_grads``,
    which has validated every gradient (dtype, layout, density): backends do not check again, since
    that would walk every parameter a second time each step."""

    name: str

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None: ...

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult: ...

    def apply_(self, result: CheckResult) -> None: ...
