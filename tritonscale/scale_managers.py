"""Scale managers: MindSpore's and TensorFlow 1.x's loss-scale manager classes, over GradScaler.

For code that drives the loss scale itself, with the originals' names, constructor signatures and
methods (``get_loss_scale``, ``update_loss_scale``, ``get_drop_overflow_update``):

* ``FixedLossScaleManager(loss_scale=128.0, drop_overflow_update=True)``: MindSpore's and TF1's;
* ``DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2, scale_window=2000)``: MindSpore's;
* ``ExponentialUpdateLossScaleManager(init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf=2,
  incr_ratio=2, decr_ratio=0.8)``: TF1's (``tf.contrib.mixed_precision``).

Each manager is a thin layer: it owns a ``tritonscale.GradScaler`` (``manager.grad_scaler``)
configured with the ``LossScalePolicy`` that states the original's rule, and that scaler *is* the
manager's state (scale and counters on the device). ``update_loss_scale(x)`` turns the original's
argument into an overflow flag and hands it to ``grad_scaler.update(found_inf=flag)``: a Python
bool, or a one-element device tensor that is read on the device, never on the host.
``get_loss_scale()`` is ``grad_scaler.get_scale()`` (a host read once the scale is on the
device). A loop that wants the fused unscale / inf-check / clip passes uses ``manager.grad_scaler``
as a normal GradScaler (``scale``, ``clip_grad_norm_``, ``step``, ``update``); the manager follows,
being the same object. Call one of ``grad_scaler.update()`` and ``update_loss_scale()`` per
iteration, not both: each is the iteration's update.

Decisions:

* **One ``FixedLossScaleManager`` for both frameworks.** MindSpore's ``(loss_scale=128.0,
  drop_overflow_update=True)`` takes TF1's ``(loss_scale)`` call as is, with the same meaning:
  TF1's ``LossScaleOptimizer`` skips a step with non-finite gradients whatever the manager, which
  is ``drop_overflow_update=True``. Both check ``loss_scale >= 1``, and both ``update_loss_scale``
  are no-ops, so their opposite arguments (MindSpore's ``overflow``, TF1's ``finite_grads``) cannot
  disagree: ours takes either (validated, then ignored). No ``tritonscale.tf1`` namespace is needed.
* **Device.** ``device=None`` (the default) places the state where it is first used, as
  GradScaler does: the device of the first ``grad_scaler.scale(...)``, or of the first tensor
  passed to ``update_loss_scale``; a bool update before either puts it on the CPU, which suits a
  loop that checks overflow on the host. ``device="cuda"`` etc. makes the state there at once.
  (Not GradScaler's ``"cuda"`` default: on a machine without CUDA that scaler disables itself,
  and a disabled manager would have no scale at all.)
* **Arithmetic.** The scale is float32 on the device, as TF1's variable and MindSpore's update
  cell hold it; factors are rounded to float32 before use, so each update is the float32 product
  TF1 (and MindSpore's ``DynamicLossScaleUpdateCell``) compute, bit for bit. MindSpore's Python
  manager computes in Python numbers: the same values while they are float32 numbers (power-of-two
  factors); where a grown scale would leave float32's range (past ``2**127`` with factor 2) ours
  keeps the last finite scale, where MindSpore's Python manager returns a number that becomes
  ``inf`` as soon as it scales a float32 loss (and its update cell stores ``inf``).
* **MindSpore's ``bad_step_max`` (1000).** Checked after each update, as MindSpore does: the
  update that makes more than 1000 overflows in a row raises RuntimeError, with the scale already
  backed off. The count is the policy's device counter of consecutive skipped steps; the host
  reads it only when as many updates have passed since the last read as could reach the limit, so
  a device-tensor ``update_loss_scale`` reads nothing for the first 1000 updates and once per
  ~1000 after (``LossScalePolicy.max_consecutive_skips`` would read once per update).
* **``get_update_cell()``** returns ``grad_scaler``: MindSpore's update cell is the device-side
  object its training step calls to update the scale, which here is the GradScaler. (MindSpore's
  fixed manager returns None when ``drop_overflow_update=False``; ours returns the scaler, whose
  policy then lets overflowed steps go ahead.)
* **Stricter argument checks** where our state could not hold the original's values: a scale must
  be finite in float32; TF1 checks none of its exponential manager's arguments, ours require
  ``init_loss_scale >= 1``, counts >= 1, ``incr_ratio > 1`` and ``0 < decr_ratio < 1``; MindSpore
  accepts ``0 < scale_factor < 1`` (its scale would then rise on overflow), ours refuses it and
  takes ``scale_factor == 1`` as a scale that never changes, as MindSpore's rule gives.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .compile_boundary import runs_eagerly
from .errors import ScalerConfigError
from .grad_scaler import GradScaler
from .policy import CONSECUTIVE_SKIPS, INT32_LIMIT, LossScalePolicy, as_float32

__all__ = [
    "DynamicLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
]

#: MindSpore's ``DynamicLossScaleManager.bad_step_max``: set by its constructor, not an argument.
MINDSPORE_BAD_STEP_MAX = 1000

Flag = bool | torch.Tensor


# ------------------------------------------------------------------ argument checks
def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_loss_scale(owner: str, name: str, value: Any) -> float:
    """A loss scale: a number >= 1 that float32 (where the scale lives) holds as a finite value."""
    if not _is_number(value):
        raise TypeError(f"{owner}: {name} must be a number >= 1, got {type(value).__name__} {value!r}")
    try:
        ok = math.isfinite(value) and value >= 1
    except OverflowError:  # an int past the float range
        ok = False
    if not ok:
        raise ScalerConfigError(f"{owner}: {name} must be a finite number >= 1, got {value!r}")
    if not math.isfinite(as_float32(float(value))):
        raise ScalerConfigError(f"{owner}: {name}={value!r} is past float32's range, where the scale is kept")
    return float(value)


def _check_count(owner: str, name: str, value: Any) -> int:
    """A step count kept in an int32 device counter: an int in [1, 2**31)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not 1 <= value < INT32_LIMIT:
        raise ScalerConfigError(f"{owner}: {name} must be a positive int below 2**31, got {value!r}")
    return value


def _check_factor(owner: str, name: str, value: Any, *, above_one: bool) -> float:
    """A growth factor (> 1) or a backoff factor (in (0, 1)), returned rounded to float32: the
    float32 scale times this double is then rounded once, which is the float32 product."""
    wanted = "a number > 1" if above_one else "a number in (0, 1)"
    if not _is_number(value):
        raise TypeError(f"{owner}: {name} must be {wanted}, got {type(value).__name__} {value!r}")
    try:
        ok = math.isfinite(value) and (value > 1 if above_one else 0 < value < 1)
    except OverflowError:  # an int past the float range
        ok = False
    if not ok:
        raise ScalerConfigError(f"{owner}: {name} must be {wanted}, got {value!r}")
    rounded = as_float32(float(value))
    if not (1 < rounded < math.inf if above_one else 0 < rounded < 1):
        raise ScalerConfigError(f"{owner}: {name}={value!r} rounds to {rounded!r} in float32, where it is applied")
    return rounded


def _check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_flag(owner: str, name: str, value: Any) -> Flag:
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


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ScalerConfigError(f"device must be None or a torch device, got {device!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} was asked for, but CUDA is not available")
    return device


def _scaler_device_name(device: torch.device | None) -> str:
    """GradScaler's ``device`` argument (a device type; the tensors go where first used)."""
    if device is not None:
        return device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ the device state
class _BadStepLimitGradScaler(GradScaler):
    """A GradScaler that raises, after an update, once more than ``bad_step_max`` steps in a row
    were skipped (MindSpore's DynamicLossScaleManager limit), reading the device counter only when
    that could have happened.

    ``_skips_bound`` is an upper bound on the device's count of consecutive skipped steps: each
    update raises it by one, a host read sets it to the count. While it is within the limit the
    limit cannot have been passed, so nothing is read.
    """

    def __init__(self, *args: Any, bad_step_max: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bad_step_max = bad_step_max
        self._skips_bound = self._host.counters[CONSECUTIVE_SKIPS]

    @runs_eagerly
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, found_inf: bool | torch.Tensor | None = None
    ) -> None:
        super().update(new_scale, found_inf=found_inf)
        self._skips_bound += 1
        if self._skips_bound <= self._bad_step_max:
            return
        in_a_row = int(self._counters[CONSECUTIVE_SKIPS].item())  # the one host read, once per ~bad_step_max
        self._skips_bound = in_a_row
        if in_a_row > self._bad_step_max:
            raise RuntimeError(
                f"Dynamic loss scale: {in_a_row} overflows in a row, more than bad_step_max={self._bad_step_max} "
                f"(MindSpore's limit); the loss scale is now {self.get_scale():g}"
            )

    @runs_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._skips_bound = self._host.counters[CONSECUTIVE_SKIPS]  # the loaded count, exact


# ------------------------------------------------------------------ the managers
class LossScaleManager:
    """What the managers share: their GradScaler (the state) and the originals' getters.

    Not built directly: use :class:`FixedLossScaleManager`, :class:`DynamicLossScaleManager` or
    :class:`ExponentialUpdateLossScaleManager`.
    """

    def __init__(self, grad_scaler: GradScaler, device: torch.device | None) -> None:
        self._grad_scaler = grad_scaler
        self._device = device
        if device is not None:  # an explicit device: the state lives there from the start
            self._grad_scaler._lazy_init_scale_growth_tracker(device)

    @property
    def grad_scaler(self) -> GradScaler:
        """The GradScaler holding this manager's scale and counters; drive a fused loop with it.

        Example::

            scaler = manager.grad_scaler
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(optimizer, max_norm=1.0)
            scaler.step(optimizer)      # skipped on inf/NaN unless the manager lets it through
            scaler.update()             # the manager's rule, on the device
        """
        return self._grad_scaler

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (a host read once the scale is on the device).

        A loop that must not sync reads ``manager.grad_scaler.stats()["scale"]`` (a device tensor).

        Example::

            loss_scale = manager.get_loss_scale()
        """
        return as_float32(self._grad_scaler.get_scale())  # float32, as the scale is used

    def get_drop_overflow_update(self) -> bool:
        """Whether a step whose gradients overflowed is dropped (not applied).

        Example::

            assert DynamicLossScaleManager().get_drop_overflow_update()
        """
        return self._grad_scaler._policy.skip_on_overflow

    def get_update_cell(self) -> GradScaler:
        """MindSpore's update cell -- the device-side object a training step calls to update the
        scale -- is, in PyTorch, this manager's :attr:`grad_scaler`.

        Example::

            scaler = manager.get_update_cell()   # the same object as manager.grad_scaler
        """
        return self._grad_scaler

    def _update_with_overflow(self, overflow: Flag) -> None:
        """The overflow flag (a bool, or a tensor already checked) into the GradScaler's update."""
        if self._grad_scaler._scale is None:
            # Nothing has placed the state yet (device=None, no scale() so far): here, then.
            device = overflow.device if isinstance(overflow, torch.Tensor) else torch.device("cpu")
            self._grad_scaler._lazy_init_scale_growth_tracker(device)
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
        self._loss_scale = _check_loss_scale(owner, "loss_scale", loss_scale)
        drop = _check_bool(owner, "drop_overflow_update", drop_overflow_update)
        checked_device = _check_device(device)
        scaler = GradScaler(
            _scaler_device_name(checked_device),
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
        """
        owner = type(self).__name__
        if (overflow is None) == (finite_grads is None):
            raise TypeError(f"{owner}.update_loss_scale takes one of overflow (MindSpore) or finite_grads= (TF1)")
        if overflow is not None:
            _check_flag(owner, "overflow", overflow)
        else:
            _check_flag(owner, "finite_grads", finite_grads)

    def _arguments(self) -> dict[str, Any]:
        return {"loss_scale": self._loss_scale, "drop_overflow_update": self.get_drop_overflow_update()}


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
        init_scale = _check_loss_scale(owner, "init_loss_scale", init_loss_scale)
        window = _check_count(owner, "scale_window", scale_window)
        if _is_number(scale_factor) and scale_factor <= 0:
            raise ScalerConfigError(f"{owner}: scale_factor must be > 0, got {scale_factor!r}")
        if _is_number(scale_factor) and scale_factor < 1:
            raise ScalerConfigError(
                f"{owner}: scale_factor must be >= 1, got {scale_factor!r} (MindSpore accepts it, but its "
                "scale would then grow on every overflow and shrink while the gradients are finite)"
            )
        if _is_number(scale_factor) and scale_factor == 1:
            policy = LossScalePolicy.fixed(skip_on_overflow=True)  # MindSpore's rule with factor 1
        else:
            # Grown by the factor and backed off by its reciprocal, both in float32 (MindSpore's
            # update cell computes ``loss_scale * reciprocal(scale_factor)`` in float32).
            growth = _check_factor(owner, "scale_factor", scale_factor, above_one=True)
            policy = LossScalePolicy(
                growth_factor=growth,
                backoff_factor=as_float32(1 / growth),
                growth_interval=window,
                min_scale=1.0,
            )
        checked_device = _check_device(device)
        self._scale_factor, self._scale_window = scale_factor, window
        scaler = _BadStepLimitGradScaler(
            _scaler_device_name(checked_device),
            init_scale=init_scale,
            policy=policy,
            backend=backend,
            bad_step_max=MINDSPORE_BAD_STEP_MAX,
        )
        self._init_loss_scale = init_scale
        super().__init__(scaler, checked_device)

    @property
    def scale_factor(self) -> float:
        return self._scale_factor

    @property
    def scale_window(self) -> int:
        return self._scale_window

    @property
    def bad_step_max(self) -> int:
        """More overflows than this in a row raise RuntimeError (MindSpore's fixed 1000)."""
        return self._grad_scaler._bad_step_max

    def update_loss_scale(self, overflow: Flag) -> None:
        """One step of MindSpore's rule: ``overflow`` is a bool, or a one-element tensor (nonzero:
        the step overflowed) read on the device, with no host sync.

        Raises RuntimeError once more than :attr:`bad_step_max` overflows came in a row.

        Example::

            found_inf = ~torch.stack([g.isfinite().all() for g in grads]).all()
            manager.update_loss_scale(found_inf)
        """
        self._update_with_overflow(_check_flag(type(self).__name__, "overflow", overflow))

    def _arguments(self) -> dict[str, Any]:
        return {
            "init_loss_scale": self._init_loss_scale,
            "scale_factor": self._scale_factor,
            "scale_window": self._scale_window,
        }


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
        init_scale = _check_loss_scale(owner, "init_loss_scale", init_loss_scale)
        incr_n = _check_count(owner, "incr_every_n_steps", incr_every_n_steps)
        decr_n = _check_count(owner, "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
        # TF1 multiplies its float32 variable by the ratios converted to float32.
        up = _check_factor(owner, "incr_ratio", incr_ratio, above_one=True)
        down = _check_factor(owner, "decr_ratio", decr_ratio, above_one=False)
        checked_device = _check_device(device)
        scaler = GradScaler(
            _scaler_device_name(checked_device),
            init_scale=init_scale,
            policy=LossScalePolicy.tensorflow_exponential(incr_n, decr_n, up, down),
            backend=backend,
        )
        self._args = {
            "init_loss_scale": init_scale,
            "incr_every_n_steps": incr_n,
            "decr_every_n_nan_or_inf": decr_n,
            "incr_ratio": incr_ratio,
            "decr_ratio": decr_ratio,
        }
        super().__init__(scaler, checked_device)

    def update_loss_scale(self, finite_grads: Flag) -> None:
        """One step of TF1's rule: ``finite_grads`` is a bool, or a one-element tensor (nonzero:
        all gradients were finite), negated and read on the device, with no host sync.

        Example::

            finite = torch.stack([g.isfinite().all() for g in grads]).all()
            manager.update_loss_scale(finite)
        """
        finite = _check_flag(type(self).__name__, "finite_grads", finite_grads)
        overflow = (finite.detach().reshape(()) == 0) if isinstance(finite, torch.Tensor) else not finite
        self._update_with_overflow(overflow)

    def _arguments(self) -> dict[str, Any]:
        return dict(self._args)
