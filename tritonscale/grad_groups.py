"""Collect an optimizer's gradients, validate them, and group them by device and dtype.

Everything is checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from operator import attrgetter

import torch

from .kernels.supported import is_supported_grad, raise_unsupported_grad

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]

#: Gradient layouts already found free of overlaps; a persistent layout is checked once.
_NO_OVERLAP: OrderedDict[tuple, None] = OrderedDict()
_NO_OVERLAP_CACHE_SIZE = 16
_NBYTES = attrgetter("nbytes")


def collect_grads(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> DeviceGroups:
    """``{device: [grads of one dtype, ...]}`` for every parameter with a gradient.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    Runs once per step over every parameter, so the checks are the cheap ones first. Gradients
    that share memory (one tensor as two parameters' gradient, overlapping views) are refused:
    the norm would count the shared elements once and the in-place passes scale them twice.
    """
    per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if not is_supported_grad(grad):
                raise_unsupported_grad(grad, _where(g_index, p_index))
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            per_device[grad.device][grad.dtype].append(grad)
    groups = {device: list(by_dtype.values()) for device, by_dtype in per_device.items()}
    for device, device_groups in groups.items():
        if device.type != "meta":  # meta tensors have no memory
            _check_no_overlap(optimizer, [g for grads in device_groups for g in grads])
    return groups


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
