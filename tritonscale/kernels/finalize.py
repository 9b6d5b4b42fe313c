"""Finalize: reduce the check pass's partials to the step's device-side results, in one program.

Reads P partial columns (see check_pass) and the loss scale, and writes four fp32 scalars:

    found_inf  1.0 if any gradient was +-inf or NaN, else 0.0
    norm       total norm of the UNSCALED gradients: NaN if any NaN, +inf if any inf,
               else  max_p(m_p) * inv_scale                               (inf-norm)
                     inv_scale / R * sum_p s_p * (R / r_p)^k  ^ (1/k)     (k = 1, 2; R = pow2_inverse(max m_p))
    clip_coef  min(max_norm / (norm + 1e-6), 1)  -- torch.nn.utils.clip_grad_norm_'s rule; 1 without clipping
    factor     inv_scale * clip_coef, the one multiplier the apply pass (or a fused optimizer) needs;
               exactly 1.0 when found_inf, so the apply pass leaves an overflowed step's gradients as
               they came (the step is skipped anyway) and the zero padding of flat buffers stays zero.
               The rule is tritonscale/passes/backends/base.gradient_factor, its one home (what
               every torch-op path calls); device code cannot call Python, so the kernel repeats
               its arithmetic (tests/passes/backends/test_factor_rule.py holds the two to the same bits)

inv_scale = 1 / scale is computed in float64 and rounded to float32, exactly as torch.amp.GradScaler
does. The combination runs in float64, so only a norm above float32's range becomes inf. The
partials are reduced in a fixed order by a single program: identical inputs give identical bits.

With ``step`` (``finalize(..., step=...)``), the same program also decides what the optimizer step
needs, so the step adds no launch (the rules: skip_rule.py):

    max_norm   ZClip's adaptive max_norm from the norm and spike_stats, when ZCLIP_Z is set
    found_inf  also raised by a flag recorded earlier in the iteration (HAS_EARLIER), and, with
               UNFIT_OVERFLOWS, by a fold divisor that is not finite where clip_coef is not 0 (an
               overflow, never a step of zeros where the clip keeps tiny gradients;
               grad_passes.unfit_divisor)
    clip_coef  1 on overflow and factor 1 / scale there, when the policy lets overflowed steps go
               ahead (UNSCALE_ON_OVERFLOW: base.unscaled_on_overflow)
    grad_scale scale / clip_coef (FOLD): what a fused optimizer divides by; float64 division rounded
               once, which is float32's correctly rounded division (torch's)
    skip       the policy's skip_decision over found_inf and the norm (DECIDE)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound_launch import BoundLaunch
from .interfaces import KERNEL_CONSTANTS, PARTIAL_ROWS, RESULT_FIELDS, STEP_FIELDS, FinalizeStep
from .jit_helpers import pow2_inverse
from .launch_config import FINALIZE_MAX_BLOCK, FINALIZE_NUM_WARPS, next_power_of_2
from .skip_rule import skip_decision, zclip_max_norm


@triton.jit
def _found_and_norm(partials_ptr, num_partials, partials_stride, inv_scale, NORM: tl.constexpr, BLOCK_P: tl.constexpr):
    """(found_inf as int1, the unscaled norm in fp32) from the partials, in a fixed order."""
    o_p = tl.arange(0, BLOCK_P)
    big = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.float32)  # sum of |g| over non-finite gradients: 0, +inf or NaN
    for start in range(0, num_partials, BLOCK_P):
        m_p = start + o_p < num_partials  # [BLOCK_P]
        big = tl.maximum(big, tl.max(tl.load(partials_ptr + start + o_p, mask=m_p, other=0.0), axis=0))
        bad += tl.sum(tl.load(partials_ptr + 2 * partials_stride + start + o_p, mask=m_p, other=0.0), axis=0)
    found_inf = bad != 0  # true for +inf and for NaN
    if NORM == 0:
        norm = (big.to(tl.float64) * inv_scale.to(tl.float64)).to(tl.float32)
    else:
        inv_big = pow2_inverse(big)
        total = tl.zeros([], dtype=tl.float64)
        for start in range(0, num_partials, BLOCK_P):
            m_p = start + o_p < num_partials
            b_max = tl.load(partials_ptr + start + o_p, mask=m_p, other=0.0)  # [BLOCK_P]
            b_sum = tl.load(partials_ptr + partials_stride + start + o_p, mask=m_p, other=0.0)
            b_ratio = (inv_big / pow2_inverse(b_max)).to(tl.float64)  # power of two <= 1
            if NORM == 2:
                b_ratio = b_ratio * b_ratio
            total += tl.sum(b_sum.to(tl.float64) * b_ratio, axis=0)
        if NORM == 2:
            total = tl.sqrt(total)
        norm = (total / inv_big.to(tl.float64) * inv_scale.to(tl.float64)).to(tl.float32)
    return found_inf, tl.where(found_inf, bad, norm)  # torch's norm: NaN if any NaN, else +inf


@triton.jit
def _clip(found_inf, norm, max_norm, inv_scale, HAS_CLIP: tl.constexpr, UNSCALE_ON_OVERFLOW: tl.constexpr):
    """(clip_coef, factor): torch's clip coefficient, and base.gradient_factor's rule (1 on
    overflow; ``inv_scale`` there, the clip 1, where overflowed steps go ahead)."""
    if HAS_CLIP:
        clip_coef = tl.minimum(max_norm * (1.0 / (norm + 1e-6)), 1.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        clip_coef = tl.full([], 1.0, dtype=tl.float32)
    if UNSCALE_ON_OVERFLOW:
        clip_coef = tl.where(found_inf, 1.0, clip_coef)
        factor = tl.where(found_inf, inv_scale, inv_scale * clip_coef)
    else:
        factor = tl.where(found_inf, 1.0, inv_scale * clip_coef)
    return clip_coef, factor


@triton.jit
def finalize_kernel(
    partials_ptr,  # fp32 [3, stride]
    num_partials,  # columns in use
    partials_stride,  # row stride, in elements
    scale_ptr,  # fp32 [1] loss scale (device-resident)
    result_ptr,  # fp32 [4] (+2 with a step): found_inf, norm, clip_coef, factor (, grad_scale, skip)
    max_norm,  # fp32 clip threshold (ignored unless HAS_CLIP)
    earlier_ptr,  # fp32 [1] found_inf recorded earlier in the iteration (with HAS_EARLIER, else None)
    norm_stats_ptr,  # fp32 [2] the policy's norm average (read with NORM_FACTOR; None where unread)
    spike_stats_ptr,  # fp64 the spike rules' state (read with SIGMA or ZCLIP_Z; None where unread)
    NORM: tl.constexpr,  # 1, 2, or 0 for the inf-norm
    HAS_CLIP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_EARLIER: tl.constexpr,
    UNFIT_OVERFLOWS: tl.constexpr,  # a fold divisor that is not finite counts as an overflow
    UNSCALE_ON_OVERFLOW: tl.constexpr,  # the policy lets overflowed steps go ahead
    FOLD: tl.constexpr,  # write grad_scale = scale / clip_coef
    DECIDE: tl.constexpr,  # write the step's skip flag
    SKIP_ON_OVERFLOW: tl.constexpr,  # skip_rule.skip_decision's knobs ...
    NORM_ABOVE: tl.constexpr,
    NORM_FACTOR: tl.constexpr,
    NORM_WARMUP: tl.constexpr,
    SIGMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MIN_SEEN: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ZCLIP_Z: tl.constexpr,  # ... and skip_rule.zclip_max_norm's (None: a fixed max_norm)
    ZCLIP_WARMUP: tl.constexpr,
    ZCLIP_PERCENTILE: tl.constexpr,
    ZCLIP_TO_MEAN: tl.constexpr,
    ZCLIP_EPS: tl.constexpr,
    ZCLIP_FACTOR: tl.constexpr,
    K: tl.constexpr = KERNEL_CONSTANTS,  # never passed: the constants (interfaces.py)
):
    scale = tl.load(scale_ptr)
    inv_scale = (1.0 / scale.to(tl.float64)).to(tl.float32)
    found_inf, norm = _found_and_norm(partials_ptr, num_partials, partials_stride, inv_scale, NORM, BLOCK_P)
    if ZCLIP_Z is not None:
        max_norm = zclip_max_norm(
            spike_stats_ptr, norm, max_norm, ZCLIP_Z, ZCLIP_WARMUP, ZCLIP_PERCENTILE, ZCLIP_TO_MEAN, ZCLIP_EPS,
            ZCLIP_FACTOR, K,
        )  # fmt: skip
    clip_coef, factor = _clip(found_inf, norm, max_norm, inv_scale, HAS_CLIP, UNSCALE_ON_OVERFLOW)
    flag = found_inf.to(tl.float32)
    if FOLD:
        grad_scale = (scale.to(tl.float64) / clip_coef.to(tl.float64)).to(tl.float32)
        if UNFIT_OVERFLOWS:  # grad_passes.unfit_divisor, where nothing is read on the host
            unfit = (grad_scale - grad_scale != 0) & (clip_coef != 0)  # max_norm 0's inf stands for the clip
            flag = tl.maximum(flag, unfit.to(tl.float32))
        tl.store(result_ptr + 4, grad_scale)
    if HAS_EARLIER:
        flag = tl.maximum(tl.load(earlier_ptr), flag)
    if DECIDE:
        skip = skip_decision(
            flag, norm, norm_stats_ptr, spike_stats_ptr, SKIP_ON_OVERFLOW, NORM_ABOVE, NORM_FACTOR, NORM_WARMUP,
            SIGMA, WINDOW, MIN_SEEN, BLOCK_W, K,
        )  # fmt: skip
        tl.store(result_ptr + 5, skip.to(tl.float32))
    tl.store(result_ptr, flag)
    tl.store(result_ptr + 1, norm)
    tl.store(result_ptr + 2, clip_coef)
    tl.store(result_ptr + 3, factor)


_FINALIZE = BoundLaunch(finalize_kernel)
_FINALIZE_VARYING = (0, 3, 4, 5, 6, 7, 8)  # partials, scale, result, max_norm and the step's state


def finalize(
    partials: torch.Tensor,
    num_partials: int,
    scale: torch.Tensor,
    norm: int = 2,
    max_norm: float | None = None,
    step: FinalizeStep | None = None,
) -> torch.Tensor:
    """Reduce ``partials[:, :num_partials]``; return a new fp32 [4] tensor (see RESULT_FIELDS), or
    [6] with ``step`` (RESULT_FIELDS + STEP_FIELDS; the fields a step does not ask for are unset).

    ``scale`` is the device-resident loss scale (pass ones to skip unscaling). With ``max_norm``
    None the clip coefficient is 1 and the factor is just ``1 / scale``. The factor follows
    ``tritonscale.passes.backends.base.gradient_factor`` (1 on overflow), the rule's one home.
    ``step``: what else the step needs decided in the same program (:class:`FinalizeStep`).
    """
    if partials.dtype != torch.float32 or partials.shape[0] != PARTIAL_ROWS:
        raise ValueError(f"partials must be a float32 [{PARTIAL_ROWS}, P] tensor")
    if not 1 <= num_partials <= partials.shape[1]:
        raise ValueError(f"num_partials {num_partials} outside 1..{partials.shape[1]}")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != partials.device:
        raise ValueError("scale must be a 1-element float32 tensor on the partials' device")
    fields = len(RESULT_FIELDS) + (len(STEP_FIELDS) if step is not None else 0)
    result = torch.empty(fields, dtype=torch.float32, device=partials.device)
    block_p = min(next_power_of_2(num_partials), FINALIZE_MAX_BLOCK)
    step = step if step is not None else _NO_STEP
    earlier, norm_stats, spike_stats = step.earlier, step.norm_stats, step.spike_stats
    has_clip, stride, constexprs = max_norm is not None, partials.stride(0), step.constexprs
    # What fixes every argument but the tensors and max_norm (BoundLaunch.at): equal sites, equal launches.
    site = (
        num_partials, stride, norm, has_clip, block_p, earlier is None, norm_stats is None, spike_stats is None,
        step.key if step.key is not None else tuple((name, type(value), value) for name, value in constexprs.items()),
    )  # fmt: skip
    _FINALIZE.at(
        site,
        (1,),
        (
            partials, num_partials, stride, scale, result, float(max_norm) if has_clip else 0.0,
            earlier, norm_stats, spike_stats,  # None where unread (a constexpr: neither specialized nor launched)
        ),
        dict(
            NORM=norm, HAS_CLIP=has_clip, BLOCK_P=block_p, HAS_EARLIER=earlier is not None, **constexprs,
            num_warps=FINALIZE_NUM_WARPS,
            # Each operation rounded on its own, as torch's ops round: a fused multiply-add would
            # give the rules' float64 thresholds (ZClip's mean + z * std) other bits. The norm is
            # unchanged (its products are by powers of two: exact either way).
            enable_fp_fusion=False,
        ),
        _FINALIZE_VARYING,
    )  # fmt: skip
    return result


_NO_STEP = FinalizeStep()
