"""Python numbers as the rule's float32 tensors hold them.

The rule is tensor ops on 0-dim float32 state (``loss_scale_policy.py``); its knobs are Python
numbers, which meet that state (and the kernels' constexprs) rounded to float32, as torch rounds a
Python number that meets a float32 tensor. ``as_float32`` is that rounding, done once where a
knob is set or handed to a kernel, so the bits a knob stands for are the same in every executor.
"""

from __future__ import annotations

import math
import struct

import torch

from ..kernels.interfaces import SCALE_FLOOR  # noqa: F401 (its one home; the policy imports it from here)


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (inf past the float32 range), as the device state stores it.
    Example: ``as_float32(0.1) == 0.10000000149011612``.

    While Dynamo traces, ``value`` is returned as it is: it may be a symbolic float (a knob of the
    policy under ``dynamic=True``, a ``max_norm`` that changes), which has no bytes to round. There
    every value this returns meets a float32 tensor op, which rounds a Python number to float32
    first, so the bits are the same."""
    if torch.compiler.is_compiling():
        return value
    return rounded_to_float32(value)


def rounded_to_float32(value: float) -> float:
    """:func:`as_float32` where Dynamo never traces (a kernel's constexprs, made on the host): no
    tracing check. Example: ``rounded_to_float32(0.1) == 0.10000000149011612``."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
