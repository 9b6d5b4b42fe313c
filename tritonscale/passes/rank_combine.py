"""Combine one step's per-rank results across a torch.distributed process group.

Where each rank holds a part of the gradients (FSDP2 shards, ZeRO partitions, pipeline stages),
the norm and the overflow flag of the step are those of all ranks' gradients together. Each rank
contributes one row, ``[its norm, its found_inf]`` in float64 followed by what every rank must
agree on (``rank_checks.py``), and a single all-gather (``all_gather_single``) gives every rank
every row. Every rank then combines the rows itself, in rank order, with the same ops: the results
are bitwise the same on every rank whatever order the transport reduced in (an ``all_reduce``
promises no such thing), and the norm is torch's combination of per-part norms (``vector_norm`` of
the norms), in float64 so no number of ranks can overflow it. One collective per step, found_inf
and norm together (Megatron issues two); it is enqueued like any other op, so on a GPU nothing
waits on the host.

Replicated gradients (DDP after its all-reduce, a DTensor replicated over its mesh) need no
collective: every rank already holds the whole. No process group, no collective.

The ``Updater``'s data-parallel gradient sum (``GradAllReduce``) is an all-reduce per (device,
dtype) whose first buffer also carries each rank's scale and gradient layout, checked the same way.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .backends import CheckResult, clip_coefficient, gradient_factor, inverse_scale
from .rank_checks import STAMP, RankChecks, on_device

#: A torch.distributed ProcessGroup, or None for "this rank's gradients are the whole".
Group = Any


def gradient_group(call_group: Group, scaler_group: Group, mesh_group: Group) -> Group:
    """The group the gradients are split across: the call's, else the scaler's, else their mesh's."""
    if call_group is not None:
        return check_process_group(call_group)
    return scaler_group if scaler_group is not None else mesh_group


def check_process_group(group: Group, name: str = "process_group", *, optional: bool = True) -> Group:
    """``group`` if it is a torch.distributed ProcessGroup of an initialized run (or None, where
    ``optional``); a TypeError naming ``name`` otherwise."""
    if group is None and optional:
        return None
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        allowed = "ProcessGroup or None" if optional else "ProcessGroup"
        raise TypeError(f"{name} must be a torch.distributed {allowed}, got {type(group).__name__}")
    return group


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


def _stamped(values: list[torch.Tensor], group: Group, ranks: RankChecks | None, loss_scale: Any) -> torch.Tensor:
    """This rank's row: ``values`` then the ``STAMP`` columns every rank must agree on."""
    ranks = ranks if ranks is not None else RankChecks()
    scale = loss_scale if loss_scale is not None else torch.ones((), device=values[0].device)
    return torch.cat([torch.stack([v.double().reshape(()) for v in values]), ranks.stamp(group, scale)])


def _judged(found_inf: torch.Tensor, rows: torch.Tensor, first: int, ranks: RankChecks | None) -> torch.Tensor:
    """The group's found_inf, raised to 1 where the ranks' stamps differ (a GPU path: the step is
    skipped); where reads are free a mismatch raises RankMismatchError on every rank instead."""
    mismatch = (ranks if ranks is not None else RankChecks()).judge(rows[:, first:], STAMP)
    return found_inf if mismatch is None else torch.maximum(found_inf, mismatch.to(found_inf.device))


def combine_found_inf(
    found_inf: torch.Tensor, group: Group, ranks: RankChecks | None = None, loss_scale: Any = None
) -> torch.Tensor:
    """found_inf of all ranks: 1.0 on every rank if any rank saw inf/NaN (one collective).
    ``ranks``/``loss_scale``: the scaler's sequence and scale, checked to agree (rank_checks.py)."""
    if group is None:
        return found_inf
    rows = _gather_rows(_stamped([found_inf], group, ranks, loss_scale), group)
    return _judged((rows[:, 0].amax() > 0).float().reshape(()), rows, 1, ranks)


def combine_check(
    result: CheckResult,
    scale: torch.Tensor,
    norm_type: float,
    max_norm: float | None,
    group: Group,
    ranks: RankChecks | None = None,
    loss_scale: Any = None,
) -> CheckResult:
    """This rank's check result made the group's: the norm over all ranks' gradients, found_inf
    of any rank, and the clip coefficient and factor recomputed from them (one collective).
    ``scale`` is what the gradients still have to be divided by, as in the backends' check;
    ``loss_scale`` the scaler's scale (None: disabled), checked to agree with ``ranks``' sequence."""
    if group is None:
        return result
    rows = _gather_rows(_stamped([result.norm, result.found_inf], group, ranks, loss_scale), group)
    found_inf = _judged((rows[:, 1].amax() > 0).float().reshape(()), rows, 2, ranks)
    norm = torch.linalg.vector_norm(rows[:, 0], norm_type).float().reshape(())
    clip_coef = torch.ones_like(norm) if max_norm is None else clip_coefficient(norm, max_norm)
    factor = gradient_factor(found_inf, inverse_scale(scale), clip_coef)
    return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=result.plan)


#: The Updater's header: per rank, 4 bytes each of the scale's float32 bits, the number of
#: gradients and a hash of which parameters have one. One byte per element: exact in every float
#: dtype (bfloat16 holds 0..256), and a sum of one rank's byte with zeros is that byte.
HEADER = ("scale", "gradients", "layout")
_SHIFTS = (0, 8, 16, 24)


class GradAllReduce:
    """Sum the gradients of the optimizer's parameters over a group, checking that the ranks agree.

    The buffers have a slot for every parameter that requires a gradient (zeros where this rank has
    none), so the ranks' buffers have the same sizes even when a parameter is unused on one rank
    (buffers of different sizes abort gloo in C++). The first buffer also carries every rank's
    ``HEADER`` values in that rank's own slots (``world * 12`` elements), and every rank checks
    them (``RankChecks.judge``) before it writes a gradient back. The slot plan is made once per
    layout, keyed by everything it is made from (which parameters, which have a gradient, their
    devices, dtypes and sizes), so a model moved or cast gets a new one."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: tuple[list[tuple[torch.device, torch.dtype, list[torch.Tensor]]], list[int]] | None = None

    def _plan_for(self, params: list[torch.Tensor]) -> tuple[list, list[int]]:
        params = [p for p in params if p.requires_grad or p.grad is not None]
        # Everything the plan is made from (the parameters are held by it, so an id is not reused).
        key = tuple((id(p), p.grad is not None, p.device, _grad_dtype(p), p.numel()) for p in params)
        if key != self._key:
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in params:  # grouped in parameter order: the same groups in the same order on every rank
                groups.setdefault((p.device, _grad_dtype(p)), []).append(p)
            shape = repr([(p.numel(), str(p.dtype), p.grad is not None) for p in params]).encode()
            counts = [sum(p.grad is not None for p in params), zlib.crc32(shape)]
            self._key, self._plan = key, ([(d, t, ps) for (d, t), ps in groups.items()], counts)
        return self._plan

    def __call__(self, params: list[torch.Tensor], group: Group, loss_scale: Any, ranks: RankChecks) -> None:
        import torch.distributed as dist

        plan, counts = self._plan_for(params)
        for index, (device, dtype, members) in enumerate(plan):
            for p in members:
                if p.grad is not None and p.grad.layout is not torch.strided:
                    raise TypeError("the gradient all-reduce takes dense gradients only")
            parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel(), dtype=dtype) for p in members]
            if index == 0:
                parts.append(_header(group, loss_scale, counts, dtype, device))
            flat = torch.cat(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if index == 0:
                world = dist.get_world_size(group)
                ranks.judge(_read_header(flat[-world * 12 :].view(world, 3, 4)), HEADER)
            sizes = [p.numel() for p in members]
            for p, part in zip(members, flat[: sum(sizes)].split(sizes)):
                if p.grad is not None:
                    p.grad.copy_(part.view_as(p.grad))


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient has (``grad_dtype`` where torch lets it differ from ``p``'s)."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _header(group: Group, loss_scale: Any, counts: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[world * 12] zeros but for this rank's 12 bytes (no host read: the scale's bytes are device ops)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = loss_scale if loss_scale is not None else torch.ones((), device=device)
    shifts = on_device(list(_SHIFTS), device, torch.int64)
    bits = scale.detach().reshape(1).to(device, torch.float32).view(torch.int32).long() & 0xFFFFFFFF
    host = [(value >> shift) & 255 for value in counts for shift in _SHIFTS]
    mine = torch.cat([(bits >> shifts) & 255, on_device(host, device, torch.int64)])
    header = torch.zeros(world, 12, dtype=dtype, device=device)
    header[rank] = mine.to(dtype)
    return header.reshape(-1)


def _read_header(header: torch.Tensor) -> torch.Tensor:
    """[world, 3, 4] bytes -> [world, 3] float64: the scale (exact), the count, the hash."""
    shifts = on_device(list(_SHIFTS), header.device, torch.int64)
    values = (header.double().round().long() << shifts).sum(-1)  # [world, 3], each in [0, 2**32)
    bits = torch.where(values[:, 0] >= 2**31, values[:, 0] - 2**32, values[:, 0]).to(torch.int32)
    return torch.stack([bits.view(torch.float32).double(), values[:, 1].double(), values[:, 2].double()], dim=1)
