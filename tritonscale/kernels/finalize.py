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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .check_pass import PARTIAL_ROWS
from .jit_helpers import pow2_inverse
from .launch_config import FINALIZE_MAX_BLOCK, FINALIZE_NUM_WARPS

RESULT_FIELDS = ("found_inf", "norm", "clip_coef", "factor")


@triton.jit
def finalize_kernel(
    partials_ptr,  # fp32 [3, stride]
    num_partials,  # columns in use
    partials_stride,  # row stride, in elements
    scale_ptr,  # fp32 [1] loss scale (device-resident)
    result_ptr,  # fp32 [4]: found_inf, norm, clip_coef, factor
    max_norm,  # fp32 clip threshold (ignored unless HAS_CLIP)
    NORM: tl.constexpr,  # 1, 2, or 0 for the inf-norm
    HAS_CLIP: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    o_p = tl.arange(0, BLOCK_P)
    big = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.float32)  # sum of |g| over non-finite gradients: 0, +inf or NaN
    for start in range(0, num_partials, BLOCK_P):
        m_p = start + o_p < num_partials  # [BLOCK_P]
        big = tl.maximum(big, tl.max(tl.load(partials_ptr + start + o_p, mask=m_p, other=0.0), axis=0))
        bad += tl.sum(tl.load(partials_ptr + 2 * partials_stride + start + o_p, mask=m_p, other=0.0), axis=0)
    found_inf = bad != 0  # true for +inf and for NaN

    inv_scale = (1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)
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
    norm = tl.where(found_inf, bad, norm)  # torch's norm: NaN if any NaN, else +inf

    if HAS_CLIP:
        clip_coef = tl.minimum(max_norm * (1.0 / (norm + 1e-6)), 1.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        clip_coef = tl.full([], 1.0, dtype=tl.float32)
    tl.store(result_ptr, found_inf.to(tl.float32))
    tl.store(result_ptr + 1, norm)
    tl.store(result_ptr + 2, clip_coef)
    # factor: base.gradient_factor's rule (1 on overflow), on the device.
    tl.store(result_ptr + 3, tl.where(found_inf, 1.0, inv_scale * clip_coef))


def finalize(
    partials: torch.Tensor,
    num_partials: int,
    scale: torch.Tensor,
    norm: int = 2,
    max_norm: float | None = None,
) -> torch.Tensor:
    """Reduce ``partials[:, :num_partials]``; return a new fp32 [4] tensor (see RESULT_FIELDS).

    ``scale`` is the device-resident loss scale (pass ones to skip unscaling). With ``max_norm``
    None the clip coefficient is 1 and the factor is just ``1 / scale``. The factor follows
    ``tritonscale.passes.backends.base.gradient_factor`` (1 on overflow), the rule's one home.
    """
    if partials.dtype != torch.float32 or partials.shape[0] != PARTIAL_ROWS:
        raise ValueError(f"partials must be a float32 [{PARTIAL_ROWS}, P] tensor")
    if not 1 <= num_partials <= partials.shape[1]:
        raise ValueError(f"num_partials {num_partials} outside 1..{partials.shape[1]}")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != partials.device:
        raise ValueError("scale must be a 1-element float32 tensor on the partials' device")
    result = torch.empty(len(RESULT_FIELDS), dtype=torch.float32, device=partials.device)
    block_p = min(triton.next_power_of_2(num_partials), FINALIZE_MAX_BLOCK)
    finalize_kernel[(1,)](
        partials,
        num_partials,
        partials.stride(0),
        scale,
        result,
        float(max_norm) if max_norm is not None else 0.0,
        NORM=norm,
        HAS_CLIP=max_norm is not None,
        BLOCK_P=block_p,
        num_warps=FINALIZE_NUM_WARPS,
    )
    return result
