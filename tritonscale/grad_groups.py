"""Collect an optimizer's gradients, validate them, and group them by device and dtype.

Everything is checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .kernels.supported import is_supported_grad, raise_unsupported_grad

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]


def collect_grads(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> DeviceGroups:
    """``{device: [grads of one dtype, ...]}`` for every parameter with a gradient.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    Runs once per step over every parameter, so the checks are the cheap ones first.
    """
    per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if not is_supported_grad(grad):
                raise_unsupported_grad(grad, f"param_groups[{g_index}]['params'][{p_index}]")
            if not allow_fp16 and grad.dtype is torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            per_device[grad.device][grad.dtype].append(grad)
    return {device: list(by_dtype.values()) for device, by_dtype in per_device.items()}
