"""Collect an optimizer's gradients, validate them, and group them by device and dtype.

Everything is checked before any kernel runs, so a bad gradient raises with nothing modified.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .kernels.tensor_table import validate_group

DeviceGroups = dict[torch.device, list[list[torch.Tensor]]]


def collect_grads(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> DeviceGroups:
    """``{device: [grads of one dtype, ...]}`` for every parameter with a gradient.

    ``allow_fp16=False`` refuses float16 gradients the way torch.amp.GradScaler.unscale_ does
    (writing unscaled values back into fp16 loses them); passes that only read may allow them.
    """
    per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"param_groups[{g_index}]['params'][{p_index}] is a {type(param).__name__}, not a Tensor"
                )
            grad = param.grad
            if grad is None:
                continue
            where = f"param_groups[{g_index}]['params'][{p_index}]"
            if grad.is_sparse or grad.layout != torch.strided:
                raise TypeError(f"{where} has a {grad.layout} gradient; tritonscale supports dense gradients only")
            if not grad.is_floating_point():
                raise TypeError(f"{where} has a non-floating gradient of dtype {grad.dtype}")
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            per_device[grad.device][grad.dtype].append(grad)
    groups = {device: list(by_dtype.values()) for device, by_dtype in per_device.items()}
    for device_groups in groups.values():
        for grads in device_groups:
            validate_group(grads)
    return groups
