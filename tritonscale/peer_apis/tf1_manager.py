"""TensorFlow 1.x's ``ExponentialUpdateLossScaleManager`` over a GradScaler.

Why and where it differs from TF1's: ``docs/scale-managers.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..policy.knob_validation import check_count, check_factor, check_loss_scale, plain_number
from ..policy.loss_scale_policy import LossScalePolicy
from ..scaler.grad_scaler import GradScaler
from .loss_scale_manager import Flag, LossScaleManager, check_device, check_flag, scaler_device_name


class ExponentialUpdateLossScaleManager(LossScaleManager):
    """TF1's ``tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager``.

    Good steps (finite gradients) and bad steps are counted: ``incr_every_n_steps`` consecutive
    good steps multiply the scale by ``incr_ratio`` (only if the result stays finite in float32),
    ``decr_every_n_nan_or_inf`` bad steps, not necessarily consecutive, multiply it by
    ``decr_ratio`` (never below 1). A bad step restarts the good count; a good step leaves the bad
    count; every grow (even one refused as non-finite) or decrease restarts both. Overflowed steps
    are dropped, as TF1's LossScaleOptimizer drops them. ``device``: where the scale lives (None:
    where first used); ``backend``: the GradScaler's.

    Example::

        manager = tritonscale.ExponentialUpdateLossScaleManager(2**15, incr_every_n_steps=1000)
        manager.update_loss_scale(finite_grads)  # a bool, or a device tensor (no host read)

    Args:
        init_loss_scale: the initial scale, a number >= 1.
        incr_every_n_steps: the consecutive good steps before a growth, a positive int.
        decr_every_n_nan_or_inf: the bad steps before a decrease, a positive int (2).
        incr_ratio: the growth factor, above 1 (2).
        decr_ratio: the decrease factor, in (0, 1) (0.8).
        device: where the scale lives; None (the default): where first used.
        backend: the GradScaler's: "auto" (the default), "triton" or "torch".

    Raises:
        TypeError: an argument of the wrong type.
        ScalerConfigError: an invalid value, or a ``device`` that is not a torch device.
        RuntimeError: a CUDA ``device`` where CUDA is not available.
    """

    def __init__(
        self,
        init_loss_scale: float,
        incr_every_n_steps: int,
        decr_every_n_nan_or_inf: int = 2,
        incr_ratio: float = 2,
        decr_ratio: float = 0.8,
        *,
        device: str | torch.device | None = None,
        backend: str = "auto",
    ) -> None:
        owner = type(self).__name__
        init_scale = check_loss_scale(owner, "init_loss_scale", init_loss_scale)
        incr_n = check_count(owner, "incr_every_n_steps", incr_every_n_steps)
        decr_n = check_count(owner, "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
        # TF1 multiplies its float32 variable by the ratios converted to float32.
        up = check_factor(owner, "incr_ratio", incr_ratio, above_one=True)
        down = check_factor(owner, "decr_ratio", decr_ratio, above_one=False)
        checked_device = check_device(device)
        scaler = GradScaler(
            scaler_device_name(checked_device),
            init_scale=init_scale,
            policy=LossScalePolicy.tensorflow_exponential(incr_n, decr_n, up, down),
            backend=backend,
        )
        self._args = {
            "init_loss_scale": init_scale,
            "incr_every_n_steps": incr_n,
            "decr_every_n_nan_or_inf": decr_n,
            "incr_ratio": plain_number(incr_ratio),
            "decr_ratio": plain_number(decr_ratio),
        }
        super().__init__(scaler, checked_device)

    def update_loss_scale(self, finite_grads: Flag) -> None:
        """One step of TF1's rule: ``finite_grads`` is a bool, or a one-element tensor (nonzero:
        all gradients were finite), negated and read on the device, with no host sync.

        Example::

            finite = torch.stack([g.isfinite().all() for g in grads]).all()
            manager.update_loss_scale(finite)

        Args:
            finite_grads: whether all gradients were finite: a bool, or a one-element tensor (nonzero: finite).

        Raises:
            TypeError: a ``finite_grads`` that is not a bool or a tensor.
            ValueError: a tensor with more than one element, or a complex one.
        """
        finite = check_flag(type(self).__name__, "finite_grads", finite_grads)
        overflow = (finite.detach().reshape(()) == 0) if isinstance(finite, torch.Tensor) else not finite
        self._update_with_overflow(overflow)

    def _arguments(self) -> dict[str, Any]:
        return dict(self._args)
