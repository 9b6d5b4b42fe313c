"""Check pass: one read-only sweep over a gradient group for the norm and for inf/NaN.

Each persistent program p folds its blocks into three partials (written to column p of the
partials buffer, rows as below) and never writes a gradient:

    row 0  m_p = max |g| over the finite elements it saw
    row 1  s_p = sum (|g| * r_p)^k   with r_p = pow2_inverse(m_p), k = 1 or 2 (0 for the inf-norm)
    row 2  b_p = sum of |g| over the non-finite elements: 0, +inf, or NaN if it saw a NaN

Scaling by a power of two near 1/max keeps every term in [0, 4): a gradient of 3e19 (whose square
overflows float32) stays finite, and the scaling itself rounds nothing. When a later block raises the
running max, the accumulator is rescaled by the (power-of-two) ratio of the two inverses. The values
are the raw, still-scaled gradients: the loss scale is divided out once, in ``finalize``.

Non-finite detection is exact: ``g - g != 0`` holds for +-inf and NaN only. Summing their
magnitudes in one float32 vector (instead of two flag vectors) keeps inf-vs-NaN -- the norm torch
reports -- and saves a register per element (measured: the fp16 table variant spilled on sm_90 with
two int1 flag vectors).

The bits of the partials depend on BLOCK and num_warps (which elements each lane folds, and the
tree that sums a block), so the launch configuration is ``launch_config.check_config``, a pure
function of the device and the size: never autotuned, never timed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound_launch import BoundLaunch
from .interfaces import PARTIAL_ROWS
from .jit_helpers import chunk_span, pow2_inverse, to_f32
from .launch_config import CHUNK, check_config
from .supported import NORM_CODES
from .tensor_table import GradLayout


@triton.jit
def _fold_block(
    b_g,  # [BLOCK] fp32 raw gradient values (0 where masked off)
    b_acc,  # [BLOCK] fp32 running sums, in units of pow2_inverse(run_max)
    run_max,  # fp32 scalar
    b_bad,  # [BLOCK] fp32 running sum of |g| over non-finite elements (0, inf or NaN)
    NORM: tl.constexpr,
):
    b_nonfinite = b_g - b_g != 0
    b_abs = tl.abs(b_g)
    b_bad += tl.where(b_nonfinite, b_abs, 0.0)
    b_abs = tl.where(b_nonfinite, 0.0, b_abs)
    new_max = tl.maximum(run_max, tl.max(b_abs, axis=0))
    if NORM != 0:
        new_inv = pow2_inverse(new_max)
        ratio = new_inv / pow2_inverse(run_max)  # power of two <= 1: exact
        b_r = b_abs * new_inv
        if NORM == 2:
            b_acc = b_acc * (ratio * ratio) + b_r * b_r
        else:
            b_acc = b_acc * ratio + b_r
    return b_acc, new_max, b_bad


@triton.jit
def check_pass_kernel(
    grad_ptr,  # FLAT: the gradient buffer; TABLE: any gradient (gives the element type)
    tensors_ptr,  # int64 [T, 2] (address, numel); unused when FLAT
    chunks_ptr,  # int64 [C, 2] (tensor index, first element); unused when FLAT
    num_items,  # FLAT: elements; TABLE: chunk rows
    partials_ptr,  # fp32 [3, stride]: this group's first column
    partials_stride,  # row stride of the partials buffer, in elements
    NORM: tl.constexpr,  # 1, 2, or 0 for the inf-norm
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,  # TABLE only: addresses 16-byte aligned, sizes multiples of 16
    CHUNK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Offsets past 2**31 elements (docs/architecture.md, "64-bit indexing"): every offset that
    # grows with the program, the block or the size is an int64 scalar folded into a pointer; the
    # per-element offsets stay below BLOCK (FLAT) or CHUNK_SIZE (TABLE, within a chunk).
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    o_block = tl.arange(0, BLOCK)
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    b_bad = tl.zeros([BLOCK], dtype=tl.float32)
    run_max = tl.zeros([], dtype=tl.float32)
    if FLAT:
        for start in range(pid * BLOCK, num_items, num_programs * BLOCK):
            m_g = o_block < num_items - start  # [BLOCK]
            b_g = to_f32(tl.load(grad_ptr + start + o_block, mask=m_g, other=0.0))
            b_acc, run_max, b_bad = _fold_block(b_g, b_acc, run_max, b_bad, NORM)
    else:
        for chunk in range(pid, num_items, num_programs):
            p_chunk, length = chunk_span(tensors_ptr, chunks_ptr, chunk, grad_ptr, CHUNK_SIZE, ALIGNED)
            for start in range(0, length, BLOCK):
                o_g = start + o_block  # [BLOCK], < CHUNK_SIZE: within the chunk
                m_g = o_g < length
                b_g = to_f32(tl.load(p_chunk + o_g, mask=m_g, other=0.0))
                b_acc, run_max, b_bad = _fold_block(b_g, b_acc, run_max, b_bad, NORM)
    p_partial = partials_ptr + pid  # rows a stride apart: pointer steps, never a 32-bit 2 * stride
    tl.store(p_partial, run_max)
    tl.store(p_partial + partials_stride, tl.sum(b_acc, axis=0))
    tl.store(p_partial + partials_stride + partials_stride, tl.sum(b_bad, axis=0))


_CHECK_PASS = BoundLaunch(check_pass_kernel)
_CHECK_VARYING = (0, 1, 2, 4)  # the gradients (or buffer), the tables, the partials


def check_pass(layout: GradLayout, partials: torch.Tensor, norm: int = 2) -> None:
    """Fold ``layout``'s gradients into ``partials[:, :layout.programs]`` (fp32 [3, >=programs]).

    ``partials`` may be a column slice of a larger buffer shared by several groups of one device;
    ``finalize`` then reduces all of them at once. The gradients are only read.
    """
    if partials.dtype != torch.float32 or partials.shape[0] != PARTIAL_ROWS or partials.stride(1) != 1:
        raise ValueError(f"partials must be a float32 [{PARTIAL_ROWS}, P] tensor with unit column stride")
    if partials.shape[1] < layout.programs:
        raise ValueError(f"partials has {partials.shape[1]} columns, the pass needs {layout.programs}")
    if partials.device != layout.device:
        raise ValueError(f"partials on {partials.device}, gradients on {layout.device}")
    if norm not in NORM_CODES.values():
        raise ValueError(
            f"norm code must be one of {sorted(NORM_CODES.values())} (see supported.norm_code), got {norm}"
        )
    config = check_config(layout.device, layout.numel)
    block, warps, stride = config.kwargs["BLOCK"], config.num_warps, partials.stride(0)
    # What fixes every argument but the tensors (BoundLaunch.at): equal sites, equal launches.
    site = (layout.programs, layout.num_items, stride, norm, layout.flat, layout.aligned, block, warps)
    _CHECK_PASS.at(
        site,
        (layout.programs,),
        (layout.first, layout.tensors, layout.chunks, layout.num_items, partials, stride),
        dict(NORM=norm, FLAT=layout.flat, ALIGNED=layout.aligned, CHUNK_SIZE=CHUNK, BLOCK=block, num_warps=warps),
        _CHECK_VARYING,
    )
