"""Hugging Face Accelerate (and so the Trainer): one call installs a ``tritonscale.GradScaler``.

``install(accelerator)`` puts a ``tritonscale.GradScaler`` where Accelerate keeps its scaler
(``accelerator.scaler`` and every prepared ``AcceleratedOptimizer``), so ``accelerator.backward``,
``optimizer.step()``, ``accelerator.unscale_gradients``, ``save_state``/``load_state`` all run on
it through Accelerate's own code.

Skips are reported exactly: each prepared optimizer's ``step_was_skipped`` (and so
``accelerator.optimizer_step_was_skipped``, the prepared ``AcceleratedScheduler`` and the HF
Trainer's scheduler gate) is the scaler's skip flag of that step, true exactly when the step
changed nothing. Accelerate alone decides by whether the inner ``step`` ran, which a fused
optimizer always does (it skips inside its kernel: huggingface/accelerate#4242); the flag is also
right under hysteresis and norm-spike skips. It is a 0-dim bool device tensor: the host reads it
only where the framework takes ``bool()`` of it (the scheduler's gate).

It also replaces ``clip_grad_norm_`` on that one accelerator instance (a bound method in the
instance's ``__dict__``; the class and other accelerators are untouched) so that
``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` runs the scaler's fused unscale +
inf/NaN check + clip (``scaler.clip_grad_norm_``) on the prepared optimizer owning those
parameters, folded into the step for a fused optimizer. When it cannot, it says why
(:class:`FusedClipFallbackWarning`) and runs Accelerate's own ``clip_grad_norm_`` (which unscales
through the same scaler's ``unscale_`` and clips with torch).

Example::

    from accelerate import Accelerator
    from tritonscale.integrations.accelerate import install

    accelerator = Accelerator(mixed_precision="fp16")
    scaler = install(accelerator)                      # before prepare() (after works too, see install)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)                     # scaler.scale(loss).backward()
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the fused pass
        optimizer.step()                               # scaler.step + scaler.update, skipped on inf/NaN
        optimizer.zero_grad()

With the Hugging Face Trainer (it builds its own Accelerator inside ``__init__``)::

    class FusedTrainer(FusedScalerTrainerMixin, transformers.Trainer):
        pass

    trainer = FusedTrainer(model=model, args=args, train_dataset=ds, tritonscale_scaler_kwargs={"backend": "torch"})
    trainer.train()
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from ..passes.clip_args import check_max_norm, check_norm_type
from ..scaler.step_protocols import unwrap_optimizer
from ..scaler.grad_scaler import GradScaler
from .cpu_precision import warn_float16_on_cpu

__all__ = ["FusedClipFallbackWarning", "FusedScalerTrainerMixin", "install", "installed_scaler"]

# Accelerate hands the gradients to someone else's scaling or clipping in these set-ups: DeepSpeed
# and Megatron-LM scale the loss themselves, FSDP shards the gradients (a local norm is not the
# global one; torch needs ShardedGradScaler there), XLA reduces the gradients inside clip_grad_norm_.
_REFUSED_DISTRIBUTED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed does its own loss scaling and clipping",
    DistributedType.MEGATRON_LM: "Megatron-LM does its own loss scaling and clipping",
    DistributedType.FSDP: "FSDP shards the gradients: a per-rank norm is not the global norm",
    DistributedType.XLA: "XLA reduces the gradients inside Accelerate's clip_grad_norm_",
}

# The attribute on the accelerator instance that holds what install() did (and marks it installed).
_INSTALLED_ATTR = "_tritonscale_installed"


class FusedClipFallbackWarning(UserWarning):
    """``accelerator.clip_grad_norm_`` ran Accelerate's own path instead of the fused pass; the
    message says why. Results are still correct (Accelerate unscales through the same scaler)."""


@dataclass
class _Installed:
    scaler: GradScaler
    accelerate_clip_grad_norm_: Any  # Accelerate's own bound method, for the fallback
    accelerate_prepare_optimizer: Any  # Accelerate's own bound method, wrapped by _prepare_optimizer


def installed_scaler(accelerator: Accelerator) -> GradScaler | None:
    """The ``tritonscale.GradScaler`` that :func:`install` put on ``accelerator``, or None.

    Args:
        accelerator: the ``accelerate.Accelerator`` to look at.

    Returns:
        the scaler :func:`install` put on ``accelerator``; None where it installed none.
    """
    installed = accelerator.__dict__.get(_INSTALLED_ATTR)
    return installed.scaler if installed is not None else None


def install(accelerator: Accelerator, **scaler_kwargs: Any) -> GradScaler:
    """Install a ``tritonscale.GradScaler`` on ``accelerator`` and route its ``clip_grad_norm_``
    to the fused pass. Returns the scaler.

    Call it right after creating the Accelerator, before ``accelerator.prepare(...)``: then
    ``prepare`` wraps the model's forward in fp16 autocast and hands the scaler to the optimizers
    itself. Called after ``prepare`` it also works: the prepared ``AcceleratedOptimizer``\\ s get
    the new scaler, and a torch scaler that already ran steps hands over its state (scale, growth
    tracker); but on CPU, where Accelerate had turned fp16 off, models prepared earlier are not
    autocast (a warning says so). Call it at an iteration boundary (not between backward and step).
    Every optimizer prepared on it, before or after, reports the scaler's skips in
    ``step_was_skipped`` (:class:`_SkipReportingOptimizer`).

    ``scaler_kwargs`` go to ``tritonscale.GradScaler`` (``init_scale``, ``growth_interval``,
    ``backend``, policy knobs, ...), on top of the Accelerator's ``GradScalerKwargs`` handler if
    one was given. The device is the accelerator's. ``enabled`` defaults to
    ``accelerator.mixed_precision == "fp16"``: with bf16 or no mixed precision the scaler is
    disabled, and ``clip_grad_norm_`` still runs fused with its inf/NaN check (the step after an
    inf/NaN norm is skipped). An enabled scaler needs ``mixed_precision="fp16"``.

    On CPU Accelerate turns fp16 into plain fp32 with no scaler (``native_amp`` False); this call
    turns it back on (``accelerator.native_amp = True``), so ``prepare`` autocasts the forward in
    float16 on CPU and ``accelerator.unscale_gradients`` unscales.

    Refused (ValueError): DeepSpeed, Megatron-LM, FSDP, XLA and FP8 set-ups, whose scaling or
    clipping Accelerate hands elsewhere.

    Example::

        accelerator = Accelerator(mixed_precision="fp16")
        scaler = install(accelerator, growth_interval=1000)
        model, optimizer = accelerator.prepare(model, optimizer)

    Args:
        accelerator: the ``accelerate.Accelerator`` to install the scaler on.
        **scaler_kwargs: ``tritonscale.GradScaler`` keywords, on top of the Accelerator's
            ``GradScalerKwargs`` handler.

    Returns:
        the installed ``tritonscale.GradScaler`` (also ``accelerator.scaler``).

    Raises:
        TypeError: ``accelerator`` is not an ``accelerate.Accelerator``.
        ValueError: a DeepSpeed, Megatron-LM, FSDP, XLA or FP8 set-up, or an enabled scaler without
            ``mixed_precision="fp16"``.
        RuntimeError: the accelerator's current scaler is mid-iteration.
    """
    _check_installable(accelerator)
    scaler = _new_scaler(accelerator, scaler_kwargs)
    fp16 = accelerator.mixed_precision == "fp16"
    if fp16 and not accelerator.native_amp:
        # Accelerate keys both the autocast wrapper of prepare()/autocast() and unscale_gradients on
        # native_amp, which it leaves False on CPU.
        accelerator.native_amp = True
        if accelerator.device.type == "cpu":
            warn_float16_on_cpu("Accelerate", 'mixed_precision="fp16"', "float32", 'mixed_precision="bf16"')
        if accelerator._models:
            warnings.warn(
                "install() turned fp16 on after prepare(): the models prepared so far run without "
                "autocast; call install() before accelerator.prepare(...)",
                stacklevel=2,
            )
    accelerator.scaler = scaler
    _take_over(accelerator, scaler)
    return scaler


def _take_over(accelerator: Accelerator, scaler: GradScaler) -> None:
    """Hand ``scaler`` to the optimizers prepared so far (reporting its skips) and shadow
    ``clip_grad_norm_`` and ``prepare_optimizer`` on this instance (for those prepared later)."""
    # Optimizers prepared before this call hold the old scaler (or None). AcceleratedOptimizer's own
    # __setstate__ sets the scaler and builds the step hook Accelerate's own skip test relies on.
    for opt in accelerator._optimizers:
        if isinstance(opt, AcceleratedOptimizer):
            opt.__setstate__({"scaler": scaler})
            _report_skips(opt)

    installed = accelerator.__dict__.get(_INSTALLED_ATTR)
    clip = installed.accelerate_clip_grad_norm_ if installed is not None else accelerator.clip_grad_norm_
    prepare = installed.accelerate_prepare_optimizer if installed is not None else accelerator.prepare_optimizer
    accelerator.__dict__[_INSTALLED_ATTR] = _Installed(scaler, clip, prepare)
    # Only this instance: instance attributes shadow Accelerator.clip_grad_norm_ / prepare_optimizer
    # (prepare() reaches the latter through self.prepare_optimizer).
    accelerator.clip_grad_norm_ = MethodType(_clip_grad_norm_, accelerator)
    accelerator.prepare_optimizer = MethodType(_prepare_optimizer, accelerator)


def _check_installable(accelerator: Accelerator) -> None:
    """Raise where tritonscale cannot take over the accelerator's loss scaling now (nothing changed)."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    reason = _REFUSED_DISTRIBUTED_TYPES.get(accelerator.distributed_type)
    if reason is not None:
        raise ValueError(f"tritonscale cannot take over loss scaling under {accelerator.distributed_type}: {reason}")
    if getattr(accelerator, "fp8_enabled", False):
        raise ValueError("tritonscale cannot take over loss scaling in an FP8 run (its backend owns the scaling)")
    old = accelerator.scaler
    if old is not None and getattr(old, "_per_optimizer_states", None):
        # A half-finished iteration (scaled or unscaled gradients on record) would be lost.
        raise RuntimeError("install() must be called at an iteration boundary: the current scaler is mid-iteration")


def _new_scaler(accelerator: Accelerator, scaler_kwargs: dict[str, Any]) -> GradScaler:
    """The scaler :func:`install` puts on ``accelerator``: the Accelerator's ``GradScalerKwargs``
    with ``scaler_kwargs`` on top, enabled for fp16, carrying the scale of a scaler that already ran."""
    handler = getattr(accelerator, "scaler_handler", None)
    kwargs: dict[str, Any] = handler.to_kwargs() if handler is not None else {}
    kwargs.update(scaler_kwargs)
    fp16 = accelerator.mixed_precision == "fp16"
    kwargs.setdefault("enabled", fp16)
    if kwargs["enabled"] and not fp16:
        # Accelerate unscales (unscale_gradients) and autocasts only when mixed_precision is fp16:
        # an enabled scaler elsewhere would leave scaled gradients to its fallback clip.
        raise ValueError(
            f"an enabled loss scaler needs Accelerator(mixed_precision='fp16'), got {accelerator.mixed_precision!r}; "
            "pass enabled=False for a bf16/fp32 run (fused clip with the inf/NaN check, no scaling)"
        )
    scaler = GradScaler(accelerator.device.type, **kwargs)
    old = accelerator.scaler
    if old is not None and scaler.is_enabled() and getattr(old, "_scale", None) is not None:
        # The old scaler already ran steps (or was loaded and used): carry its scale on.
        scaler.load_state_dict(old.state_dict())
    return scaler


def _clip_grad_norm_(
    accelerator: Accelerator,
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2,
) -> torch.Tensor:
    """``accelerator.clip_grad_norm_`` after :func:`install`: the fused pass on the owning optimizer.

    Returns the total norm of the unscaled gradients before clipping (a 0-dim float32 tensor), as
    Accelerate's does; it counts as that optimizer's ``unscale_`` for the iteration.
    """
    installed: _Installed = accelerator.__dict__[_INSTALLED_ATTR]
    # torch's clip_grad_norm_ takes one tensor too; iterating a tensor would walk its rows.
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    target, reason = _fused_target(accelerator, installed, params, max_norm, norm_type)
    if target is not None:
        try:
            return installed.scaler.clip_grad_norm_(target, max_norm, norm_type)
        except (TypeError, ValueError) as error:
            # A gradient the scaler refuses (shared memory, int, a self-overlapping view): it raises
            # before changing anything, so Accelerate's own path can still run on the same state.
            reason = f"the fused pass refused the gradients: {error}"
    warnings.warn(
        f"accelerator.clip_grad_norm_ runs Accelerate's own unscale + clip, not the fused pass: {reason}",
        FusedClipFallbackWarning,
        stacklevel=2,
    )
    return installed.accelerate_clip_grad_norm_(params, max_norm, norm_type)


def _fused_target(
    accelerator: Accelerator, installed: _Installed, params: list[torch.Tensor], max_norm: Any, norm_type: Any
) -> tuple[torch.optim.Optimizer | None, str]:
    """The real optimizer whose gradients are exactly the given ones, or None and the reason."""
    if accelerator.scaler is not installed.scaler:
        return None, "accelerator.scaler was replaced after install()"
    try:
        check_max_norm(max_norm)  # negative or NaN: Accelerate's path, which takes them
        check_norm_type(norm_type)
    except ValueError as error:
        return None, str(error)
    with_grad = {id(p) for p in params if p.grad is not None}
    if not with_grad:
        return None, "none of the parameters has a gradient"
    owners = []
    for prepared in accelerator._optimizers:
        real = unwrap_optimizer(prepared)
        owned = {id(p) for group in real.param_groups for p in group["params"] if p.grad is not None}
        if owned & with_grad:
            owners.append((real, owned))
    # scaler.clip_grad_norm_ works per optimizer, on all its gradients: it matches torch's clip of
    # `parameters` only when one optimizer holds exactly those gradients.
    if not owners:
        return None, "the parameters belong to no optimizer passed to accelerator.prepare()"
    if len(owners) > 1:
        return None, f"the parameters are spread over {len(owners)} prepared optimizers (one global norm)"
    real, owned = owners[0]
    if not with_grad <= owned:
        return None, "some parameters belong to no optimizer passed to accelerator.prepare()"
    if owned != with_grad:
        extra = len(owned - with_grad)
        return None, f"the optimizer also holds {extra} gradient(s) of parameters not passed to clip_grad_norm_"
    return real, ""


def _prepare_optimizer(accelerator: Accelerator, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
    """``accelerator.prepare_optimizer`` after :func:`install`: Accelerate's, then :func:`_report_skips`."""
    installed: _Installed = accelerator.__dict__[_INSTALLED_ATTR]
    prepared = installed.accelerate_prepare_optimizer(optimizer, device_placement=device_placement)
    if isinstance(prepared, AcceleratedOptimizer):
        _report_skips(prepared)
    return prepared


class _SkipReportingOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` whose ``step_was_skipped`` is the installed scaler's skip flag.

    Accelerate's ``step`` runs ``scaler.step``, ``scaler.update`` and then records whether the inner
    optimizer's ``step`` was called in ``_is_overflow``, which ``step_was_skipped`` returns. A fused
    optimizer is always called (it skips inside its kernel), so that reads False on its skips. Here
    ``_is_overflow`` is a property: set right after that ``update``, it keeps
    ``scaler.last_skip_flag()`` instead, this step's 0-dim bool device tensor, true exactly when the
    step was skipped (inf/NaN, a hysteresis skip, a norm-spike skip) and the same on every rank.
    Nothing is read on the host until someone takes ``bool()`` of it, as ``AcceleratedScheduler``,
    ``accelerator.optimizer_step_was_skipped`` and the HF Trainer do. Accelerate's value stays where
    the scaler is not a ``tritonscale.GradScaler`` or has no flag. Example:
    ``if optimizer.step_was_skipped: ...`` (after ``_report_skips(optimizer)``).
    """

    @property
    def _is_overflow(self) -> bool | torch.Tensor:
        return self.__dict__.get(_SKIP_ATTR, False)

    @_is_overflow.setter
    def _is_overflow(self, step_not_called: bool) -> None:
        scaler = getattr(self, "scaler", None)
        flag = scaler.last_skip_flag() if isinstance(scaler, GradScaler) else None
        self.__dict__[_SKIP_ATTR] = step_not_called if flag is None else flag


# Where _SkipReportingOptimizer keeps the skip flag of its last step.
_SKIP_ATTR = "_tritonscale_step_was_skipped"


def _report_skips(optimizer: AcceleratedOptimizer) -> None:
    """Make a prepared optimizer report the installed scaler's skips (:class:`_SkipReportingOptimizer`).

    Only this instance changes class (to a subclass: ``isinstance`` checks, pickling and
    ``state_dict`` are unchanged); its last value carries over. Other ``AcceleratedOptimizer``
    subclasses (DeepSpeed's, Megatron-LM's: set-ups install refuses) are left alone.
    """
    if type(optimizer) is AcceleratedOptimizer:
        last = optimizer.__dict__.pop("_is_overflow", False)
        optimizer.__class__ = _SkipReportingOptimizer
        optimizer.__dict__[_SKIP_ATTR] = last


class FusedScalerTrainerMixin:
    """Mix into ``transformers.Trainer`` to train on a ``tritonscale.GradScaler``.

    The Trainer creates its Accelerator in ``create_accelerator_and_postprocess`` (from ``__init__``,
    and again for hyperparameter searches) and prepares the model and optimizer in ``train()``, so
    installing right there is "before prepare". ``tritonscale_scaler_kwargs`` go to
    :func:`install`; the scaler is ``trainer.tritonscale_scaler``. The Trainer's
    ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` then runs the fused pass
    (``max_grad_norm <= 0`` makes it ask for the norm only, ``max_norm=inf``: fused too).
    The Trainer's scheduler then advances exactly on applied steps: its
    ``optimizer_step_was_skipped`` gate reads the scaler's skip flag, fused optimizers included.
    Use ``fp16=True`` (on CPU too: install turns fp16 autocast back on).

    Example::

        class FusedTrainer(FusedScalerTrainerMixin, transformers.Trainer):
            pass

        trainer = FusedTrainer(model=model, args=TrainingArguments(..., fp16=True), train_dataset=ds,
                               tritonscale_scaler_kwargs={"growth_interval": 1000})
        trainer.train()

    Args:
        *args: the Trainer's positional arguments.
        tritonscale_scaler_kwargs: keywords for :func:`install` (``tritonscale.GradScaler``'s); None
            (the default) for none.
        **kwargs: the Trainer's keyword arguments.
    """

    tritonscale_scaler: GradScaler | None = None

    def __init__(self, *args: Any, tritonscale_scaler_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # Set before Trainer.__init__, which creates the Accelerator.
        self._tritonscale_scaler_kwargs = dict(tritonscale_scaler_kwargs or {})
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.tritonscale_scaler = install(self.accelerator, **self._tritonscale_scaler_kwargs)
