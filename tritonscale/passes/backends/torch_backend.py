"""Torch backend: the same design with torch's own ops, for CPU tensors (and as a fallback).

The check is one norm pass over the raw gradients that also catches inf/NaN (they propagate into
the norm); the apply is one multi-tensor multiply by the combined factor (``_multiply_``). That
is one read plus one read+write of gradient memory, against torch's unscale_ (read+write) + norm
(read) + clip (read+write). Gradients that are views back to back in one buffer go as one tensor
per run (``grads/flat_runs.py``).

Each tensor's norm accumulates in float32, as torch's does, and the per-tensor norms are combined
as torch combines them (float32). The gradients are still scaled, so at the ends of the scale's
range float32 is not enough: where a float32 result overflows while the gradients are finite (a
scaled |g| above ~1.8e19 for the 2-norm, or many such tensors), or is so small that its squares
fell below float32's normal range (a loss scale of 2**-70 on ordinary gradients), float64 stands in
(``wide_norms``). So found_inf means "a gradient is inf/NaN", never "the norm overflowed", and the
norm is right at every scale from the floor (2**-126) to float32's max. For
bfloat16 gradients on CPU each tensor's norm is rounded to bfloat16, as torch's clip_grad_norm_
does (see ``_rounds_norm_to_bf16``); the Triton kernels keep it in float32. The finalize (the norm
unscaled, found_inf, the clip coefficient and the factor) is tensor ops on every device.
"""

from __future__ import annotations

import math

import torch

from ... import host_reads
from ...grads.flat_runs import as_runs, spans_several
from .base import CheckResult, clip_coefficient, gradient_factor, inverse_scale


def _rounds_norm_to_bf16(grads: list[torch.Tensor]) -> bool:
    # bfloat16 on CPU: the native-dtype norm accumulates in float32 and rounds its result once to
    # bfloat16 (torch's own clip_grad_norm_ precision, relative error <= 2**-9 per tensor), while
    # the float32-output norm upcasts every tensor first and runs several times slower. bfloat16
    # has float32's range, so nothing finite overflows either way. float16 (max 65504) always
    # needs the float32 result.
    return grads[0].dtype is torch.bfloat16 and grads[0].device.type == "cpu"


#: Elements per partial norm of a run spanning many gradients (see _run_norm).
RUN_ROW = 4096
#: float16 runs go in slices of this many elements instead (see _run_norm).
RUN_SLICE = 65536


def _run_norm(run: torch.Tensor, ord: float) -> torch.Tensor:
    """float32 norm of a run (or flat buffer) spanning many gradients, as accurate as their norms
    taken one by one. One float32 norm over 16M elements is off by ~6e-4 relative on the CPU (its
    accumulators grow long); partial norms combined are off by ~1e-7 or less. Per dtype, the
    fastest accurate form on the CPU (errors relative, over 16M elements):

    * float32: rows of 4096 reduced along dim 1 (4e-8), faster than one norm over the run;
    * bfloat16: the same rows in bfloat16, rounded once per row as torch rounds each tensor's
      norm (``_rounds_norm_to_bf16``); with a float32 output that reduction is far slower;
    * float16: row norms in float16 would overflow (4096 x 65504^2), and the float32-output row
      reduction is far slower; a foreach norm over 64K-element slices is fast (1.4e-6).

    Only norm types 1, 2 and inf reach the backends, and a norm of partial norms is the norm for each.
    """
    if run.dtype is torch.float16:
        return torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(list(run.split(RUN_SLICE)), ord, dtype=torch.float32)), ord
        )
    rows = run.numel() // RUN_ROW
    native = _rounds_norm_to_bf16([run])
    head = run[: rows * RUN_ROW].view(rows, RUN_ROW)
    parts = [torch.linalg.vector_norm(head, ord, dim=1).float() if native else
             torch.linalg.vector_norm(head, ord, dim=1, dtype=torch.float32)]  # fmt: skip
    if run.numel() > rows * RUN_ROW:
        parts.append(_one_norm(run[rows * RUN_ROW :], ord).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts) if len(parts) > 1 else parts[0], ord)


def _per_tensor_norms(groups: list[list[torch.Tensor]], ord: float) -> torch.Tensor:
    """float32 [T] norms of the raw gradients (same-dtype groups); inf/NaN where an element is (or
    where one tensor's float32 sum overflows)."""
    per_group = []
    for grads in groups:
        if any(spans_several(g) and g.numel() >= 2 * RUN_ROW for g in grads):
            per_group.append(torch.stack([_run_norm(g, ord) if spans_several(g) else _one_norm(g, ord) for g in grads]))
        elif _rounds_norm_to_bf16(grads):
            per_group.append(torch.stack(torch._foreach_norm(grads, ord)).float())
        else:
            per_group.append(torch.stack(torch._foreach_norm(grads, ord, dtype=torch.float32)))
    return per_group[0] if len(per_group) == 1 else torch.cat(per_group)


def _one_norm(grad: torch.Tensor, ord: float) -> torch.Tensor:
    """One gradient's norm, as the foreach paths above take it."""
    if _rounds_norm_to_bf16([grad]):
        return torch._foreach_norm([grad], ord)[0].float()
    return torch._foreach_norm([grad], ord, dtype=torch.float32)[0]


def underflow_floor(ord: float) -> float:
    """The smallest float32 ``ord``-norm that underflow cannot have made inexact.

    A float32 norm sums ``|g|**ord``; a term below float32's normal range (2**-126) rounds to a
    subnormal, off by up to 2**-150. A sum of at least 2**-80 (a norm of at least 2**(-80/ord))
    loses at most n * 2**-150 of it, under 2**-30 relative for 2**40 elements. For ord < 1 and inf
    no term is below |g| itself (exact), but a negative order overflows on tiny terms and comes out
    0: 2**-80 catches that. ``underflow_floor(2.0) == 2.0**-40``."""
    return 2.0 ** (-80.0 / ord) if 1.0 <= ord < math.inf else 2.0**-80


def wide_norms(tensors: list[torch.Tensor], ord: float, norms32: torch.Tensor) -> torch.Tensor:
    """float64 [T] ``ord``-norms of ``tensors``: their float32 norms ``norms32`` where those can be
    trusted, float64 recomputed where not: +inf (an inf element, or finite terms past 3.4e38) or
    below ``underflow_floor`` (terms lost to underflow). float64 holds every power a float32 value
    has for the usual orders (up to 2**256 squared, down to 2**-298).

    On the CPU only the tensors that need it are recomputed, so a step pays one ``any()`` read (a
    float64 pass over everything would cost a multiple of the float32 one). float16 values (2**-24
    to 65504) give terms in float32's normal range for the norm types the kernels take (1, 2, inf),
    so there +inf always means an inf element and nothing is recomputed: an overflowed float16 step
    stays as cheap as before. On a GPU the reduction is bandwidth-bound, so every tensor's terms
    accumulate in float64 at the same bytes and nothing is read back.

    Example: at a loss scale of 2**-80 a float32 gradient of ones has float32 2-norm 0 (each
    square, 2**-160, underflows); ``wide_norms([g], 2.0, norms32)`` gives ``sqrt(g.numel()) * 2**-80``.
    """
    wide = norms32.double()
    suspect = torch.isposinf(norms32) | (norms32 < underflow_floor(ord))
    if not host_reads.are_free(norms32.device):
        return torch.where(suspect, torch.stack(torch._foreach_norm(tensors, ord, dtype=torch.float64)), wide)
    if not bool(suspect.any()):
        return wide
    fp16_exact = ord in (1.0, 2.0, math.inf)
    index = [i for i in suspect.nonzero().flatten().tolist() if not fp16_exact or tensors[i].dtype != torch.float16]
    if not index:
        return wide
    recomputed = torch._foreach_norm([tensors[i] for i in index], ord, dtype=torch.float64)
    return wide.index_put((torch.tensor(index),), torch.stack(recomputed))


#: Mean elements per tensor up to which the CPU apply goes through torch's unscale kernel (_multiply_).
SMALL_TENSORS = 32768


def _multiply_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """g <- g * factor in place (one float32 product per element, rounded once to g's dtype).

    On the CPU, torch's fused unscale kernel does this multiply (and an inf/NaN check whose flag is
    dropped) in one multi-tensor loop, bit for bit as ``_foreach_mul_`` by a float32 0-dim tensor,
    while the foreach op goes tensor by tensor: faster for many small tensors (bfloat16 most of
    all). From ~64K elements per tensor the extra check costs more than the one loop saves, so
    larger tensors keep the foreach op. One float32 tensor (a flat buffer, a bucket's run) takes the
    plain in-place multiply, the same float32 products without the foreach op's overhead; another
    dtype would round the 0-dim float32 factor to its own first, so it keeps the foreach op."""
    if grads[0].device.type == "cpu" and _mean_numel(grads) <= SMALL_TENSORS:
        scratch = torch.zeros((), dtype=torch.float32, device=factor.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, scratch, factor)
    elif len(grads) == 1 and grads[0].dtype is torch.float32:
        grads[0].mul_(factor)
    else:
        torch._foreach_mul_(grads, factor)


def _mean_numel(grads: list[torch.Tensor]) -> float:
    """Elements per tensor, estimated from at most 8 tensors spread over the list (for a choice of
    kernel only: summing 2000 sizes in Python would cost more than the choice saves)."""
    sample = grads[:: max(1, len(grads) // 8)]
    return sum(g.numel() for g in sample) / len(sample)


class TorchBackend:
    name = "torch"

    def unscale_(self, groups: list[list[torch.Tensor]], scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        inv_scale = inverse_scale(scale)
        for grads in groups:
            torch._amp_foreach_non_finite_check_and_unscale_(as_runs(grads), found_inf, inv_scale)

    def check(
        self, groups: list[list[torch.Tensor]], scale: torch.Tensor, norm_type: float, max_norm: float | None
    ) -> CheckResult:
        ord = float(norm_type)
        # Views back to back in one buffer (flatten_grads_, DDP buckets) are read as one run each.
        nonempty = [runs for runs in map(as_runs, groups) if runs]
        per_tensor = (
            _per_tensor_norms(nonempty, ord) if nonempty else torch.zeros(1, dtype=torch.float32, device=scale.device)
        )
        # torch's own combination, in float32: bit for bit torch's clip_grad_norm_ when the scale is 1
        # (a bf16 run). Where it overflows on finite gradients (one tensor's squares, or the sum of
        # many tensors' norms) or falls below the underflow floor, the float64 one stands in.
        raw32 = torch.linalg.vector_norm(per_tensor, ord)
        floor = underflow_floor(ord)
        inv_scale = inverse_scale(scale)
        grads = [g for runs in nonempty for g in runs]
        wide = wide_norms(grads, ord, per_tensor) if nonempty else per_tensor.double()
        raw64 = torch.linalg.vector_norm(wide, ord)
        found_inf = (~torch.isfinite(raw64)).float()
        trusted = torch.isfinite(raw32) & (raw32 >= floor)
        norm = torch.where(trusted, raw32 * inv_scale, (raw64 * inv_scale.double()).float())
        norm = norm.reshape(())
        clip_coef = None if max_norm is None else clip_coefficient(norm, max_norm)
        factor = gradient_factor(found_inf, inv_scale, clip_coef)
        clip_coef = torch.ones_like(norm) if clip_coef is None else clip_coef
        return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=nonempty)

    def apply_(self, result: CheckResult) -> None:
        for grads in result.plan:
            _multiply_(grads, result.factor)
