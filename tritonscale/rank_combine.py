"""Combine one step's per-rank results across a torch.distributed process group.

Where each rank holds a part of the gradients (FSDP2 shards, ZeRO partitions, pipeline stages),
the norm and the overflow flag of the step are those of all ranks' gradients together. Each rank
contributes one row, ``[its norm, its found_inf]`` in float64, and a single all-gather
(``all_gather_single``) gives every rank every row. Every rank then combines the rows itself,
in rank order, with the same ops: the results are bitwise the same on every rank whatever order
the transport reduced in (an ``all_reduce`` promises no such thing), and the norm is torch's
combination of per-part norms (``vector_norm`` of the norms), in float64 so no number of ranks can
overflow it. One collective per step, found_inf and norm together (Megatron issues two); it is
enqueued like any other op, so on a GPU nothing waits on the host.

Replicated gradients (DDP after its all-reduce, a DTensor replicated over its mesh) need no
collective: every rank already holds the whole. No process group, no collective.
"""

from __future__ import annotations

from typing import Any

import torch

from .backends import CheckResult, clip_coefficient, inverse_scale

#: A torch.distributed ProcessGroup, or None for "this rank's gradients are the whole".
Group = Any


def check_process_group(group: Group, name: str = "process_group") -> Group:
    """``group`` if it is None or a torch.distributed ProcessGroup of an initialized run."""
    if group is None:
        return None
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
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


def combine_found_inf(found_inf: torch.Tensor, group: Group) -> torch.Tensor:
    """found_inf of all ranks: 1.0 on every rank if any rank saw inf/NaN (one collective)."""
    if group is None:
        return found_inf
    rows = _gather_rows(found_inf.reshape(1).double(), group)
    return (rows.amax() > 0).float().reshape(())


def combine_check(
    result: CheckResult, scale: torch.Tensor, norm_type: float, max_norm: float | None, group: Group
) -> CheckResult:
    """This rank's check result made the group's: the norm over all ranks' gradients, found_inf
    of any rank, and the clip coefficient and factor recomputed from them (one collective).
    ``scale`` is what the gradients still have to be divided by, as in the backends' check."""
    if group is None:
        return result
    row = torch.stack([result.norm.double().reshape(()), result.found_inf.double().reshape(())])
    rows = _gather_rows(row, group)
    found_inf = (rows[:, 1].amax() > 0).float().reshape(())
    norm = torch.linalg.vector_norm(rows[:, 0], norm_type).float().reshape(())
    clip_coef = torch.ones_like(norm) if max_norm is None else clip_coefficient(norm, max_norm)
    factor = torch.where(found_inf > 0, torch.ones_like(norm), (inverse_scale(scale) * clip_coef).reshape(()))
    return CheckResult(found_inf=found_inf, norm=norm, clip_coef=clip_coef, factor=factor, plan=result.plan)
