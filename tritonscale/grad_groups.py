"""Collect an optimizer's gradients, validate them, and group them by device and dtype.

Everything is checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import torch

from .kernels.supported import is_supported_grad, raise_unsupported_grad

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]

#: Gradient layouts already found free of overlaps; a persistent layout is checked once.
_NO_OVERLAP: OrderedDict[tuple, None] = OrderedDict()
_NO_OVERLAP_CACHE_SIZE = 16


def collect_grads(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> DeviceGroups:
    """``{device: [grads of one dtype, ...]}`` for every parameter with a gradient.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    Runs once per step over every parameter, so the checks are the cheap ones first. Gradients
    that share memory (one tensor as two parameters' gradient, overlapping views) are refused:
    the norm would count the shared elements once and the in-place passes scale them twice.
    """
    per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    spans: dict[torch.device, list[tuple[int, int, int, int]]] = defaultdict(list)
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
            if grad.numel() and grad.device.type != "meta":  # meta tensors have no memory
                start = grad.data_ptr()  # dense: the elements fill [start, start + nbytes)
                spans[grad.device].append((start, start + grad.numel() * grad.element_size(), g_index, p_index))
    for device_spans in spans.values():
        _check_no_overlap(device_spans)
    return {device: list(by_dtype.values()) for device, by_dtype in per_device.items()}


def _where(g_index: int, p_index: int) -> str:
    return f"param_groups[{g_index}]['params'][{p_index}]"


def _check_no_overlap(spans: list[tuple[int, int, int, int]]) -> None:
    """Raise naming two parameters whose gradients' memory overlaps. One sort per new layout
    (gradients kept between steps, flat buffers: checked once), a tuple lookup after that."""
    key = tuple((start, end) for start, end, _, _ in spans)
    if key in _NO_OVERLAP:
        _NO_OVERLAP.move_to_end(key)
        return
    reach, reach_owner = -1, None
    for start, end, g_index, p_index in sorted(spans):
        if start < reach:
            raise ValueError(
                f"the gradients of {_where(*reach_owner)} and {_where(g_index, p_index)} share memory; "
                "each parameter needs a gradient of its own (the norm would count shared elements once "
                "and unscaling would scale them twice)"
            )
        if end > reach:
            reach, reach_owner = end, (g_index, p_index)
    _NO_OVERLAP[key] = None
    if len(_NO_OVERLAP) > _NO_OVERLAP_CACHE_SIZE:
        _NO_OVERLAP.popitem(last=False)
