"""One-program kernels for the loop around the scaler: each is the whole of its call's device work.

* ``gather_stats_kernel`` -- ``GradScaler.stats()``: copies the scale, the growth tracker, the last
  norm, the last found_inf and four counters into one fresh buffer, each value in its own dtype (a
  load and a store: the same bits), or NaN / 0 where there is no norm / no found_inf yet. One
  launch instead of a clone per value; ``StepLog`` then copies the one buffer to the host.
* ``advance_lr_kernel`` -- ``SkipAwareLR.step()``: ``count += (skipped <= 0)``, ``calls += 1``, and
  each param group's tensor lr set to its table's entry at ``min(count, total_steps)``. The groups'
  lr tensors are reached through a table of their addresses (``lr_addresses``, int64), so any
  number of groups is one launch.

Both run one program of one warp (a handful of scalars: nothing to spread). A leaf of the package:
the callers pass the counters' slots and the addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound_launch import BoundLaunch
from .interfaces import SLOT_BYTES
from .launch_config import next_power_of_2


@triton.jit
def gather_stats_kernel(
    scale_ptr,
    tracker_ptr,
    norm_ptr,
    found_inf_ptr,
    counters_ptr,
    out_scale,
    out_tracker,
    out_norm,
    out_found_inf,
    out_skipped,
    out_skipped_steps,
    out_consecutive,
    out_hysteresis,
    SKIPPED: tl.constexpr,
    SKIPPED_STEPS: tl.constexpr,
    CONSECUTIVE: tl.constexpr,
    HYSTERESIS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
):
    """out_x <- x for every stat (same dtype in and out); NaN for a missing norm, 0 for a missing found_inf."""
    tl.store(out_scale, tl.load(scale_ptr))
    tl.store(out_tracker, tl.load(tracker_ptr))
    if HAS_NORM:
        tl.store(out_norm, tl.load(norm_ptr))
    else:
        tl.store(out_norm, float("nan"))
    if HAS_FOUND_INF:
        tl.store(out_found_inf, tl.load(found_inf_ptr))
    else:
        tl.store(out_found_inf, 0.0)
    tl.store(out_skipped, tl.load(counters_ptr + SKIPPED))
    tl.store(out_skipped_steps, tl.load(counters_ptr + SKIPPED_STEPS))
    tl.store(out_consecutive, tl.load(counters_ptr + CONSECUTIVE))
    tl.store(out_hysteresis, tl.load(counters_ptr + HYSTERESIS))


_GATHER_STATS = BoundLaunch(gather_stats_kernel)


def gather_stats(
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor],
    slots: tuple[int, int, int, int],
    outs: list[torch.Tensor],
) -> None:
    """Launch ``gather_stats_kernel``: ``sources`` (scale, growth tracker, norm or None, found_inf
    or None, counters), ``slots`` (the counters' skipped, skipped_steps, consecutive, hysteresis
    indices), ``outs`` (eight 0-dim views of one buffer, in that order: scale, tracker, norm,
    found_inf, then the four counters)."""
    scale, tracker, norm, found_inf, counters = sources
    _GATHER_STATS(
        (1,),
        scale,
        tracker,
        scale if norm is None else norm,  # a placeholder: not read without HAS_NORM
        scale if found_inf is None else found_inf,
        counters,
        *outs,
        *slots,
        HAS_NORM=norm is not None,
        HAS_FOUND_INF=found_inf is not None,
        num_warps=1,
    )


@triton.jit
def advance_lr_kernel(
    skipped_ptr,
    count_ptr,
    calls_ptr,
    tables_ptr,
    lr_addresses,
    total_steps,
    NUM_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """count += (skipped <= 0); calls += 1; lr[g] <- tables[g, min(count, total_steps)] for each group g."""
    applied = (tl.load(skipped_ptr) <= 0).to(tl.int64)
    count = tl.load(count_ptr) + applied
    tl.store(count_ptr, count)
    tl.store(calls_ptr, tl.load(calls_ptr) + 1)
    index = tl.minimum(count, total_steps)
    groups = tl.arange(0, BLOCK_G)
    mask = groups < NUM_GROUPS
    rates = tl.load(tables_ptr + groups * (total_steps + 1) + index, mask=mask)
    addresses = tl.load(lr_addresses + groups, mask=mask, other=0)
    tl.store(addresses.to(tl.pointer_type(tables_ptr.dtype.element_ty)), rates, mask=mask)


_ADVANCE_LR = BoundLaunch(advance_lr_kernel)


def advance_lr(
    skipped: torch.Tensor, count: torch.Tensor, calls: torch.Tensor, tables: torch.Tensor, lr_addresses: torch.Tensor
) -> None:
    """Launch ``advance_lr_kernel``: ``tables`` [groups, total_steps + 1] in the lrs' dtype,
    ``lr_addresses`` int64 [groups] (each group's lr tensor, of that dtype, on the same device)."""
    groups = tables.shape[0]
    _ADVANCE_LR(
        (1,),
        skipped,
        count,
        calls,
        tables,
        lr_addresses,
        tables.shape[1] - 1,
        NUM_GROUPS=groups,
        BLOCK_G=next_power_of_2(groups),
        num_warps=1,
    )


__all__ = ["SLOT_BYTES", "advance_lr", "advance_lr_kernel", "gather_stats", "gather_stats_kernel"]
