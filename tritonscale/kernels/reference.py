"""Reference: the three passes restated in plain torch, the oracle the kernels are tested against.

Like flash-linear-attention's ``naive.py`` beside its kernels, this is the independent statement of
what ``check_pass``, ``finalize`` and ``apply_pass`` compute, written the way torch computes it: no
pointers, no tables, no programs, no triton import, and float64 wherever the contract is "the true
value" (the norm, the clip coefficient, the factor). Where the contract is torch's own float32
rounding (``torch_clip_coef``, ``apply_ref``), the reference rounds exactly as torch does, so the
tests can compare those results bit for bit.

    check_ref     the whole group's view of the check pass's partials: max |g| and inf/NaN
    finalize_ref  found_inf, norm, clip_coef, factor of the unscaled gradients
    apply_ref     the gradients after ``g *= factor``
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def inv_scale_of(scale: float) -> float:
    """float32(1 / float64(scale)): torch.amp.GradScaler's rounding of the inverse scale."""
    return f32(1.0 / scale)


def _flat64(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every element of the group in one float64 vector (exact: float64 holds each stored value)."""
    parts = [g.detach().reshape(-1).double() for g in grads]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


@dataclass(frozen=True)
class CheckRef:
    """What the check pass's partials say about the whole group, whatever the program split."""

    max_abs: float  # max |g| over the finite elements (0.0 if none): the max of partials row 0
    has_inf: bool  # some element is +-inf: row 2 holds +inf in some column (unless a NaN shares it)
    has_nan: bool  # some element is NaN: row 2 holds NaN in some column


def check_ref(grads: Sequence[torch.Tensor]) -> CheckRef:
    """max |g| over the finite elements and the inf/NaN flags of a gradient group.

    The norm the partials add up to is not here: it is finalize_ref's, taken over the unscaled
    values as torch takes it."""
    flat = _flat64(grads)
    finite = flat[torch.isfinite(flat)]
    return CheckRef(
        max_abs=finite.abs().max().item() if finite.numel() else 0.0,
        has_inf=bool(torch.isinf(flat).any()),
        has_nan=bool(torch.isnan(flat).any()),
    )


@dataclass(frozen=True)
class FinalizeRef:
    """finalize's four results, in float64 (the kernel writes them rounded to float32)."""

    found_inf: float  # 1.0 if any element is +-inf or NaN, else 0.0
    norm: float  # norm of the unscaled gradients (NaN if any NaN, else inf if any inf)
    clip_coef: float  # min(max_norm / (norm + 1e-6), 1); 1.0 without clipping
    factor: float  # inv_scale * clip_coef; exactly 1.0 when found_inf


def finalize_ref(grads: Sequence[torch.Tensor], scale: float, norm_type: float, max_norm: float | None) -> FinalizeRef:
    """torch's float64 answer: vector_norm of the concatenated unscaled gradients and
    clip_grad_norm_'s coefficient.

    Unscaling multiplies by the float32 inverse scale, as GradScaler.unscale_ does; in float64 each
    product of two float32 values is exact, so only the norm itself rounds."""
    inv = inv_scale_of(scale)
    flat = _flat64(grads)
    norm = torch.linalg.vector_norm(flat * inv, ord=norm_type).item() if flat.numel() else 0.0
    found_inf = 0.0 if bool(torch.isfinite(flat).all()) else 1.0
    clip = 1.0 if max_norm is None else min(max_norm / (norm + 1e-6), 1.0)
    return FinalizeRef(found_inf, norm, clip, 1.0 if found_inf else inv * clip)


def torch_clip_coef(norm: float, max_norm: float) -> float:
    """clip_grad_norm_'s coefficient op for op, in float32, from a given float32 norm."""
    total_norm = torch.tensor(norm, dtype=torch.float32)
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).item()


def apply_ref(grads: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """What ``g *= factor`` must leave in each gradient, as new tensors: the float32 product rounded
    once to g's dtype, like torch._amp_foreach_non_finite_check_and_unscale_."""
    f = torch.tensor(factor, dtype=torch.float32)
    return [(g.float() * f).to(g.dtype) for g in grads]
