"""Collect an optimizer's gradients, validate them, and sort them for the passes.

Dense float32/bfloat16/float16 gradients (nearly always all of them) go to the kernels, grouped by
device and dtype. Whatever else torch.amp.GradScaler accepts -- float64, non-dense (strided)
and sparse gradients -- goes through torch ops in the same pass (``Grads.other``). Everything is
checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from .dtensor_grads import is_dtensor, local_shard
from .kernels.supported import is_dense, is_supported_grad

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]

#: Gradient layouts already found free of overlaps; a persistent layout is checked once.
_NO_OVERLAP: OrderedDict[tuple, None] = OrderedDict()
_NO_OVERLAP_CACHE_SIZE = 16
_NBYTES = attrgetter("nbytes")


@dataclass
class Grads:
    """An optimizer's gradients, sorted for the passes."""

    #: ``{device: [same-dtype lists]}`` of dense float32/bfloat16/float16 gradients: the kernels'.
    kernel: DeviceGroups = field(default_factory=dict)
    #: ``{device: [tensors]}`` for torch ops: float64 and non-dense gradients, the values of sparse
    #: ones (updated in place through them), and everything when ``kernels=False``.
    other: dict[torch.device, list[torch.Tensor]] = field(default_factory=dict)
    #: The process group the gradients are sharded over (DTensor gradients; see dtensor_grads),
    #: None when this rank's gradients are the whole.
    mesh_group: Any = None

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys([*self.kernel, *self.other]))


def collect_grads(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool, kernels: bool = True, allow_sparse: bool = True
) -> Grads:
    """Every parameter's gradient, validated and sorted for the kernels or for torch ops.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    ``kernels=False`` sends everything to torch ops (a norm type the kernels do not compute);
    ``allow_sparse=False`` refuses sparse gradients (a fused optimizer cannot step with them).
    Runs once per step over every parameter, so the common case is the first test. Gradients that
    share memory (one tensor as two parameters' gradient, overlapping views) are refused: the norm
    would count the shared elements once and the in-place passes scale them twice.
    """
    per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    other: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    dense: dict[torch.device, list[torch.Tensor]] = defaultdict(list)  # for the overlap check
    to_coalesce: list[torch.nn.Parameter] = []
    layouts = _ShardLayouts()
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            grad = layouts.local(grad, g_index, p_index)
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if kernels and is_supported_grad(grad):
                per_device[grad.device][grad.dtype].append(grad)
                dense[grad.device].append(grad)
                continue
            if not grad.is_floating_point():
                raise TypeError(f"{_where(g_index, p_index)} has a non-floating gradient of dtype {grad.dtype}")
            if grad.layout is torch.sparse_coo:
                if not allow_sparse:
                    raise TypeError(
                        f"{_where(g_index, p_index)} has a sparse gradient, and {type(optimizer).__name__} "
                        "steps fused, which takes dense gradients only"
                    )
                if not grad.is_coalesced():
                    to_coalesce.append(param)  # duplicates must be summed before a norm or a check
            elif grad.layout is torch.strided and _overlaps_itself(grad):
                # An in-place pass over it would write one element several times (torch's unscale_
                # fails there too, halfway through); refused before anything runs.
                raise ValueError(
                    f"{_where(g_index, p_index)} has a gradient whose elements share memory (shape "
                    f"{tuple(grad.shape)}, stride {grad.stride()}, e.g. an expanded view): "
                    "it cannot be unscaled in place"
                )
            elif grad.layout is not torch.strided:
                raise TypeError(
                    f"{_where(g_index, p_index)} has a {grad.layout} gradient; supported: strided, sparse_coo"
                )
            elif is_dense(grad):
                dense[grad.device].append(grad)
            other[grad.device].append(grad)
    for device, grads in dense.items():
        if device.type != "meta":  # meta tensors have no memory
            _check_no_overlap(optimizer, grads)
    # Everything is valid: only now replace uncoalesced sparse gradients (same values), as torch does.
    for param in to_coalesce:
        position = next(i for i, g in enumerate(other[param.grad.device]) if g is param.grad)
        param.grad = param.grad.coalesce()
        other[param.grad.device][position] = param.grad
    other_values = {d: [g._values() if g.is_sparse else g for g in grads] for d, grads in other.items()}
    kernel = {device: list(by_dtype.values()) for device, by_dtype in per_device.items()}
    return Grads(kernel=kernel, other=other_values, mesh_group=layouts.group())


class _ShardLayouts:
    """The layouts seen among one optimizer's gradients: plain tensors, or DTensors and the group
    their shards span. One optimizer's gradients must agree, or no one group gives their norm."""

    def __init__(self) -> None:
        self.seen: dict[Any, str] = {}  # group (None: whole on this rank) -> first parameter

    def local(self, grad: torch.Tensor, g_index: int, p_index: int) -> torch.Tensor:
        if not is_dtensor(grad):
            if None not in self.seen:
                self._add(None, _where(g_index, p_index))
            return grad
        local, group = local_shard(grad, _where(g_index, p_index))
        if group not in self.seen:
            self._add(group, _where(g_index, p_index))
        return local

    def _add(self, group: Any, where: str) -> None:
        self.seen[group] = where
        if len(self.seen) > 1:
            first, second = self.seen.values()
            raise ValueError(
                f"the gradients of {first} and {second} are split differently across processes (one "
                "sharded over a device mesh, the other whole on each rank, or two meshes): no one "
                "process group gives their norm; pass process_group= to say which"
            )

    def group(self) -> Any:
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
    if key in _NO_OVERLAP:
        _NO_OVERLAP.move_to_end(key)
        return
    # Dense gradients: the elements of g fill [data_ptr, data_ptr + nbytes). Empty ones hold nothing.
    spans = sorted((start, start + size, i) for i, (start, size) in enumerate(zip(*key)) if size)
    reach, reach_owner = -1, -1
    for start, end, i in spans:
        if start < reach:
            first = _where_is(optimizer, grads[reach_owner])
            second = _where_is(optimizer, grads[i], besides=first)
            raise ValueError(
                f"the gradients of {first} and {second} share memory; each parameter needs a gradient of "
                "its own (the norm would count shared elements once and unscaling would scale them twice)"
            )
        if end > reach:
            reach, reach_owner = end, i
    _NO_OVERLAP[key] = None
    if len(_NO_OVERLAP) > _NO_OVERLAP_CACHE_SIZE:
        _NO_OVERLAP.popitem(last=False)


def _where_is(optimizer: torch.optim.Optimizer, grad: torch.Tensor, besides: str | None = None) -> str:
    """The parameter whose .grad is ``grad`` (one tensor may serve several: not ``besides``)."""
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            if param.grad is grad and _where(g_index, p_index) != besides:
                return _where(g_index, p_index)
    return "an unknown parameter"
