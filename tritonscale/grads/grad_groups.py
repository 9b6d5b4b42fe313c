"""Collect an optimizer's gradients, validate them, and sort them for the passes.

Dense float32/bfloat16/float16 gradients (nearly always all of them) go to the kernels, grouped by
device and dtype. Whatever else torch.amp.GradScaler accepts -- float64, non-dense (strided)
and sparse gradients -- goes through torch ops in the same pass (``Grads.other``). Everything is
checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from ..kernels.bounded_cache import BoundedCache
from ..kernels.flat_runs import flat_runs
from ..kernels.supported import is_dense, is_supported_grad
from .flat_grads import known_run, remember_run
from .grad_sharding import any_marked, is_dtensor, is_first_rank, local_shard, mesh_group, replica_group

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]

#: torch's error for float16 gradients an in-place unscale would write into, and what works instead.
FP16_REFUSED = (
    "Attempting to unscale FP16 gradients. Unscaled values written back into float16 gradients "
    "underflow and overflow; with float16 parameters use an optimizer made with fused=True "
    "(torch.optim.AdamW, Adam, SGD, Adagrad), whose step divides by the scale itself "
    "(clip_grad_norm_ then folds into it), or keep float32 parameters and run the forward "
    "under torch.autocast"
)

#: Gradient layouts already found free of overlaps, keyed by each gradient's (address, bytes): the
#: check reads nothing else, so a hit is its answer for the memory as it is now.
_NO_OVERLAP: BoundedCache[bool] = BoundedCache(16)
_NBYTES = attrgetter("nbytes")


@dataclass
class Grads:
    """An optimizer's gradients, sorted for the passes."""

    #: ``{device: [same-dtype lists]}`` of dense float32/bfloat16/float16 gradients: the kernels'.
    kernel: DeviceGroups = field(default_factory=dict)
    #: ``{device: [tensors]}`` for torch ops: float64 and non-dense gradients, the values of sparse
    #: ones (updated in place through them), and everything when ``kernels=False``.
    other: dict[torch.device, list[torch.Tensor]] = field(default_factory=dict)
    #: The device mesh of DTensor gradients (None: plain tensors).
    mesh: Any = None
    #: Whether mark_replicated marked any of the gradients' parameters: they need a process group.
    marked_replicas: bool = False
    #: With ``split_replicas``: the gradients another rank counts in the norm (replicated ones
    #: held by a rank that is not their group's first), sorted the same way; None if there are none.
    replicas: Grads | None = None
    #: Collected while Dynamo traced: the dense gradients whose memory the compiled graph checks
    #: for overlaps at run time (``disjoint_at_run_time``), with their parameters' names.
    unchecked: tuple[list[torch.Tensor], list[str]] | None = None
    #: For a norm: an uncoalesced sparse gradient's values (by ``id`` of the tensor in ``other``)
    #: stand in as its coalesced values in float64; the passes check and scale the stored values.
    norm_stand_ins: dict[int, torch.Tensor] = field(default_factory=dict)

    def for_norm(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (of ``other``) as the norm reads them (``norm_stand_ins``)."""
        return [self.norm_stand_ins.get(id(t), t) for t in tensors] if self.norm_stand_ins else tensors

    def disjoint_at_run_time(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """``values`` (tensors the in-place passes depend on), passed through the overlap check of
        the gradients' memory when it could not run at collection (a traced step): the check then
        runs in the graph, at run time, before anything that depends on ``values``."""
        if self.unchecked is None or len(self.unchecked[0]) < 2:
            return values
        grads, names = self.unchecked
        return torch.ops.tritonscale.check_disjoint(grads, "\n".join(names), values)

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys([*self.kernel, *self.other]))

    @property
    def mesh_group(self) -> Any:
        """The process group spanning the gradients' mesh (None: plain tensors)."""
        return None if self.mesh is None else mesh_group(self.mesh)


class _Sorter:
    """Sorts validated gradients into a Grads: kernel groups by device and dtype, the rest by device."""

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
        kernel = {d: list(by_dtype.values()) for d, by_dtype in self.per_device.items()}
        return Grads(kernel=kernel, other=other_values, norm_stand_ins=stand_ins)


def collect_grads(
    optimizer: torch.optim.Optimizer,
    *,
    allow_fp16: bool,
    kernels: bool = True,
    allow_sparse: bool = True,
    split_replicas: bool = False,
    takes_norm: bool = False,
) -> Grads:
    """Every parameter's gradient (the rank-local part of a DTensor), validated and sorted for the
    kernels or for torch ops.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    ``kernels=False`` sends everything to torch ops (a norm type the kernels do not compute);
    ``allow_sparse=False`` refuses sparse gradients (a fused optimizer cannot step with them).
    ``split_replicas``: gradients another rank counts in the norm go to ``Grads.replicas``
    (grad_sharding.py). ``takes_norm``: the caller takes a norm, which counts a sparse gradient's
    duplicate entries summed (``Grads.norm_stand_ins``). Only float16 sparse gradients are coalesced
    in place, as torch's unscale_ does (their scaled sums may overflow); the stored values of the
    others are what torch checks and unscales. Runs once per step over every parameter, so the common case is the first
    test. Gradients that share memory (one tensor as two parameters' gradient, overlapping views)
    are refused: the norm would count the shared elements once and the in-place passes scale them
    twice.
    """
    # All views of one flatten_grads_ buffer or one bucket run, proved again now (flat_grads.py).
    # Only for the norms the kernels compute: a norm of partial norms is the norm for 1, 2 and
    # inf, not for 0 or negative orders, which also count the buffer's padding.
    # While Dynamo traces nothing is proved by address: a traced tensor has none, and the graph
    # runs again on whatever memory its inputs have then. Every gradient goes as itself.
    by_address = not torch.compiler.is_compiling()
    run = known_run(optimizer) if by_address and kernels and not any_marked() else None
    if run is not None:
        if not allow_fp16 and run.dtype is torch.float16:
            raise ValueError(FP16_REFUSED)
        return Grads(kernel={run.device: [[run]]})
    counted, replicas = _Sorter(), _Sorter()
    dense: dict[torch.device, list[torch.Tensor]] = defaultdict(list)  # for the overlap check
    # While tracing, the parameters of ``dense``, in order: for the error of the run-time check.
    dense_where: dict[torch.device, list[str]] | None = None if by_address else defaultdict(list)
    to_coalesce: list[tuple[torch.nn.Parameter, _Sorter]] = []
    layouts = _ShardLayouts()
    # Plain tensors need no layout work once one was seen (unless mark_replicated was ever called):
    # the common case, a per-gradient cost saved on every step.
    plain_fast, plain_seen = not any_marked(), False
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            plain = type(grad) is torch.Tensor
            if plain and plain_seen:
                into = counted
            else:
                grad, counted_here = layouts.local(param, grad, g_index, p_index)
                into = counted if counted_here or not split_replicas else replicas
                plain_seen = plain_seen or (plain and plain_fast)
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError(FP16_REFUSED)
            if kernels and is_supported_grad(grad):
                device = grad.device
                into.per_device[device][grad.dtype].append(grad)
                dense[device].append(grad)
                if dense_where is not None:
                    dense_where[device].append(_where(g_index, p_index))
                continue
            where = _where(g_index, p_index)
            uncoalesced = _sort_for_torch_ops(
                optimizer, grad, into, dense, where, allow_sparse=allow_sparse, dense_where=dense_where
            )
            if uncoalesced and grad.dtype is torch.float16:
                to_coalesce.append((param, into))
    for device, grads in dense.items():
        if device.type != "meta" and by_address:  # meta tensors have no memory
            _check_no_overlap(optimizer, grads)
    _coalesce(to_coalesce)
    result = counted.grads(takes_norm)
    if dense_where is not None:
        result.unchecked = ([g for grads in dense.values() for g in grads], [w for d in dense for w in dense_where[d]])
    result.mesh, result.marked_replicas = layouts.mesh(), layouts.marked
    result.replicas = replicas.grads(takes_norm) if replicas else None
    if kernels and by_address:
        _remember_if_one_run(optimizer, result)
    return result


def _sort_for_torch_ops(
    optimizer: torch.optim.Optimizer,
    grad: torch.Tensor,
    into: _Sorter,
    dense: dict[torch.device, list[torch.Tensor]],
    where: str,
    *,
    allow_sparse: bool,
    dense_where: dict[torch.device, list[str]] | None = None,
) -> bool:
    """Validate a gradient the kernels do not take and sort it for torch ops (``into.other``; a
    dense one also into ``dense``, for the overlap check). True for a sparse gradient still to be
    coalesced once everything is valid."""
    if not grad.is_floating_point():
        raise TypeError(f"{where} has a non-floating gradient of dtype {grad.dtype}")
    uncoalesced = False
    if grad.layout is torch.sparse_coo:
        if not allow_sparse:
            raise TypeError(
                f"{where} has a sparse gradient, and {type(optimizer).__name__} steps fused, which takes dense "
                "gradients only"
            )
        uncoalesced = not grad.is_coalesced()  # duplicates: summed before a norm (collect_grads)
    elif grad.layout is torch.strided and _overlaps_itself(grad):
        # An in-place pass over it would write one element several times (torch's unscale_
        # fails there too, halfway through); refused before anything runs.
        raise ValueError(
            f"{where} has a gradient whose elements share memory (shape {tuple(grad.shape)}, stride "
            f"{grad.stride()}, e.g. an expanded view): it cannot be unscaled in place"
        )
    elif grad.layout is not torch.strided:
        raise TypeError(f"{where} has a {grad.layout} gradient; supported: strided, sparse_coo")
    elif is_dense(grad):
        dense[grad.device].append(grad)
        if dense_where is not None:
            dense_where[grad.device].append(where)
    into.other[grad.device].append(grad)
    return uncoalesced


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
    if grads.other or grads.mesh is not None or grads.marked_replicas or len(grads.kernel) != 1:
        return
    (groups,) = grads.kernel.values()
    if len(groups) != 1 or groups[0][0]._base is None:
        return
    nonempty = [g for g in groups[0] if g.numel()]
    runs = flat_runs(nonempty) if nonempty else None
    if runs is not None and len(runs) == 1:
        remember_run(optimizer, runs[0])


class _ShardLayouts:
    """The layouts seen among one optimizer's gradients: plain tensors, or DTensors on one mesh.
    One optimizer's gradients must agree, or no one group gives their norm."""

    def __init__(self) -> None:
        self.seen: dict[Any, str] = {}  # mesh (None: plain tensors) -> first parameter
        self.marked = False

    def local(self, param: torch.Tensor, grad: torch.Tensor, g_index: int, p_index: int) -> tuple[torch.Tensor, bool]:
        """The gradient's rank-local tensor, and whether this rank counts it in the norm."""
        if not is_dtensor(grad):
            if None not in self.seen:
                self._add(None, _where(g_index, p_index))
            group = replica_group(param)
            if group is None:
                return grad, True
            self.marked = True
            return grad, is_first_rank(group)
        local, mesh, counted = local_shard(grad, _where(g_index, p_index))
        if mesh not in self.seen:
            self._add(mesh, _where(g_index, p_index))
        return local, counted

    def _add(self, mesh: Any, where: str) -> None:
        self.seen[mesh] = where
        if len(self.seen) > 1:
            first, second = self.seen.values()
            raise ValueError(
                f"the gradients of {first} and {second} are split differently across processes (one a "
                "DTensor on a device mesh, the other a plain tensor, or DTensors on two meshes): no "
                "one process group gives their norm"
            )

    def mesh(self) -> Any:
        """The DTensors' mesh, None for plain tensors."""
        return next(iter(self.seen), None)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (a stride-0 or interleaved view). Sorted by
    stride, each dimension must step past everything the smaller ones span; conservative."""
    reach = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < reach:
            return True
        reach = stride * size
    return False


def _where(g_index: int, p_index: int) -> str:
    return f"param_groups[{g_index}]['params'][{p_index}]"


def _check_no_overlap(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    """Raise naming two parameters whose gradients' memory overlaps. A layout seen before (gradients
    kept between steps, flat buffers) costs one tuple lookup; a new one, one sort."""
    key = (tuple(map(torch.Tensor.data_ptr, grads)), tuple(map(_NBYTES, grads)))
    if _NO_OVERLAP.get(key):
        return
    pair = _first_overlap(*key)
    if pair is not None:
        first = _where_is(optimizer, grads[pair[0]])
        raise _shared_memory_error(first, _where_is(optimizer, grads[pair[1]], besides=first))
    _NO_OVERLAP.put(key, True)


def _first_overlap(starts: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """Two indices of dense gradients (the elements of each fill [start, start + size) bytes) whose
    memory overlaps, or None. Empty ones hold nothing. One sort."""
    spans = sorted((start, start + size, i) for i, (start, size) in enumerate(zip(starts, sizes)) if size)
    reach, reach_owner = -1, -1
    for start, end, i in spans:
        if start < reach:
            return reach_owner, i
        if end > reach:
            reach, reach_owner = end, i
    return None


def _shared_memory_error(first: str, second: str) -> ValueError:
    return ValueError(
        f"the gradients of {first} and {second} share memory; each parameter needs a gradient of "
        "its own (the norm would count shared elements once and unscaling would scale them twice)"
    )


@torch.library.custom_op("tritonscale::check_disjoint", mutates_args=())
def check_disjoint(grads: list[torch.Tensor], names: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """A compiled step's overlap check, at run time on the real gradients (``names``: their
    parameters, one per line): raises as ``collect_grads`` does, else returns ``values`` (copies:
    an op's outputs may not alias its inputs)."""
    pair = _first_overlap(tuple(g.data_ptr() for g in grads), tuple(g.nbytes for g in grads))
    if pair is not None:
        where = names.split("\n")
        raise _shared_memory_error(where[pair[0]], where[pair[1]])
    return [v.clone() for v in values]


@check_disjoint.register_fake
def _(grads, names, values):
    return [torch.empty_like(v) for v in values]


def _where_is(optimizer: torch.optim.Optimizer, grad: torch.Tensor, besides: str | None = None) -> str:
    """The parameter whose .grad is ``grad`` (one tensor may serve several: not ``besides``)."""
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            if param.grad is grad and _where(g_index, p_index) != besides:
                return _where(g_index, p_index)
    return "an unknown parameter"
