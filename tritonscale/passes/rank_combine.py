"""Combine one step's per-rank results across a torch.distributed process group.

Where each rank holds a part of the gradients (FSDP2 shards, ZeRO partitions, pipeline stages),
the norm and the overflow flag of the step are those of all ranks' gradients together. Each rank
contributes one row of a fixed width, ``[its norm, its found_inf, whether it holds gradients]`` in
float64 followed by everything every rank must agree on (``rank_validation.py``), and a single
all-gather (``all_gather_single``) gives every rank every row. Every rank then combines the rows
itself, in rank order, with the same ops: the results
are bitwise the same on every rank whatever order the transport reduced in (an ``all_reduce``
promises no such thing), and the norm is what one process holding every gradient computes
(``combined_norm``), in float64 so no number of ranks can overflow it. One collective per step, found_inf
and norm together (Megatron issues two); it is enqueued like any other op, so on a GPU nothing
waits on the host.

Replicated gradients (DDP after its all-reduce, a DTensor replicated over its mesh) need no
collective: every rank already holds the whole. No process group, no collective.

The ``Updater``'s data-parallel gradient sum (``GradAllReduce``) gathers and checks the same row
first, then all-reduces one buffer per device.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..flags import combine_flags
from ..process_groups import Group, check_process_group
from .backends import CheckResult, clip_coefficient, gradient_factor, inverse_scale
from .rank_validation import AGREED, RESULTS, Agreement, CallKind, RankChecks, digest, layout_digest, on_device


def gradient_group(call_group: Group, scaler_group: Group, mesh_group: Group) -> Group:
    """The group the gradients are split across: the call's, else the scaler's, else their mesh's."""
    if call_group is not None:
        return check_process_group(call_group)
    return scaler_group if scaler_group is not None else mesh_group


def _gather_rows(row: torch.Tensor, group: Group) -> torch.Tensor:
    """[world, len(row)]: every rank's ``row`` in rank order, one collective."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = row.new_empty(world * row.numel())  # flat: gloo refuses the stacked [world, k] form
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        all_gather(rows, row.reshape(-1), group=group)
    except RuntimeError as error:  # gloo/NCCL: a peer closed the connection, or the group's timeout
        raise RuntimeError(
            f"tritonscale: combining this step's norm and found_inf across the {world} ranks of the "
            "process group failed: a rank died, raised, or did not reach the same unscale_/"
            f"clip_grad_norm_/step call ({error})"
        ) from error
    return rows.view(world, row.numel())


def _row(results: list[torch.Tensor], group: Group, agreement: Agreement | None) -> torch.Tensor:
    """This rank's row, of one width for every call: its ``RESULTS`` then the ``AGREED`` columns."""
    agreement = agreement if agreement is not None else Agreement(RankChecks(), None)
    device = results[0].device
    scale = agreement.loss_scale if agreement.loss_scale is not None else torch.ones((), device=device)
    layout = on_device([layout_digest(agreement.optimizer)], device).reshape(())
    mine = torch.stack([v.to(device, torch.float64).reshape(()) for v in [*results, layout]])
    return torch.cat([mine, agreement.ranks.stamp(group, scale.to(device, non_blocking=True), agreement)])


def _judged(found_inf: torch.Tensor, rows: torch.Tensor, agreement: Agreement | None) -> torch.Tensor:
    """The group's found_inf, raised to 1 where the ranks' agreed columns differ (a GPU path: the
    step is skipped); where reads are free a mismatch raises RankMismatchError on every rank instead."""
    ranks = agreement.ranks if agreement is not None else RankChecks()
    mismatch = ranks.judge(rows[:, len(RESULTS) :], AGREED)
    ranks.remember_partners(
        agreement.optimizer if agreement is not None else None, rows[:, RESULTS.index("layout_here")]
    )
    return found_inf if mismatch is None else torch.maximum(found_inf, mismatch.to(found_inf.device))


def combine_rank_flags(
    flags: dict[torch.device, torch.Tensor], group: Group, agreement: Agreement, device: torch.device
) -> dict[torch.device, torch.Tensor]:
    """A pass's found_inf per device made the group's (one collective), as ``{device: flag}`` on
    the first flag's device (``device`` where this rank has no gradient: an empty partition still
    takes part, or the others would wait, and keeps the group's flag). No group: ``flags`` as they are."""
    if group is None:
        return flags
    device = next(iter(flags), device)
    local = combine_flags([t.to(device, non_blocking=True) for t in flags.values()])
    local = local if local is not None else torch.zeros((), device=device)
    return {device: combine_found_inf(local, group, agreement)}


def combine_found_inf(found_inf: torch.Tensor, group: Group, agreement: Agreement | None = None) -> torch.Tensor:
    """found_inf of all ranks: 1.0 on every rank if any rank saw inf/NaN (one collective). The row
    is as wide as a clip's, its ``agreement`` checked the same way (rank_validation.py)."""
    if group is None:
        return found_inf
    zero = torch.zeros((), dtype=torch.float64, device=found_inf.device)
    rows = _gather_rows(_row([zero, found_inf, zero], group, agreement), group)
    return _judged((rows[:, 1].amax() > 0).float().reshape(()), rows, agreement)


def combined_norm(norms: torch.Tensor, holds_grads: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of all ranks' gradients from each rank's norm (float64 [world]), as one process
    holding them all computes it (torch's clip_grad_norm_: the ``norm_type`` norm of per-tensor
    norms). For orders > 0 that is the norm of the ranks' norms. Order 0 counts (the tensors with a
    nonzero element), so the counts add up. Negative orders (-inf: the smallest) must not see the
    0 of a rank that holds no gradient. Example: ``combined_norm(rows[:, 0], rows[:, 2], 2.0)``."""
    if norm_type == 0:
        return norms.sum()
    if norm_type < 0:
        norms = torch.where(holds_grads > 0, norms, torch.full_like(norms, math.inf))
        total = torch.linalg.vector_norm(norms, norm_type)
        return torch.where((holds_grads > 0).any(), total, torch.zeros_like(total))
    return torch.linalg.vector_norm(norms, norm_type)


def combine_check(
    result: CheckResult,
    scale: torch.Tensor,
    norm_type: float,
    max_norm: float | None,
    group: Group,
    agreement: Agreement | None = None,
    holds_grads: bool = True,
) -> CheckResult:
    """This rank's check result made the group's: the norm over all ranks' gradients, found_inf
    of any rank, and the clip coefficient and factor recomputed from them (one collective).
    ``scale`` is what the gradients still have to be divided by, as in the backends' check;
    ``agreement`` what the ranks must agree on (rank_validation.py); ``holds_grads``: whether this
    rank holds any gradient element (an empty partition's norm is no part of a negative order's)."""
    if group is None:
        return result
    holds = torch.full((), float(holds_grads), dtype=torch.float64).to(result.norm.device, non_blocking=True)
    rows = _gather_rows(_row([result.norm, result.found_inf, holds], group, agreement), group)
    found_inf = _judged((rows[:, 1].amax() > 0).float().reshape(()), rows, agreement)
    norm = combined_norm(rows[:, 0], rows[:, 2], norm_type).float().reshape(())
    clip_coef = torch.ones_like(norm) if max_norm is None else clip_coefficient(norm, max_norm)
    factor = gradient_factor(found_inf, inverse_scale(scale), clip_coef)
    return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=result.plan)


class GradAllReduce:
    """Sum the gradients of the optimizer's parameters over a group, checking that the ranks agree.

    First every rank's row (``rank_validation``: the scale, the call, the Updater's clip arguments and
    the gradient layout, in a fixed-width row) is gathered and checked, so ranks that disagree raise
    before any gradient is summed (on the CPU; on a GPU path the step is skipped). Then one float32
    buffer per device (float64 where a gradient is float64) holds a slot for every parameter that
    requires a gradient (zeros where this rank has none): its size depends only on the parameters'
    sizes, never on which of them have a gradient or in which float dtype (buffers of different
    sizes abort gloo in C++), and float16/bfloat16 gradients are summed in float32 and rounded once
    to their dtype (for two ranks, exactly their own addition). The slot plan is made once per
    layout, keyed by everything it is made from (which parameters, which have a gradient, their
    devices, dtypes and sizes)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: tuple[list[tuple[torch.device, torch.dtype, list[torch.Tensor]]], tuple[int, int]] | None = None

    def _plan_for(self, params: list[torch.Tensor]) -> tuple[list, tuple[int, int]]:
        params = [p for p in params if p.requires_grad or p.grad is not None]
        # Everything the plan is made from (the parameters are held by it, so an id is not reused).
        key = tuple((id(p), p.grad is not None, p.device, _grad_dtype(p), p.numel()) for p in params)
        if key != self._key:
            groups: dict[torch.device, list[torch.Tensor]] = {}
            for p in params:  # grouped in parameter order: the same groups in the same order on every rank
                groups.setdefault(p.device, []).append(p)
            plan = [(d, _sum_dtype(ps), ps) for d, ps in groups.items()]
            layout = digest([(p.numel(), str(_grad_dtype(p)), p.grad is not None) for p in params])
            self._key, self._plan = key, (plan, (sum(p.grad is not None for p in params), layout))
        return self._plan

    def __call__(self, params: list[torch.Tensor], group: Group, agreement: Agreement) -> None:
        import torch.distributed as dist

        plan, (gradients, layout) = self._plan_for(params)
        for _, _, members in plan:
            for p in members:
                if p.grad is not None and p.grad.layout is not torch.strided:
                    raise TypeError("the gradient all-reduce takes dense gradients only")
        if not plan:
            return
        agreement = dataclasses.replace(agreement, kind=CallKind.GRADIENT_SUM, gradients=gradients, layout=layout)
        zero = torch.zeros((), dtype=torch.float64, device=plan[0][0])
        rows = _gather_rows(_row([zero, zero, zero], group, agreement), group)  # a collective: the check
        _judged(zero, rows, agreement)
        for _, dtype, members in plan:  # a collective per device: the sum
            flat = torch.cat([_slot(p, dtype) for p in members])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            sizes = [p.numel() for p in members]
            for p, part in zip(members, flat.split(sizes)):
                if p.grad is not None:
                    p.grad.copy_(part.view_as(p.grad))


def _slot(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``p``'s gradient flattened in the buffer's ``dtype``; zeros where it has none."""
    return p.grad.reshape(-1).to(dtype) if p.grad is not None else p.new_zeros(p.numel(), dtype=dtype)


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient has (``grad_dtype`` where torch lets it differ from ``p``'s)."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _sum_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """float64 if any of the gradients is, else float32: the one dtype the ranks sum a device's in."""
    return torch.float64 if any(_grad_dtype(p) is torch.float64 for p in params) else torch.float32
