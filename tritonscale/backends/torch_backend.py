"""Torch backend: the same design with torch's own ops, for CPU tensors (and as a fallback).

The check is one norm pass over the raw gradients that also catches inf/NaN (they propagate into
the norm); the apply is one ``_foreach_mul_`` by the combined factor. That is one read plus one
read+write of gradient memory, against torch's unscale_ (read+write) + norm (read) + clip (read+write).

Each tensor's norm accumulates in float32, as torch's does, and the per-tensor norms are combined
as torch combines them (float32), except where only that sum overflows: there the float64 sum
stands in, so many tensors whose norms are each in range cannot overflow the total. A single
tensor whose scaled norm leaves the float32 range (a finite |g| above ~1.8e19 before unscaling, for
the 2-norm) still reads as an overflow here: the step is skipped and the scale backs off, which
brings the scaled gradients back into range (README, "Differences from torch"). The Triton
kernels scale each block by a power of two and do not have this limit. For bfloat16 gradients on
CPU each tensor's norm is rounded to bfloat16, as torch's clip_grad_norm_ does (see
``_rounds_norm_to_bf16``); the Triton kernels keep it in float32. Nothing here reads a device value
on the host.
"""

from __future__ import annotations

import torch

from .base import CheckResult, clip_coefficient, inverse_scale


def _rounds_norm_to_bf16(grads: list[torch.Tensor]) -> bool:
    # bfloat16 on CPU: the native-dtype norm accumulates in float32 and rounds its result once to
    # bfloat16 (torch's own clip_grad_norm_ precision, relative error <= 2**-9 per tensor), while
    # the float32-output norm upcasts every tensor first and runs ~3x slower (2.2 vs 6.8 ms over
    # 16M elements on the 2-core development machine). bfloat16 has float32's range, so nothing
    # finite overflows either way. float16 (max 65504) always needs the float32 result.
    return grads[0].dtype is torch.bfloat16 and grads[0].device.type == "cpu"


def _per_tensor_norms(groups: list[list[torch.Tensor]], ord: float) -> torch.Tensor:
    """float32 [T] norms of the raw gradients (same-dtype groups); inf/NaN where an element is (or
    where one tensor's float32 squares overflow)."""
    per_group = []
    for grads in groups:
        if _rounds_norm_to_bf16(grads):
            per_group.append(torch.stack(torch._foreach_norm(grads, ord)).float())
        else:
            per_group.append(torch.stack(torch._foreach_norm(grads, ord, dtype=torch.float32)))
    return torch.cat(per_group)


class TorchBackend:
    name = "torch"

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        inv_scale = inverse_scale(scale)
        for grads in groups:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult:
        ord = float(norm_type)
        nonempty = [grads for grads in ([g for g in group if g.numel() > 0] for group in groups) if grads]
        inv_scale = inverse_scale(scale)
        per_tensor = (
            _per_tensor_norms(nonempty, ord) if nonempty else torch.zeros(1, dtype=torch.float32, device=scale.device)
        )
        # torch's own combination, in float32: bit for bit torch's clip_grad_norm_ when the scale is 1
        # (a bf16 run). Where only that sum overflows, the float64 one stands in, so no number of
        # tensors whose norms are each in range can make an overflow.
        raw32 = torch.linalg.vector_norm(per_tensor, ord)
        raw64 = torch.linalg.vector_norm(per_tensor.double(), ord)
        found_inf = (~torch.isfinite(raw64)).float()
        norm = torch.where(torch.isfinite(raw32), raw32 * inv_scale, (raw64 * inv_scale.double()).float()).reshape(())
        if max_norm is None:
            clip_coef = torch.ones_like(norm)
            factor = inv_scale.reshape(())
        else:
            clip_coef = clip_coefficient(norm, max_norm)
            factor = (inv_scale * clip_coef).reshape(())
        # As in the kernels' finalize: an overflowed step leaves its gradients untouched.
        factor = torch.where(found_inf > 0, torch.ones_like(factor), factor)
        return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=groups)

    def apply_(self, result: CheckResult) -> None:
        for grads in result.plan:
            torch._foreach_mul_(grads, result.factor)
