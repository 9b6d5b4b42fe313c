"""Torch backend: the same design with torch's own ops, for CPU tensors (and as a fallback).

The check is one norm pass over the raw gradients that also catches inf/NaN (they propagate into
the norm); the apply is one ``_foreach_mul_`` by the combined factor. That is one read plus one
read+write of gradient memory, against torch's unscale_ (read+write) + norm (read) + clip (read+write).

Like torch, the norm accumulates in float32, so a finite gradient whose square overflows float32
(|g| above ~1.8e19 before unscaling) reads as an overflow here; the Triton kernels scale each block
by a power of two and do not have this limit. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import torch

from .base import CheckResult


def _inv_scale(scale: torch.Tensor) -> torch.Tensor:
    # Same rounding as torch.amp.GradScaler: reciprocal in float64, then float32.
    return scale.double().reciprocal().float()


def _raw_total_norm(grads: list[torch.Tensor], ord: float) -> torch.Tensor:
    """float32 0-dim norm of the raw gradients; inf/NaN when some element is inf/NaN."""
    norms = torch._foreach_norm(grads, ord, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), ord)


class TorchBackend:
    name = "torch"

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        inv_scale = _inv_scale(scale)
        for grads in groups:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult:
        ord = float(norm_type)
        grads = [g for group in groups for g in group if g.numel() > 0]
        inv_scale = _inv_scale(scale)
        if grads:
            raw = _raw_total_norm(grads, ord)
        else:
            raw = torch.zeros((), dtype=torch.float32, device=scale.device)
        found_inf = (~torch.isfinite(raw)).float()
        norm = (raw * inv_scale).reshape(())
        if max_norm is None:
            clip_coef = torch.ones_like(norm)
            factor = inv_scale.reshape(())
        else:
            # torch.nn.utils.clip_grad_norm_'s coefficient, op for op.
            clip_coef = torch.clamp(max_norm * (norm + 1e-6).reciprocal(), max=1.0)
            factor = (inv_scale * clip_coef).reshape(())
        # As in the kernels' finalize: an overflowed step leaves its gradients untouched.
        factor = torch.where(found_inf > 0, torch.ones_like(factor), factor)
        return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=groups)

    def apply_(self, result: CheckResult) -> None:
        for grads in result.plan:
            torch._foreach_mul_(grads, result.factor)
