"""Checks of the numbers a user passes for the loss scale and its rule, in one place.

What counts as a number (any real number torch takes: Python's and numpy's ints and floats, not a
bool), a finite one (an int past the float range is not), an int that fits the int32 device
counters, and a value float32 (where the scale lives) still holds: the
policy's knobs and setters (``loss_scale_policy.py``, ``scaler/grad_scaler.py``), the state's loader
(``scaler/checkpoint_codec.py``) and the scale managers' arguments (``loss_scale_manager.py``) all check
with these. The policy's messages are torch's wording; a manager's name the class and the argument
as the original framework spells it. What they return is a plain Python float or int, whatever
real number came in: torch keeps a numpy knob as given, and its state_dict then holds numpy
scalars, which ``torch.load`` (``weights_only=True``, its default) refuses to read back.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..errors import ScalerConfigError
from .rounding import as_float32

#: The device state's int32 counters (growth tracker, counters) hold values below this.
INT32_LIMIT = 2**31


def is_number(value: object) -> bool:
    """A real number, not a bool: ``4``, ``4.0``, ``np.float32(4.0)``, ``np.int64(4)`` (numpy
    registers its scalars as ``numbers.Real``; ``np.bool_`` is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An integer, not a bool: ``4`` or ``np.int32(4)``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_number(value: Any) -> Any:
    """A number as the Python int or float it holds (``np.float32(0.5)`` -> ``0.5``, ``np.int64(2)``
    -> ``2``); anything else as it is. For arguments a manager echoes back as given."""
    if type(value) in (int, float) or not is_number(value):  # the usual case first: no ABC check
        return value
    return int(value) if is_int(value) else float(value)


def is_finite(value: object) -> bool:
    """A finite number; an int past the float range (``10**400``) is not."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


# ------------------------------------------------------------------ the bounds, each written once
# The policy's checks and the managers' say the same bound in their own words (torch's wording for
# the policy, the original framework's for a manager): the bound itself is one of these.
def is_growth_factor(value: object) -> bool:
    """A factor that grows the scale: finite and > 1."""
    return is_finite(value) and value > 1


def is_backoff_factor(value: object) -> bool:
    """A factor that backs the scale off: a number in (0, 1)."""
    return is_number(value) and 0 < value < 1


def is_count(value: object, minimum: int = 1, limit: int | None = None) -> bool:
    """An int (not a bool) in ``[minimum, limit)`` (no upper bound without ``limit``): a growth
    interval, a step count, or (``minimum=0``) a tracker kept in an int32 device counter."""
    return is_int(value) and minimum <= value and (limit is None or value < limit)


# ------------------------------------------------------------------ the policy and the state
def check_scale_value(name: str, value: float) -> float:
    """A loss scale (or a bound on one): positive and finite, also once rounded to float32."""
    if not (is_finite(value) and value > 0):
        shown = f"an int of {value.bit_length()} bits" if is_int(value) and value > 2**1024 else repr(value)
        raise ScalerConfigError(f"{name} must be a positive finite float, got {shown}")
    stored = as_float32(float(value))
    if not (math.isfinite(stored) and stored > 0):
        raise ScalerConfigError(f"{name}={value!r} rounds to {stored!r} in float32, where the scale is kept")
    return float(value)


def check_counter(name: str, value: int, limit: int = INT32_LIMIT, minimum: int = 0) -> int:
    """A tracker kept in an int32 device counter: an int in [minimum, limit)."""
    if not is_count(value, minimum, limit):
        raise ScalerConfigError(f"{name} must be an int in [{minimum}, {limit}), got {value!r}")
    return int(value)


def check_growth_factor(value: float, name: str = "The growth factor") -> float:
    """The policy's growth factor, in torch's wording; ``name``: the caller's for it (a preset's argument)."""
    if not is_growth_factor(value):
        raise ScalerConfigError(f"{name} must be > 1.0 (and finite), got {value!r}")
    return float(value)


def check_backoff_factor(value: float, name: str = "The backoff factor") -> float:
    """The policy's backoff factor, in torch's wording; ``name``: the caller's for it (a preset's argument)."""
    if not is_backoff_factor(value):
        raise ScalerConfigError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def check_growth_interval(value: int, name: str = "The growth interval") -> int:
    """The policy's growth interval: an int >= 1 (torch's counter is unbounded on the host);
    ``name``: the caller's for it (a preset's argument)."""
    return check_positive_int(name, value)


def check_positive_int(name: str, value: int | None, allow_none: bool = False) -> int | None:
    """A policy knob that counts steps: an int >= 1 (or None where ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_count(value):
        raise ScalerConfigError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def check_optional_scale(name: str, value: float | None) -> float | None:
    return None if value is None else check_scale_value(name, value)


# ------------------------------------------------------------------ the scale managers' arguments
def check_loss_scale(owner: str, name: str, value: Any) -> float:
    """A manager's loss scale: a number >= 1 that float32 (where the scale lives) holds as a finite value."""
    if not is_number(value):
        raise TypeError(f"{owner}: {name} must be a number >= 1, got {type(value).__name__} {value!r}")
    if not (is_finite(value) and value >= 1):
        raise ScalerConfigError(f"{owner}: {name} must be a finite number >= 1, got {value!r}")
    if not math.isfinite(as_float32(float(value))):
        raise ScalerConfigError(f"{owner}: {name}={value!r} is past float32's range, where the scale is kept")
    return float(value)


def check_count(owner: str, name: str, value: Any) -> int:
    """A manager's step count, kept in an int32 device counter: an int in [1, 2**31)."""
    if not is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not is_count(value, 1, INT32_LIMIT):
        raise ScalerConfigError(f"{owner}: {name} must be a positive int below 2**31, got {value!r}")
    return int(value)


def check_factor(owner: str, name: str, value: Any, *, above_one: bool) -> float:
    """A manager's growth factor (> 1) or backoff factor (in (0, 1)), returned rounded to float32:
    the float32 scale times this double is then rounded once, which is the float32 product."""
    wanted = "a number > 1" if above_one else "a number in (0, 1)"
    if not is_number(value):
        raise TypeError(f"{owner}: {name} must be {wanted}, got {type(value).__name__} {value!r}")
    in_range = is_growth_factor if above_one else is_backoff_factor
    if not in_range(value):
        raise ScalerConfigError(f"{owner}: {name} must be {wanted}, got {value!r}")
    rounded = as_float32(float(value))
    if not in_range(rounded):
        raise ScalerConfigError(f"{owner}: {name}={value!r} rounds to {rounded!r} in float32, where it is applied")
    return rounded


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value
