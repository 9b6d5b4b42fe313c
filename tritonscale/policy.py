"""The dynamic loss-scale policy: validation of its knobs and the on-device update rule.

Rule (torch.amp.GradScaler's, kept exactly so trajectories match step for step):

* a step with inf/NaN gradients: ``scale *= backoff_factor`` and the growth tracker resets to 0;
* otherwise the tracker counts the good step; when it reaches ``growth_interval`` the scale is
  multiplied by ``growth_factor`` (unless that would overflow float32, in which case the old scale
  is kept) and the tracker resets to 0.

The update is one in-place device op on (scale, tracker) driven by the device-side found_inf, so it
never reads a device value on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import ScalerConfigError


def check_scale_value(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScalerConfigError(f"{name} must be a positive finite float, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ScalerConfigError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def check_growth_factor(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1.0 or not math.isfinite(value):
        raise ScalerConfigError(f"The growth factor must be > 1.0 (and finite), got {value!r}")
    return float(value)


def check_backoff_factor(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ScalerConfigError(f"The backoff factor must be in (0, 1), got {value!r}")
    return float(value)


def check_growth_interval(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScalerConfigError(f"The growth interval must be an int >= 1, got {value!r}")
    return value


def check_growth_tracker(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScalerConfigError(f"_growth_tracker must be an int >= 0, got {value!r}")
    return value


@dataclass
class DynamicScalePolicy:
    """Backoff on overflow, growth after ``growth_interval`` consecutive good steps."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @classmethod
    def checked(cls, growth_factor: float, backoff_factor: float, growth_interval: int) -> DynamicScalePolicy:
        """A policy whose knobs are validated (ScalerConfigError naming the bad one)."""
        return cls(
            check_growth_factor(growth_factor),
            check_backoff_factor(backoff_factor),
            check_growth_interval(growth_interval),
        )

    def update_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Apply one step of the rule in place; ``found_inf`` > 0 means the step overflowed."""
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, self.growth_factor, self.backoff_factor, self.growth_interval
        )
