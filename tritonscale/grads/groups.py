"""Collect an optimizer's gradients, validate them, and sort them for the passes.

Dense float32/bfloat16/float16 gradients (nearly always all of them) are grouped by device and
dtype (``Grads.by_dtype``): a pass sweeps each group in one launch. Whatever else
torch.amp.GradScaler accepts -- float64, non-dense (strided) and sparse gradients -- goes through
torch ops in the same pass (``Grads.other``). Everything is checked before any kernel runs, so a
bad gradient raises with nothing modified.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from ..kernels.supported import is_supported_grad
from . import sharding
from .validation import FP16_REFUSED, check_for_torch_ops, where, where_is
from .flat_grads import known_run, remember_run
from .flat_runs import one_run
from .sharding import ShardLayouts, mesh_group

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]

_NBYTES = attrgetter("nbytes")


@dataclass
class Grads:
    """An optimizer's gradients, sorted for the passes."""

    #: ``{device: [same-dtype lists]}`` of dense float32/bfloat16/float16 gradients: what a pass
    #: sweeps group by group (the Triton kernels, or torch's foreach ops).
    by_dtype: DeviceGroups = field(default_factory=dict)
    #: ``{device: [tensors]}`` for torch ops: float64 and non-dense gradients, the values of sparse
    #: ones (updated in place through them), and everything when ``by_dtype=False``.
    other: dict[torch.device, list[torch.Tensor]] = field(default_factory=dict)
    #: The device mesh of DTensor gradients (None: plain tensors).
    mesh: Any = None
    #: Whether mark_replicated marked any of the gradients' parameters: they need a process group.
    marked_replicas: bool = False
    #: With ``split_replicas``: the gradients another rank counts in the norm (replicated ones
    #: held by a rank that is not their group's first), sorted the same way; None if there are none.
    replicas: Grads | None = None
    #: Collected while Dynamo traced: the dense gradients whose memory the compiled graph checks
    #: for overlaps at run time, with their parameters' names (the passes call
    #: ``torch.ops.tritonscale.check_disjoint`` on them: ``passes/backends/custom_ops.py``).
    unchecked: tuple[list[torch.Tensor], list[str]] | None = None
    #: For a norm: an uncoalesced sparse gradient's values (by ``id`` of the tensor in ``other``)
    #: stand in as its coalesced values in float64; the passes check and scale the stored values.
    norm_stand_ins: dict[int, torch.Tensor] = field(default_factory=dict)

    def for_norm(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (of ``other``) as the norm reads them (``norm_stand_ins``)."""
        return [self.norm_stand_ins.get(id(t), t) for t in tensors] if self.norm_stand_ins else tensors

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys([*self.by_dtype, *self.other]))

    @property
    def mesh_group(self) -> Any:
        """The process group spanning the gradients' mesh (None: plain tensors)."""
        return None if self.mesh is None else mesh_group(self.mesh)


class _Sorter:
    """Sorts validated gradients into a Grads: dense float ones by device and dtype, the rest by device."""

    def __init__(self) -> None:
        self.per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.other: dict[torch.device, list[torch.Tensor]] = defaultdict(list)

    def __bool__(self) -> bool:
        return bool(self.per_device or self.other)

    def grads(self, takes_norm: bool = False) -> Grads:
        """The sorted gradients; sparse ones as their values (the passes update them in place)."""
        other_values, stand_ins = {}, {}
        for device, grads in self.other.items():
            other_values[device] = [g._values() if g.is_sparse else g for g in grads]
            for g, values in zip(grads, other_values[device]):
                if takes_norm and g.is_sparse and not g.is_coalesced():
                    # Its duplicates are summed for the norm only, in float64: scaled near float32's
                    # max their float32 sum may overflow where torch (unscale_ first) sums finite values.
                    stand_ins[id(values)] = g.detach().double().coalesce()._values()
        grouped = {d: list(lists.values()) for d, lists in self.per_device.items()}
        return Grads(by_dtype=grouped, other=other_values, norm_stand_ins=stand_ins)


def collect_grads(
    optimizer: torch.optim.Optimizer,
    *,
    allow_fp16: bool,
    by_dtype: bool = True,
    allow_sparse: bool = True,
    split_replicas: bool = False,
    takes_norm: bool = False,
) -> Grads:
    """Every parameter's gradient (the rank-local part of a DTensor), validated and sorted: dense
    float gradients grouped by device and dtype, the rest per tensor.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    ``by_dtype=False`` sends everything to the per-tensor lists (a norm type the kernels do not compute);
    ``allow_sparse=False`` refuses sparse gradients (a fused optimizer cannot step with them).
    ``split_replicas``: gradients another rank counts in the norm go to ``Grads.replicas``
    (sharding.py). ``takes_norm``: the caller takes a norm, which counts a sparse gradient's
    duplicate entries summed (``Grads.norm_stand_ins``). Only float16 sparse gradients are coalesced
    in place, as torch's unscale_ does (their scaled sums may overflow); the stored values of the
    others are what torch checks and unscales. Gradients that share memory (one tensor as two
    parameters' gradient, overlapping views) are refused: the norm would count the shared elements
    once and the in-place passes scale them twice.

    Example::

        grads = collect_grads(optimizer, allow_fp16=False)
        grads.by_dtype  # {device(type='cpu'): [[g0, g1, ...]]}: one list per dtype
    """
    # While Dynamo traces nothing is proved by address: a traced tensor has none, and the graph
    # runs again on whatever memory its inputs have then. Every gradient goes as itself.
    by_address = not torch.compiler.is_compiling()
    if by_address and by_dtype:
        remembered = _remembered_run(optimizer, allow_fp16)
        if remembered is not None:
            return remembered
    found = _Found(traced=not by_address, split_replicas=split_replicas)
    _sort_every_grad(optimizer, found, allow_fp16=allow_fp16, by_dtype=by_dtype, allow_sparse=allow_sparse)
    if by_address:
        _check_no_overlaps_now(optimizer, found.dense)
    _coalesce(found.to_coalesce)
    result = found.grads(takes_norm)
    if by_dtype and by_address:
        _remember_if_one_run(optimizer, result)
    return result


def _remembered_run(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> Grads | None:
    """The fast path: every gradient is one flatten_grads_ buffer or bucket run, proved again now
    (flat_grads.py), or None. Only for the norms the kernels compute: a norm of partial norms is
    the norm for 1, 2 and inf, not for 0 or negative orders, which also count the buffer's padding.
    Never once mark_replicated was called: the marks are on the parameters, which only a walk sees."""
    run = known_run(optimizer) if not sharding.marked_any else None
    if run is None:
        return None
    if not allow_fp16 and run.dtype is torch.float16:
        raise ValueError(FP16_REFUSED)
    return Grads(by_dtype={run.device: [[run]]})


class _Found:
    """What one collect_grads walk gathers: the gradients this rank counts (``counted``) and those
    another rank counts (``replicas``), the dense ones per device for the overlap check, the sparse
    float16 ones to coalesce once everything is valid, and the DTensor/replica layouts seen. While
    tracing, also the dense gradients' names (``dense_where``), for the run-time overlap check."""

    def __init__(self, *, traced: bool, split_replicas: bool) -> None:
        self.counted, self.replicas = _Sorter(), _Sorter()
        self.dense: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        self.dense_where: dict[torch.device, list[str]] | None = defaultdict(list) if traced else None
        self.to_coalesce: list[tuple[torch.nn.Parameter, _Sorter]] = []
        self.layouts: ShardLayouts | None = None  # made at the first gradient that needs it
        self.first_plain: tuple[int, int] | None = None  # the first plain, unmarked gradient's place
        self.split_replicas = split_replicas

    def local(
        self, param: torch.Tensor, grad: torch.Tensor, g_index: int, p_index: int
    ) -> tuple[torch.Tensor, _Sorter]:
        """The DTensor/replica step: the gradient's rank-local tensor and where it is sorted."""
        if self.layouts is None:
            self.layouts = ShardLayouts(self.first_plain)
        grad, counted_here = self.layouts.local(param, grad, g_index, p_index)
        return grad, self.counted if counted_here or not self.split_replicas else self.replicas

    def add_dense(self, grad: torch.Tensor, g_index: int, p_index: int) -> None:
        """Traced: the bookkeeping of the run-time overlap check (the gradient and its name)."""
        self.dense[grad.device].append(grad)
        if self.dense_where is not None:
            self.dense_where[grad.device].append(where(g_index, p_index))

    def grads(self, takes_norm: bool) -> Grads:
        result = self.counted.grads(takes_norm)
        if self.dense_where is not None:
            result.unchecked = (
                [g for grads in self.dense.values() for g in grads],
                [w for d in self.dense for w in self.dense_where[d]],
            )
        if self.layouts is not None:
            result.mesh, result.marked_replicas = self.layouts.mesh, self.layouts.marked
        result.replicas = self.replicas.grads(takes_norm) if self.replicas else None
        return result


def _sort_every_grad(
    optimizer: torch.optim.Optimizer, found: _Found, *, allow_fp16: bool, by_dtype: bool, allow_sparse: bool
) -> None:
    """Validate each gradient and sort it into ``found``. Runs once per step over every parameter,
    so the common case (a plain dense float32/bfloat16 gradient after the first) is the first test
    and calls nothing outside this module: plain tensors need no layout work once one was seen
    (unless mark_replicated was ever called)."""
    plain_fast = not sharding.marked_any  # then a plain tensor needs no layout work at all
    dense, dense_where = found.dense, found.dense_where
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if plain_fast and type(grad) is torch.Tensor:
                into = found.counted
                if found.first_plain is None:  # kept for the check that no DTensor joins plain tensors
                    found.first_plain = (g_index, p_index)
                    if found.layouts is not None:
                        found.local(param, grad, g_index, p_index)
            else:
                grad, into = found.local(param, grad, g_index, p_index)
            dtype = grad.dtype  # each property read is a call into torch: read once per gradient
            if not allow_fp16 and dtype is torch.float16:
                raise ValueError(FP16_REFUSED)
            if by_dtype and is_supported_grad(grad):
                device = grad.device
                into.per_device[device][dtype].append(grad)
                if dense_where is None:
                    dense[device].append(grad)
                else:
                    found.add_dense(grad, g_index, p_index)
                continue
            name = where(g_index, p_index)
            if check_for_torch_ops(optimizer, grad, name, allow_sparse):
                found.add_dense(grad, g_index, p_index)
            into.other[grad.device].append(grad)
            if grad.dtype is torch.float16 and grad.layout is torch.sparse_coo and not grad.is_coalesced():
                found.to_coalesce.append((param, into))


def _check_no_overlaps_now(optimizer: torch.optim.Optimizer, dense: dict[torch.device, list[torch.Tensor]]) -> None:
    """The eager overlap check, per device (meta tensors have no memory). A traced step checks at
    run time instead (``Grads.unchecked``)."""
    for device, grads in dense.items():
        if len(grads) > 1 and device.type != "meta":  # one gradient overlaps nothing
            _check_no_overlap(optimizer, grads)


def _check_no_overlap(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    """Raise naming two parameters whose gradients' memory overlaps. A layout seen before (gradients
    kept between steps, flat buffers) costs one tuple lookup; a new one, one sort."""
    pair = _first_overlap_seen(tuple(map(torch.Tensor.data_ptr, grads)), tuple(map(_NBYTES, grads)))
    if pair is not None:
        first = where_is(optimizer, grads[pair[0]])
        raise shared_memory_error(first, where_is(optimizer, grads[pair[1]], besides=first))


def _coalesce(to_coalesce: list[tuple[torch.nn.Parameter, _Sorter]]) -> None:
    """Everything is valid: only now replace uncoalesced sparse gradients (same values), as torch does."""
    for param, into in to_coalesce:
        others = into.other[param.grad.device]
        position = next(i for i, g in enumerate(others) if g is param.grad)
        param.grad = param.grad.coalesce()
        others[position] = param.grad


def _remember_if_one_run(optimizer: torch.optim.Optimizer, grads: Grads) -> None:
    """If the gradients (validated just now) are exactly one flatten_grads_ buffer, or one run back
    to back in a bucket, let the next collect_grads take the run after a per-step proof."""
    if grads.other or grads.mesh is not None or grads.marked_replicas or len(grads.by_dtype) != 1:
        return
    (groups,) = grads.by_dtype.values()
    if len(groups) != 1 or groups[0][0]._base is None:
        return
    run = one_run(groups[0])
    if run is not None:
        remember_run(optimizer, run)


def first_overlap(starts: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """Two indices of dense gradients (the elements of each fill [start, start + size) bytes) whose
    memory overlaps, or None. Empty ones hold nothing. One sort.

    Example::

        first_overlap((0, 8, 4), (8, 8, 8))  # (0, 2): the third starts inside the first
    """
    spans = sorted((start, start + size, i) for i, (start, size) in enumerate(zip(starts, sizes)) if size)
    reach, reach_owner = -1, -1
    for start, end, i in spans:
        if start < reach:
            return reach_owner, i
        if end > reach:
            reach, reach_owner = end, i
    return None


#: ``first_overlap`` for the layouts seen last (gradients kept between steps, flat buffers): a pure
#: function of each gradient's (address, bytes), the only things the check reads, so a hit is its
#: answer for the memory as it is now.
_first_overlap_seen = functools.lru_cache(maxsize=16)(first_overlap)


def shared_memory_error(first: str, second: str) -> ValueError:
    """The error for two parameters (named as ``where`` names them) whose gradients share memory."""
    return ValueError(
        f"the gradients of {first} and {second} share memory; each parameter needs a gradient of "
        "its own (the norm would count shared elements once and unscaling would scale them twice)"
    )
