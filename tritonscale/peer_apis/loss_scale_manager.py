"""The scale managers' common layer and the fixed manager, shared by MindSpore and TensorFlow 1.x.

A manager owns a ``GradScaler`` configured with the original's rule, and that scaler is its
state; it turns the original's ``update_loss_scale`` argument into ``update(found_inf=...)``. Why
and where it differs from the originals: ``docs/scale-managers.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ScalerConfigError
from ..policy.knob_validation import check_bool, check_loss_scale
from ..policy.loss_scale_policy import LossScalePolicy, as_float32
from ..scaler.grad_scaler import GradScaler

Flag = bool | torch.Tensor


def check_flag(owner: str, name: str, value: Any) -> Flag:
    """``update_loss_scale``'s argument: a bool, or a one-element real tensor (nonzero = true)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(
                f"{owner}.update_loss_scale: {name} must be a bool or a one-element real tensor, "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return value
    raise TypeError(
        f"{owner}.update_loss_scale: {name} must be a bool or a one-element tensor, "
        f"got {type(value).__name__} {value!r}"
    )


def check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ScalerConfigError(f"device must be None or a torch device, got {device!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} was asked for, but CUDA is not available")
    return device


def scaler_device_name(device: torch.device | None) -> str:
    """GradScaler's ``device`` argument (a device type; the tensors go where first used)."""
    if device is not None:
        return device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


class LossScaleManager:
    """What the managers share: their GradScaler (the state) and the originals' getters.

    Not built directly: use :class:`FixedLossScaleManager`, :class:`DynamicLossScaleManager` or
    :class:`ExponentialUpdateLossScaleManager`.
    """

    def __init__(self, grad_scaler: GradScaler, device: torch.device | None) -> None:
        self._grad_scaler = grad_scaler
        self._device = device
        if device is not None:  # an explicit device: the state lives there from the start
            grad_scaler.place_state(device)

    @property
    def grad_scaler(self) -> GradScaler:
        """The GradScaler holding this manager's scale and counters; drive a fused loop with it.

        Example::

            scaler = manager.grad_scaler
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(optimizer, max_norm=1.0)
            scaler.step(optimizer)      # skipped on inf/NaN unless the manager lets it through
            scaler.update()             # the manager's rule, on the device

        Returns:
            the manager's ``GradScaler``.
        """
        return self._grad_scaler

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (a host read once the scale is on the device).

        A loop that must not sync reads ``manager.grad_scaler.stats()["scale"]`` (a device tensor).

        Example::

            loss_scale = manager.get_loss_scale()

        Returns:
            the current loss scale, a float32 value as a Python float.
        """
        return as_float32(self._grad_scaler.get_scale())  # float32, as the scale is used

    def get_drop_overflow_update(self) -> bool:
        """Whether a step whose gradients overflowed is dropped (not applied).

        Example::

            assert DynamicLossScaleManager().get_drop_overflow_update()

        Returns:
            True if overflowed steps are dropped, False if they are applied.
        """
        return self._grad_scaler.get_policy().skip_on_overflow

    def get_update_cell(self) -> GradScaler:
        """MindSpore's update cell -- the device-side object a training step calls to update the
        scale -- is, in PyTorch, this manager's :attr:`grad_scaler`.

        Example::

            scaler = manager.get_update_cell()   # the same object as manager.grad_scaler

        Returns:
            the manager's ``GradScaler`` (:attr:`grad_scaler`).
        """
        return self._grad_scaler

    def _update_with_overflow(self, overflow: Flag) -> None:
        """The overflow flag (a bool, or a tensor already checked) into the GradScaler's update."""
        # Where nothing has placed the state yet (device=None, no scale() so far): here, then.
        self._grad_scaler.place_state(overflow.device if isinstance(overflow, torch.Tensor) else "cpu")
        self._grad_scaler.update(found_inf=overflow)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._arguments().items())
        return f"{type(self).__name__}({args})"

    def _arguments(self) -> dict[str, Any]:
        raise NotImplementedError


class FixedLossScaleManager(LossScaleManager):
    """A loss scale that never changes (MindSpore's and TF1's ``FixedLossScaleManager``).

    ``loss_scale`` must be >= 1 (both originals' check). ``drop_overflow_update``: whether a step
    whose gradients overflowed is dropped (MindSpore's argument; TF1's ``FixedLossScaleManager(s)``
    call means ``True``, as TF1's LossScaleOptimizer drops such steps). ``device``: where the scale
    lives (None: where first used); ``backend``: the GradScaler's.

    Example::

        manager = tritonscale.FixedLossScaleManager(1024.0, drop_overflow_update=False)
        scaler = manager.grad_scaler          # a GradScaler whose scale stays 1024
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()

    Args:
        loss_scale: the scale, a number >= 1 (128.0).
        drop_overflow_update: whether a step whose gradients overflowed is dropped (True).
        device: where the scale lives; None (the default): where first used.
        backend: the GradScaler's: "auto" (the default), "triton" or "torch".

    Raises:
        TypeError: a ``loss_scale`` that is not a number, or a ``drop_overflow_update`` that is not a bool.
        ScalerConfigError: an invalid value, or a ``device`` that is not a torch device.
        RuntimeError: a CUDA ``device`` where CUDA is not available.
    """

    def __init__(
        self,
        loss_scale: float = 128.0,
        drop_overflow_update: bool = True,
        *,
        device: str | torch.device | None = None,
        backend: str = "auto",
    ) -> None:
        owner = type(self).__name__
        self._loss_scale = check_loss_scale(owner, "loss_scale", loss_scale)
        drop = check_bool(owner, "drop_overflow_update", drop_overflow_update)
        checked_device = check_device(device)
        scaler = GradScaler(
            scaler_device_name(checked_device),
            init_scale=self._loss_scale,
            policy=LossScalePolicy.fixed(skip_on_overflow=drop),
            backend=backend,
        )
        super().__init__(scaler, checked_device)

    def update_loss_scale(self, overflow: Flag | None = None, *, finite_grads: Flag | None = None) -> None:
        """Does nothing to the scale, as in both originals; takes MindSpore's ``overflow`` or, by
        keyword, TF1's ``finite_grads`` (a bool or a one-element tensor; checked, not read).

        In a loop driven by :attr:`grad_scaler`, end each iteration with ``grad_scaler.update()``.

        Example::

            manager.update_loss_scale(False)                  # MindSpore style
            manager.update_loss_scale(finite_grads=is_finite)  # TF1 style

        Args:
            overflow: MindSpore's argument: whether the step overflowed (a bool or a one-element tensor).
            finite_grads: TF1's argument, by keyword: whether the gradients were finite (a bool or a
                one-element tensor).

        Raises:
            TypeError: neither or both of ``overflow`` and ``finite_grads``, or one that is not a bool or a tensor.
            ValueError: a tensor with more than one element, or a complex one.
        """
        owner = type(self).__name__
        if (overflow is None) == (finite_grads is None):
            raise TypeError(f"{owner}.update_loss_scale takes one of overflow (MindSpore) or finite_grads= (TF1)")
        if overflow is not None:
            check_flag(owner, "overflow", overflow)
        else:
            check_flag(owner, "finite_grads", finite_grads)

    def _arguments(self) -> dict[str, Any]:
        return {"loss_scale": self._loss_scale, "drop_overflow_update": self.get_drop_overflow_update()}
