"""How a gradient is split across processes: its rank-local tensor, the mesh it is split over, and
whether this rank counts it in the norm.

* DTensor gradients (FSDP2, tensor parallelism through ``torch.distributed.tensor``): the passes
  run over the local tensor (never ``full_tensor()``: that would gather the model). Along a
  ``Shard`` mesh dimension each rank holds a different part; along a ``Replicate`` one every rank
  holds the same values, so only the ranks at coordinate 0 there count them (a layer norm
  replicated over a tensor-parallel mesh is counted once). A ``Partial`` gradient is a sum still
  to be reduced: refused, since its norm is not defined yet.
* Plain gradients: whole on this rank, unless ``mark_replicated`` said they are the same on every
  rank of a group (Megatron's duplicated parameters): then only that group's rank 0 counts them.

``rank_combine`` then combines every rank's norm and found_inf in one collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..process_groups import check_process_group
from .validation import where

#: Parameter attribute set by mark_replicated: the group over which its gradient is replicated.
REPLICATED_OVER_ATTR = "_tritonscale_replicated_over"


def mark_replicated(params: Iterable[torch.nn.Parameter], group: Any) -> None:
    """Declare that these parameters' gradients are identical on every rank of ``group``.

    For tensor-parallel layouts with plain tensors (Megatron-style): layer norms and biases are
    replicated inside the tensor-parallel group, and must count once in the global norm. The
    scaler's ``process_group`` still names the group the norm is combined over (tensor- and
    pipeline-parallel ranks); this only says which of its gradients are duplicates.

    Example::

        tritonscale.mark_replicated(
            [p for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")], tp_group
        )
        scaler = tritonscale.GradScaler("cuda", process_group=model_parallel_group)

    Args:
        params: the parameters whose gradients are replicated over ``group``.
        group: the torch.distributed ``ProcessGroup`` they are replicated over.

    Raises:
        TypeError: a ``group`` that is not a ``ProcessGroup``.
        ValueError: a ``group`` this rank is not a member of.
    """
    check_process_group(group, "group", optional=False)
    global marked_any
    for param in params:
        setattr(param, REPLICATED_OVER_ATTR, group)
        marked_any = True


#: Whether mark_replicated was ever called in this process (the flat-buffer shortcut then walks
#: every parameter, to see the marks; read as ``sharding.marked_any`` on the per-step path).
marked_any = False


def any_marked() -> bool:
    """Whether mark_replicated was ever called in this process. Example: ``if not any_marked(): ...``."""
    return marked_any


def replica_group(param: torch.Tensor) -> Any:
    """The group ``mark_replicated`` gave this parameter, or None."""
    return getattr(param, REPLICATED_OVER_ATTR, None)


def is_first_rank(group: Any) -> bool:
    """Whether this process is rank 0 of ``group``: the one that counts the group's replicas."""
    import torch.distributed as dist

    return dist.get_rank(group) == 0


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (the import only happens for subclasses)."""
    if type(t) is torch.Tensor or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(grad: torch.Tensor, where: str) -> tuple[torch.Tensor, Any, bool]:
    """``(local tensor, mesh, counted)`` of a DTensor gradient. The local tensor shares the
    gradient's memory (passes write through it); ``counted``: this rank is at coordinate 0 along
    every mesh dimension that replicates it. Even a gradient replicated on every dimension is
    combined over its mesh (one collective, the replicas counted once), which keeps one rule."""
    placements = grad.placements
    partial = [i for i, p in enumerate(placements) if p.is_partial()]
    if partial:
        raise ValueError(
            f"{where} has a DTensor gradient with a Partial placement on mesh dimension {partial[0]}: "
            "reduce it (redistribute to Shard or Replicate) before unscaling or clipping"
        )
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    replicated = [i for i, p in enumerate(placements) if p.is_replicate()]
    counted = coordinate is not None and all(coordinate[i] == 0 for i in replicated)
    return grad.to_local(), mesh, counted


def mesh_group(mesh: Any) -> Any:
    """The process group spanning every rank of ``mesh``."""
    if mesh.ndim == 1:
        return mesh.get_group()
    import torch.distributed as dist

    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise ValueError(
        f"the gradients are DTensors on a {mesh.ndim}-D device mesh of {mesh.size()} of the "
        f"{dist.get_world_size()} ranks: pass the process group spanning that mesh as process_group="
    )


class ShardLayouts:
    """The layouts seen among one optimizer's gradients: plain tensors, or DTensors on one mesh.
    One optimizer's gradients must agree, or no one group gives their norm. ``mesh``: the DTensors'
    mesh once one was seen (None: plain tensors); ``marked``: a gradient's parameter was marked
    with ``mark_replicated``.

    Example::

        layouts = ShardLayouts()
        local, counted = layouts.local(param, param.grad, 0, 0)  # plain, unmarked: (param.grad, True)
    """

    def __init__(self, first_plain: tuple[int, int] | None = None) -> None:
        self.seen: dict[Any, tuple[int, int]] = {}  # mesh (None: plain tensors) -> first parameter's place
        self.mesh: Any = None
        self.marked = False
        if first_plain is not None:  # a plain gradient the caller sorted before it needed this
            self._add(None, *first_plain)

    def local(self, param: torch.Tensor, grad: torch.Tensor, g_index: int, p_index: int) -> tuple[torch.Tensor, bool]:
        """The gradient's rank-local tensor, and whether this rank counts it in the norm."""
        if not is_dtensor(grad):
            if None not in self.seen:
                self._add(None, g_index, p_index)
            group = replica_group(param)
            if group is None:
                return grad, True
            self.marked = True
            return grad, is_first_rank(group)
        local, mesh, counted = local_shard(grad, where(g_index, p_index))
        if mesh not in self.seen:
            self._add(mesh, g_index, p_index)
        return local, counted

    def _add(self, mesh: Any, g_index: int, p_index: int) -> None:
        self.seen[mesh] = (g_index, p_index)
        self.mesh = next(iter(self.seen))
        if len(self.seen) > 1:
            first, second = (where(*place) for place in self.seen.values())
            raise ValueError(
                f"the gradients of {first} and {second} are split differently across processes (one a "
                "DTensor on a device mesh, the other a plain tensor, or DTensors on two meshes): no "
                "one process group gives their norm"
            )
