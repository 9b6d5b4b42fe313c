"""DTensor gradients (FSDP2, ``torch.distributed.tensor``): the local shard for the passes, and the
process group across which the shards make up the whole.

The kernels run over each rank's local shard (never ``full_tensor()``: that would gather the
model); ``rank_combine`` then combines the norm and found_inf over the mesh dimension the gradients
are sharded along. Replicated dimensions need nothing (every rank holds the same values). A
``Partial`` gradient is a sum still to be reduced: refused, since its norm is not defined yet.
"""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (the import only happens for subclasses)."""
    if type(t) is torch.Tensor or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(grad: torch.Tensor, where: str) -> tuple[torch.Tensor, Any]:
    """The rank-local tensor of a DTensor gradient (same memory: passes write through it) and
    the process group its shards span (None when it is replicated on every mesh dimension)."""
    placements = grad.placements
    partial = [i for i, p in enumerate(placements) if p.is_partial()]
    if partial:
        raise ValueError(
            f"{where} has a DTensor gradient with a Partial placement on mesh dimension {partial[0]}: "
            "reduce it (redistribute to Shard or Replicate) before unscaling or clipping"
        )
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    if len(sharded) > 1:
        raise ValueError(
            f"{where} has a DTensor gradient sharded along mesh dimensions {sharded}: pass the process "
            "group spanning them as process_group="
        )
    group = grad.device_mesh.get_group(mesh_dim=sharded[0]) if sharded else None
    return grad.to_local(), group
