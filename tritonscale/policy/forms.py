"""The two forms the policy rule runs in: on device tensors, or on Python numbers on the host.

``LossScalePolicy``'s rule is written once against the small set of operations below, which
either form provides:

* ``ON_DEVICE``: every value is a 0-dim device tensor and every decision a device op, so nothing
  is read on the host (a GPU's stream never waits; ``torch.compile`` traces this form);
* ``ON_HOST``: the state is read into Python numbers, decided on, and written back. Only where a
  read waits for nothing (the CPU, ``host_reads.are_free``): there each tensor op on a 0-dim
  tensor costs a dispatch many times a Python operation's cost, so the rule on Python numbers
  takes a fraction of the time of the same rule on tensors.

Both forms give the same state, bit for bit. The scale's growth and backoff are torch's own op in
both. The float32 arithmetic of the rule (thresholds, the norm average; the clip coefficient in
``backends/base.py``) is rounded to float32 after every operation on the host (``f32``), which is
float32 arithmetic exactly: an IEEE float64 sum, difference, product or quotient of two float32
numbers, rounded once to float32, is the float32 operation's result (53 >= 2 * 24 + 2 bits).
Python numbers that meet a float32 tensor are rounded to float32 first, as torch rounds them.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from ..kernels.interfaces import SCALE_FLOOR  # noqa: F401 (its one home; the policy imports it from here)


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (inf past the float32 range), as the device state stores it.
    Example: ``as_float32(0.1) == 0.10000000149011612``.

    While Dynamo traces, ``value`` is returned as it is: it may be a symbolic float (a knob of the
    policy under ``dynamic=True``, a ``max_norm`` that changes), which has no bytes to round. There
    every value this returns meets a float32 tensor op, which rounds a Python number to float32
    first, so the bits are the same (the host form, which computes on Python numbers, is never
    traced: ``host_reads.are_free``)."""
    if torch.compiler.is_compiling():
        return value
    return rounded_to_float32(value)


def rounded_to_float32(value: float) -> float:
    """:func:`as_float32` for the host form and the host-side finalize, which never run under
    Dynamo (their callers check ``host_reads.are_free``): no tracing check, a fraction of the cost
    on a step's hot path. Example: ``rounded_to_float32(0.1) == 0.10000000149011612``."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


class OnDevice:
    """The rule on 0-dim device tensors: decisions stay on the device."""

    @staticmethod
    def read(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @staticmethod
    def where(condition: Any, if_true: Any, if_false: Any) -> Any:
        return torch.where(condition, if_true, if_false)

    @staticmethod
    def not_(condition: torch.Tensor) -> torch.Tensor:
        return ~condition

    @staticmethod
    def false(like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like, dtype=torch.bool)

    @staticmethod
    def full_like(like: torch.Tensor, value: float) -> torch.Tensor:
        """``value`` in ``like``'s dtype (a bare Python number would take torch's default dtype)."""
        return torch.full_like(like, value)

    @staticmethod
    def isfinite(value: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(value)

    @staticmethod
    def at_least(value: torch.Tensor, floor: int) -> torch.Tensor:
        return torch.clamp(value, min=floor)

    @staticmethod
    def at_most(value: torch.Tensor, ceiling: float) -> torch.Tensor:
        return torch.clamp(value, max=ceiling)

    @staticmethod
    def reciprocal(value: torch.Tensor) -> torch.Tensor:
        return value.reciprocal()

    @staticmethod
    def f32(value: torch.Tensor) -> torch.Tensor:
        return value  # float32 tensor ops round already

    @staticmethod
    def as_float64(value: torch.Tensor) -> torch.Tensor:
        """``value`` exactly, compared or divided in float64 (as a peer's Python floats are)."""
        return value.double()

    @staticmethod
    def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """numerator / denominator of two integer counts, in float64 (Python's ``int / int``)."""
        return numerator.double() / denominator.double()

    @staticmethod
    def times_factor(scale: torch.Tensor, factor: float) -> torch.Tensor:
        """float32 ``scale`` times a float64 ``factor``, rounded once to float32: torch's update kernel."""
        return (scale.double() * factor).float()

    @staticmethod
    def flag(condition: torch.Tensor, device: torch.device) -> torch.Tensor:
        """float32 0/1 tensor on ``device``."""
        return condition.float()

    @staticmethod
    def store(destination: torch.Tensor, index: Any, value: Any, current: Any) -> None:
        """Write ``value`` into ``destination[index]`` (which read as ``current``)."""
        destination[index].copy_(value)

    @staticmethod
    def raise_to_(tensor: torch.Tensor, floor: float, condition: torch.Tensor) -> None:
        """Where ``condition``, raise the 0-dim ``tensor`` to at least ``floor`` in place."""
        tensor.clamp_(min=torch.where(condition, floor, 0.0))


class OnHost:
    """The rule on Python numbers read from the state (where reads are free)."""

    @staticmethod
    def read(tensor: torch.Tensor) -> Any:
        return tensor.item() if tensor.dim() == 0 else tensor.tolist()

    @staticmethod
    def where(condition: bool, if_true: Any, if_false: Any) -> Any:
        return if_true if condition else if_false

    @staticmethod
    def not_(condition: bool) -> bool:
        return not condition

    @staticmethod
    def false(like: Any) -> bool:
        return False

    @staticmethod
    def full_like(like: Any, value: float) -> float:
        return value

    isfinite = staticmethod(math.isfinite)
    at_least = staticmethod(max)
    f32 = staticmethod(rounded_to_float32)

    @staticmethod
    def as_float64(value: float) -> float:
        return value

    @staticmethod
    def ratio(numerator: int, denominator: int) -> float:
        return numerator / denominator

    @staticmethod
    def times_factor(scale: float, factor: float) -> float:
        return rounded_to_float32(scale * factor)

    @staticmethod
    def at_most(value: float, ceiling: float) -> float:
        return value if math.isnan(value) else min(value, ceiling)  # clamp keeps NaN

    @staticmethod
    def reciprocal(value: float) -> float:
        """1 / value in float32 (from a float32 ``value``: one float64 division, rounded once)."""
        return rounded_to_float32(1.0 / value) if value else math.copysign(math.inf, value)

    @staticmethod
    def flag(condition: bool, device: torch.device) -> torch.Tensor:
        """A new float32 0/1 tensor on ``device`` (the caller may keep it or write to it)."""
        return torch.full((), 1.0 if condition else 0.0, dtype=torch.float32, device=device)

    @staticmethod
    def store(destination: torch.Tensor, index: Any, value: Any, current: Any) -> None:
        """Write ``value`` into ``destination[index]`` unless it holds it already (``current``, bit
        for bit: NaN never equals itself, and the sign of a zero counts)."""
        if value != current or math.copysign(1.0, value) != math.copysign(1.0, current):
            destination[index].fill_(value)

    @staticmethod
    def raise_to_(tensor: torch.Tensor, floor: float, condition: bool) -> None:
        """Where ``condition``, raise the 0-dim ``tensor`` to at least ``floor`` in place."""
        if condition and tensor.item() < floor:
            tensor.fill_(floor)


ON_DEVICE = OnDevice()
ON_HOST = OnHost()
RuleForm = OnDevice | OnHost

