"""MindSpore's ``DynamicLossScaleManager`` over a GradScaler, with its ``bad_step_max`` limit.

Why and where it differs from MindSpore's: ``docs/scale-managers.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ScalerConfigError
from ..policy.stop_rules import ConsecutiveSkipLimit
from ..policy.knob_validation import check_count, check_factor, check_loss_scale, is_number, plain_number
from ..policy.loss_scale_policy import LossScalePolicy, as_float32
from ..scaler.compile_boundary import runs_eagerly
from ..scaler.grad_scaler import GradScaler
from .loss_scale_manager import Flag, LossScaleManager, check_device, check_flag, scaler_device_name

#: MindSpore's ``DynamicLossScaleManager.bad_step_max``: set by its constructor, not an argument.
MINDSPORE_BAD_STEP_MAX = 1000


class _BadStepLimitGradScaler(GradScaler):
    """A GradScaler that raises after an update once more than ``bad_step_max`` steps in a row were
    skipped (``stop_rules.ConsecutiveSkipLimit``), so that a loop driving ``manager.grad_scaler``
    directly meets MindSpore's limit too. Public API only: ``stats()`` for the count."""

    def __init__(self, *args: Any, bad_step_max: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bad_step_limit = ConsecutiveSkipLimit(bad_step_max)

    @runs_eagerly
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, found_inf: bool | torch.Tensor | None = None
    ) -> None:
        super().update(new_scale, found_inf=found_inf)
        self.bad_step_limit.after_update(lambda: int(self.stats()["consecutive_skips"].item()), self.get_scale)

    @runs_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The loaded count, exact (a torch checkpoint has none: it loads as 0), read from the
        # checkpoint rather than the device.
        loaded = (state_dict.get("counters") or {}).get("consecutive_skips", 0)
        self.bad_step_limit.bound = int(loaded)


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's ``DynamicLossScaleManager``: divide the scale by ``scale_factor`` on an
    overflow (never below 1), multiply it by ``scale_factor`` after every ``scale_window`` steps
    without overflow counted from the last overflow (no upper bound other than float32's range),
    drop overflowed steps, and raise RuntimeError once more than 1000 overflows came in a row.

    Checks as MindSpore's: ``init_loss_scale >= 1``, ``scale_window`` a positive int,
    ``scale_factor > 0`` (and here not below 1; 1 gives a scale that never changes).
    ``device``: where the scale lives (None: where first used); ``backend``: the GradScaler's.

    Example::

        manager = tritonscale.DynamicLossScaleManager(init_loss_scale=2**16, scale_window=1000)
        manager.update_loss_scale(overflow)   # a bool, or a device tensor (no host read)
        loss_scale = manager.get_loss_scale()

    Args:
        init_loss_scale: the initial scale, a number >= 1 (2**24).
        scale_factor: the growth factor, and its reciprocal the backoff factor, a number >= 1 (2).
        scale_window: the steps without overflow before a growth, a positive int (2000).
        device: where the scale lives; None (the default): where first used.
        backend: the GradScaler's: "auto" (the default), "triton" or "torch".

    Raises:
        TypeError: an argument of the wrong type.
        ScalerConfigError: an invalid value, or a ``device`` that is not a torch device.
        RuntimeError: a CUDA ``device`` where CUDA is not available.
    """

    def __init__(
        self,
        init_loss_scale: float = 2**24,
        scale_factor: float = 2,
        scale_window: int = 2000,
        *,
        device: str | torch.device | None = None,
        backend: str = "auto",
    ) -> None:
        owner = type(self).__name__
        # MindSpore's order of checks: init_loss_scale, scale_window, scale_factor.
        init_scale = check_loss_scale(owner, "init_loss_scale", init_loss_scale)
        window = check_count(owner, "scale_window", scale_window)
        if is_number(scale_factor) and scale_factor <= 0:
            raise ScalerConfigError(f"{owner}: scale_factor must be > 0, got {scale_factor!r}")
        if is_number(scale_factor) and scale_factor < 1:
            raise ScalerConfigError(
                f"{owner}: scale_factor must be >= 1, got {scale_factor!r} (MindSpore accepts it, but its "
                "scale would then grow on every overflow and shrink while the gradients are finite)"
            )
        if is_number(scale_factor) and scale_factor == 1:
            policy = LossScalePolicy.fixed(skip_on_overflow=True)  # MindSpore's rule with factor 1
        else:
            # Grown by the factor and backed off by its reciprocal, both in float32 (MindSpore's
            # update cell computes ``loss_scale * reciprocal(scale_factor)`` in float32).
            growth = check_factor(owner, "scale_factor", scale_factor, above_one=True)
            policy = LossScalePolicy(
                growth_factor=growth,
                backoff_factor=as_float32(1 / growth),
                growth_interval=window,
                min_scale=1.0,
            )
        checked_device = check_device(device)
        self._scale_factor, self._scale_window = plain_number(scale_factor), window
        scaler = _BadStepLimitGradScaler(
            scaler_device_name(checked_device),
            init_scale=init_scale,
            policy=policy,
            backend=backend,
            bad_step_max=MINDSPORE_BAD_STEP_MAX,
        )
        self._init_loss_scale = init_scale
        super().__init__(scaler, checked_device)

    @property
    def scale_factor(self) -> float:
        """The ``scale_factor`` the manager was built with.

        Returns:
            the growth factor (and reciprocal of the backoff factor), as given.
        """
        return self._scale_factor

    @property
    def scale_window(self) -> int:
        """The ``scale_window`` the manager was built with.

        Returns:
            the steps without overflow before a growth.
        """
        return self._scale_window

    @property
    def bad_step_max(self) -> int:
        """More overflows than this in a row raise RuntimeError (MindSpore's fixed 1000).

        Returns:
            the most overflows in a row that do not raise.
        """
        return self._grad_scaler.bad_step_limit.limit

    def update_loss_scale(self, overflow: Flag) -> None:
        """One step of MindSpore's rule: ``overflow`` is a bool, or a one-element tensor (nonzero:
        the step overflowed) read on the device, with no host sync.

        Raises RuntimeError once more than :attr:`bad_step_max` overflows came in a row.

        Example::

            found_inf = ~torch.stack([g.isfinite().all() for g in grads]).all()
            manager.update_loss_scale(found_inf)

        Args:
            overflow: whether the step overflowed: a bool, or a one-element tensor (nonzero: overflowed).

        Raises:
            TypeError: an ``overflow`` that is not a bool or a tensor.
            ValueError: a tensor with more than one element, or a complex one.
            RuntimeError: more than :attr:`bad_step_max` overflows in a row.
        """
        self._update_with_overflow(check_flag(type(self).__name__, "overflow", overflow))

    def _arguments(self) -> dict[str, Any]:
        return {
            "init_loss_scale": self._init_loss_scale,
            "scale_factor": self._scale_factor,
            "scale_window": self._scale_window,
        }
