"""The first stage of a step: ``scaler.scale(outputs)`` multiplies the loss (or a nested list of
outputs) by the device-resident scale, with one non-blocking copy of the scale per device."""

from __future__ import annotations

from collections import abc
from collections.abc import Callable
from typing import Any

import torch

from ..flags import moved_to
from ..passes.grad_passes import PerDevice


def scale_outputs(outputs: Any, scale_on: Callable[[torch.device], torch.Tensor]) -> Any:
    """``outputs`` (a tensor, or a nested list/tuple/iterable of them) times the scale.

    ``scale_on(device)`` gives the scale, creating it on that device at first use: the device of
    the first tensor met, as in torch. Lists and tuples keep their type; other iterables come back
    as lazy maps, as torch's do.
    """
    if isinstance(outputs, torch.Tensor):  # every step's case: one multiply
        device = outputs.device  # (a property read is a call into torch: once)
        return outputs * moved_to(scale_on(device), device)
    replicas: list[PerDevice] = []

    def apply_scale(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if not replicas:
                replicas.append(PerDevice(scale_on(value.device)))
            return value * replicas[0].get(value.device)
        if isinstance(value, abc.Iterable):
            scaled = map(apply_scale, value)
            return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    return apply_scale(outputs)
