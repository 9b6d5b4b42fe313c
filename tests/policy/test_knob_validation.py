"""The knob checks (tritonscale/policy/knob_validation.py): one bound per knob, whoever asks.

The policy's checks speak torch's wording (``LossScalePolicy``, GradScaler's setters), a scale
manager's speak its framework's (TensorFlow 1.x's ``ExponentialUpdateLossScaleManager``); both must
accept exactly the same values. The oracle is the bound as the frameworks state it, applied to
each value as Python/numpy compute it: a growth factor is a finite real number > 1, a backoff
factor a real number in (0, 1), a count an int >= 1 (bools are neither); a manager also refuses a
factor that float32 (where it applies it) rounds out of range, and a count that its int32 device
counter cannot hold.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonscale import ExponentialUpdateLossScaleManager, LossScalePolicy

VALUES = [
    2, 2.0, 1.5, 1, 1.0, 0.5, 0.8, 0, 0.0, -1, -0.5, 1 + 2**-40, 1 - 2**-40, 2**-160, 3.5e38,
    np.float32(2.0), np.float64(0.25), np.int64(3), np.int32(1), True, False, np.bool_(True),
    math.nan, math.inf, -math.inf, 10**400, 2**31 - 1, 2**31, 2**40, "2", None,
]  # fmt: skip


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _finite(value) -> bool:
    try:
        return _real(value) and math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def _float32(value) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _accepts(make) -> bool:
    try:
        make()
    except (ValueError, TypeError):  # ScalerConfigError is a ValueError
        return False
    return True


def _policy(**knob) -> bool:
    return _accepts(lambda: LossScalePolicy(**knob).validate())


def _manager(**knob) -> bool:
    args = {"init_loss_scale": 2.0, "incr_every_n_steps": 1, **knob}
    return _accepts(lambda: ExponentialUpdateLossScaleManager(**args, device="cpu"))


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_growth_factor_bound_is_the_same_for_the_policy_and_a_manager(value):
    grows = _finite(value) and value > 1
    assert _policy(growth_factor=value) == grows
    assert _manager(incr_ratio=value) == (grows and 1 < _float32(value) < math.inf)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_backoff_factor_bound_is_the_same_for_the_policy_and_a_manager(value):
    backs_off = _real(value) and 0 < value < 1
    assert _policy(backoff_factor=value) == backs_off
    assert _manager(decr_ratio=value) == (backs_off and 0 < _float32(value) < 1)


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_count_bound_is_the_same_for_the_policy_and_a_manager(value):
    count = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and value >= 1
    assert _policy(growth_interval=value) == count
    assert _policy(hysteresis=value) == count
    assert _manager(incr_every_n_steps=value) == (count and value < 2**31)
    assert _manager(decr_every_n_nan_or_inf=value) == (count and value < 2**31)


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_factor_bounds_agree_on_any_float(value):
    assert _policy(growth_factor=value) == (math.isfinite(value) and value > 1)
    assert _manager(incr_ratio=value) == (1 < _float32(value) < math.inf and value > 1)
    assert _policy(backoff_factor=value) == (0 < value < 1)
    assert _manager(decr_ratio=value) == (0 < _float32(value) < 1 and 0 < value < 1)
