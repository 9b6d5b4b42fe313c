"""Lightning Trainer and Fabric precision plugins whose gradient clipping is tritonscale's fused pass.

Two plugins, because the Trainer's and Fabric's precision plugins have different base classes and
different step signatures; they share the scaler handling below:

* :class:`FusedClipPrecision` -- for ``lightning.pytorch.Trainer``. ``gradient_clip_val`` (by norm)
  ends in ``scaler.clip_grad_norm_``: one unscale + inf/NaN check + clip pass, or the fold into a
  fused optimizer (``torch.optim.AdamW(..., fused=True)``), which Lightning's own ``MixedPrecision``
  refuses to clip.
* :class:`FabricFusedClipPrecision` -- for ``lightning.fabric.Fabric``. Fabric's strategy, not the
  precision plugin, clips (it calls ``precision.unscale_gradients`` and then torch's
  ``clip_grad_norm_``, which raises on an inf/NaN norm by default): :func:`enable_fused_clipping`
  routes ``fabric.clip_gradients(..., max_norm=...)`` into the fused pass, where an inf/NaN norm
  skips the step instead of raising.

Both take ``"16-mixed"`` (a dynamic loss scale) or ``"bf16-mixed"`` (no scale: a disabled
``tritonscale.GradScaler`` whose ``clip_grad_norm_`` still checks for inf/NaN and skips the step on
it). Clipping by value falls back to torch's ``clip_grad_value_`` after an ``unscale_``.

Skipped steps and schedulers: Lightning steps ``interval="step"`` schedulers after every batch with
no skip check. :class:`FusedClipPrecision` gates the module's ``lr_scheduler_step`` so those
schedulers advance exactly on applied steps (one host read per scheduler step, when Lightning asks).
Fabric has no scheduler of its own: the loop asks the scaler (see :class:`FabricFusedClipPrecision`).

Example::

    import lightning
    from tritonscale.integrations.lightning import FusedClipPrecision

    trainer = lightning.Trainer(gradient_clip_val=1.0, plugins=[FusedClipPrecision("16-mixed", "cuda")])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.amp import MixedPrecision as FabricMixedPrecision
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import LBFGS, Optimizer

from ..loop.applied_steps import AppliedSteps
from ..scaler.step_protocols import takes_amp_scaling, unwrap_optimizer
from ..scaler.grad_scaler import GradScaler, OptState
from .cpu_precision import warn_float16_on_cpu

__all__ = ["FabricFusedClipPrecision", "FusedClipPrecision", "enable_fused_clipping"]

_Precision = Literal["16-mixed", "bf16-mixed"]


def _make_scaler(precision: str, device: str, scaler: GradScaler | None, scaler_kwargs: dict[str, Any]) -> GradScaler:
    """The plugin's scaler: the one passed, or a new one (disabled for bf16-mixed, which has no scale)."""
    if precision not in ("16-mixed", "bf16-mixed"):
        raise ValueError(f"precision must be '16-mixed' or 'bf16-mixed', got {precision!r}")
    if precision == "16-mixed" and torch.device(device).type == "cpu":
        warn_float16_on_cpu("Lightning", '"16-mixed"', "bfloat16", '"bf16-mixed"', calls_to_user=2)
    if scaler is not None:
        # The plugin calls clip_grad_norm_ and reads the per-optimizer stage with our meaning:
        # torch.amp.GradScaler has neither, so it belongs in Lightning's own MixedPrecision.
        if not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a tritonscale.GradScaler, got {type(scaler).__name__}")
        if scaler_kwargs:
            raise TypeError(f"pass either scaler or GradScaler keywords, not both (got {sorted(scaler_kwargs)})")
        if precision == "bf16-mixed" and scaler.is_enabled():
            raise ValueError("precision='bf16-mixed' has no loss scale: pass GradScaler(..., enabled=False)")
        return scaler
    # bf16 needs no scale, but the disabled scaler still gives clip_grad_norm_'s check-and-skip.
    return GradScaler(device, enabled=precision == "16-mixed", **scaler_kwargs)


def _unscaled_yet(scaler: GradScaler, optimizer: Any) -> bool:
    """Whether this iteration already unscaled the optimizer's gradients (unscale_ or clip_grad_norm_);
    a disabled scaler never unscales."""
    return not scaler.is_enabled() or scaler.optimizer_stage(optimizer) not in (None, OptState.READY)


def _unscale_once(scaler: GradScaler, optimizer: Any) -> None:
    """``scaler.unscale_`` unless something already unscaled this iteration (a second call raises)."""
    if not _unscaled_yet(scaler, optimizer):
        scaler.unscale_(optimizer)


class _AppliedStepsOnly:
    """A LightningModule's ``lr_scheduler_step`` that leaves ``interval="step"`` schedulers alone on a
    skipped step (Lightning steps them after every batch); epoch schedulers always step.

    Example: ``module.lr_scheduler_step = _AppliedStepsOnly(module, applied_steps, module.lr_scheduler_step)``.
    """

    def __init__(self, module: LightningModule, applied: AppliedSteps, hook: Callable[..., Any]) -> None:
        self.module, self.applied, self.hook = module, applied, hook
        self.__wrapped__ = hook  # Lightning's is_overridden("lr_scheduler_step") looks through the gate

    def __call__(self, scheduler: Any, metric: Any = None) -> Any:
        configs = self.module.trainer.lr_scheduler_configs
        per_step = any(config.scheduler is scheduler and config.interval == "step" for config in configs)
        if per_step and self.applied.skipped():  # the one host read, when Lightning asks
            return None
        return self.hook(scheduler, metric)


def _gate_schedulers(module: LightningModule, applied: AppliedSteps) -> None:
    """Install :class:`_AppliedStepsOnly` on ``module`` (this instance only), once per ``applied``."""
    hook = module.__dict__.get("lr_scheduler_step")
    if isinstance(hook, _AppliedStepsOnly):
        if hook.applied is applied:
            return
        hook = hook.hook  # another plugin's gate (an earlier Trainer): replace it
    module.lr_scheduler_step = _AppliedStepsOnly(module, applied, hook or module.lr_scheduler_step)


class FusedClipPrecision(MixedPrecision):
    """Lightning Trainer mixed precision whose norm clipping is tritonscale's fused pass.

    ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` (the default algorithm) and
    ``self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm="norm")`` in manual
    optimization end in ``scaler.clip_grad_norm_`` on the real optimizer: one unscale + inf/NaN
    check + clip pass, or, with a fused optimizer (``torch.optim.AdamW(..., fused=True)``), no
    write at all (``scale / clip_coef`` is folded into the optimizer's step). Lightning's own
    ``MixedPrecision`` refuses to clip with fused optimizers; this plugin clips them.

    Args:
        precision: ``"16-mixed"`` (float16 autocast and a dynamic loss scale) or ``"bf16-mixed"``
            (bfloat16 autocast, no scale; clipping by norm still checks for inf/NaN and skips the
            step on it).
        device: the autocast device (``"cuda"``, ``"cpu"``), and the scaler's.
        scaler: a ``tritonscale.GradScaler`` to use (disabled for bf16-mixed); made from ``device``
            and ``scaler_kwargs`` when left out.
        unscale_before_hooks: Lightning unscales right after backward, so ``on_before_optimizer_step``
            sees true gradients; that unscale is a pass of its own and leaves the clip only
            clipping. False (the default) leaves the unscale to the clip, so the two are one
            pass, and those hooks see the gradients still scaled (as they already do with a
            fused optimizer in Lightning). True restores Lightning's order.
        **scaler_kwargs: ``tritonscale.GradScaler`` keywords (``init_scale``, ``backend``,
            ``policy``, ``hysteresis``, ...), when ``scaler`` is left out.

    Clipping by value unscales (``scaler.unscale_``, which also works for fused optimizers) and
    falls back to ``torch.nn.utils.clip_grad_value_``: no fold, and with bf16-mixed no inf/NaN
    check. Skipped steps are skipped, never raised: the inf/NaN check decides, and with
    ``"16-mixed"`` the scale backs off. ``self.last_grad_norm`` holds the last fused clip's total
    norm (a 0-dim device tensor, no sync) for logging.

    Schedulers: Lightning steps ``interval="step"`` schedulers after every batch; this plugin gates
    the module's ``lr_scheduler_step`` (on the instance, the user's override still runs) so they
    advance exactly on applied steps: one host read of the skip flag per batch that steps a
    scheduler, none otherwise. ``self.applied_steps.skipped()`` is the batch's skip signal and
    ``self.applied_steps.count`` the applied steps. A batch whose ``training_step`` returned None
    (no optimizer step) keeps Lightning's behaviour.

    Example::

        from tritonscale.integrations.lightning import FusedClipPrecision

        trainer = lightning.Trainer(
            gradient_clip_val=1.0,
            plugins=[FusedClipPrecision("16-mixed", "cuda", growth_interval=1000)],
        )
        trainer.fit(model)  # model.configure_optimizers may return AdamW(..., fused=True)
    """

    scaler: GradScaler

    def __init__(
        self,
        precision: _Precision = "16-mixed",
        device: str = "cuda",
        scaler: GradScaler | None = None,
        *,
        unscale_before_hooks: bool = False,
        **scaler_kwargs: Any,
    ) -> None:
        scaler = _make_scaler(precision, device, scaler, scaler_kwargs)
        # Lightning's __init__ refuses any scaler with bf16-mixed, and would make a torch one for
        # 16-mixed if given None: hand it ours (or None for bf16) and set ours after.
        super().__init__(precision, device, scaler=scaler if scaler.is_enabled() else None)
        self.scaler = scaler
        self.unscale_before_hooks = unscale_before_hooks
        self.last_grad_norm: torch.Tensor | None = None
        self._backward_skipped = False
        self.applied_steps = AppliedSteps()

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward + backward), the hooks and the clip, then ``scaler.step`` + ``update``.

        Args:
            optimizer: the optimizer Lightning steps.
            model: the LightningModule being trained.
            closure: Lightning's closure: the training step and its backward.
            **kwargs: passed to the optimizer's ``step``.

        Returns:
            what ``scaler.step`` returns (the optimizer step's output; None where the step was skipped),
            or the closure's result where ``training_step`` returned None (no step taken).

        Raises:
            RuntimeError: an LBFGS optimizer with a loss scale (``"16-mixed"``).
        """
        if isinstance(optimizer, LBFGS):
            if self.scaler.is_enabled():
                raise RuntimeError("AMP and the LBFGS optimizer are not compatible.")
            # bf16 without a scale: LBFGS re-evaluates the closure itself; a plain step as in Lightning.
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        _gate_schedulers(model, self.applied_steps)
        self.applied_steps.clear()
        closure_result = closure()
        # training_step returned None: no backward ran, so there is nothing to unscale, clip or step.
        self._backward_skipped = closure_result is None and model.automatic_optimization
        try:
            # Lightning's order, on request. Not for fused optimizers: as in Lightning, their
            # gradients stay scaled so the clip can fold into their step.
            handles_unscaling = takes_amp_scaling(unwrap_optimizer(optimizer))
            if self.unscale_before_hooks and not self._backward_skipped and not handles_unscaling:
                _unscale_once(self.scaler, optimizer)
            # on_before_optimizer_step hooks, then configure_gradient_clipping -> clip_gradients.
            self._after_closure(model, optimizer)
        finally:
            backward_skipped, self._backward_skipped = self._backward_skipped, False
        if backward_skipped:
            return closure_result
        # The step is skipped on inf/NaN (found by the clip, or by step()'s own unscale/check).
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self.applied_steps.record(self.scaler)
        return step_output

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by norm with the fused pass (fused optimizers included); by value through torch.

        Args:
            optimizer: the optimizer whose gradients are clipped.
            clip_val: the clip value (the norm bound, or the value bound).
            gradient_clip_algorithm: ``"norm"`` (the default) or ``"value"``.
        """
        if self._backward_skipped:
            return  # no gradients this step (training_step returned None): keep the scaler's stage clean
        # Lightning's MixedPrecision.clip_gradients refuses fused optimizers; the base class just
        # dispatches to clip_grad_by_norm / clip_grad_by_value below.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """``scaler.clip_grad_norm_``: unscale (if not done yet) + inf/NaN check + clip, one pass.

        The total norm before clipping is kept in ``self.last_grad_norm``.

        Args:
            optimizer: the optimizer whose gradients are clipped.
            clip_val: the bound on the total norm.
        """
        self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """torch's ``clip_grad_value_`` on unscaled gradients (no fused path for value clipping).

        Args:
            optimizer: the optimizer whose gradients are clipped.
            clip_val: the bound on each gradient value.
        """
        _unscale_once(self.scaler, optimizer)
        super().clip_grad_by_value(optimizer, clip_val)


class FabricFusedClipPrecision(FabricMixedPrecision):
    """Fabric mixed precision with tritonscale's scaler; with :func:`enable_fused_clipping`, the
    norm clipping of ``fabric.clip_gradients`` is its fused pass.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (no scale; clipping by norm still checks for
            inf/NaN and skips the step on it).
        device: the autocast device, and the scaler's.
        scaler: a ``tritonscale.GradScaler`` (disabled for bf16-mixed); made when left out.
        **scaler_kwargs: ``tritonscale.GradScaler`` keywords, when ``scaler`` is left out.

    Fabric's strategy clips: it calls :meth:`unscale_gradients` and then torch's
    ``clip_grad_norm_`` with ``error_if_nonfinite=True``, which would raise on the very step the
    scaler skips. :func:`enable_fused_clipping` makes ``fabric.clip_gradients(..., max_norm=...)``
    call :meth:`clip_grad_norm_` instead. Without it, clipping still works (``unscale_`` is the
    fused unscale + check pass, and fused optimizers are allowed), and on an overflowed step
    :meth:`main_params` hands torch's clip no parameters (one host read), so nothing raises and
    the step is skipped; bf16-mixed then gets no check (Fabric's behaviour).

    Fabric has no scheduler of its own: the loop steps it only on applied steps with
    ``if not plugin.applied_steps.skipped(): scheduler.step()`` (one host read; the same as
    ``plugin.scaler.last_step_skipped()``), and ``plugin.applied_steps.count`` counts them.

    Example::

        from tritonscale.integrations.lightning import FabricFusedClipPrecision, enable_fused_clipping

        plugin = FabricFusedClipPrecision("16-mixed", "cuda")
        fabric = enable_fused_clipping(Fabric(accelerator="cuda", plugins=[plugin]))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), fused=True))
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # fused; folded into AdamW
        optimizer.step()  # skipped on inf/NaN; the scale is updated
        if not plugin.applied_steps.skipped():  # one host read
            scheduler.step()
    """

    scaler: GradScaler

    def __init__(
        self,
        precision: _Precision = "16-mixed",
        device: str = "cuda",
        scaler: GradScaler | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        scaler = _make_scaler(precision, device, scaler, scaler_kwargs)
        super().__init__(precision, device, scaler=scaler if scaler.is_enabled() else None)
        self.scaler = scaler
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_steps = AppliedSteps()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``scaler.step`` (skipped on inf/NaN, also with bf16-mixed after a norm clip) and ``update``.

        Args:
            optimizer: the optimizer to step.
            **kwargs: passed to the optimizer's ``step``.

        Returns:
            what ``scaler.step`` returns: the optimizer step's output, None where the step was skipped.

        Raises:
            TypeError: an LBFGS optimizer.
        """
        if isinstance(optimizer, LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self.applied_steps.record(self.scaler)
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """The fused unscale + inf/NaN check (once per iteration); fused optimizers are allowed.

        Args:
            optimizer: the optimizer whose gradients are unscaled.
        """
        _unscale_once(self.scaler, optimizer)

    def main_params(self, optimizer: Optimizer) -> Any:
        """The parameters Fabric's strategy clips: none on an overflowed step (one host read).

        Only Fabric's own clipping path calls this, right after :meth:`unscale_gradients`. Its
        torch ``clip_grad_norm_`` raises on an inf/NaN norm by default; the scaler skips that step
        anyway, so there is nothing to clip.

        Args:
            optimizer: the optimizer whose parameters Fabric clips.

        Returns:
            an empty list on an overflowed step (enabled scaler), else the base plugin's ``main_params``.
        """
        if self.scaler.is_enabled() and self.scaler.overflowed(optimizer):
            return []
        return super().main_params(optimizer)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``scaler.clip_grad_norm_``: the total norm before clipping (inf/NaN on an overflow: the step is skipped).

        Args:
            optimizer: the optimizer whose gradients are clipped.
            max_norm: the bound on the total norm.
            norm_type: the norm's order (2.0).

        Returns:
            the total norm before clipping, a 0-dim device tensor (also kept in ``self.last_grad_norm``).
        """
        self.last_grad_norm = self.scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
        return self.last_grad_norm


def enable_fused_clipping(fabric: Fabric) -> Fabric:
    """Route ``fabric.clip_gradients(..., max_norm=...)`` into the plugin's fused clip; returns ``fabric``.

    Fabric gives precision plugins no say in norm clipping (its strategy calls torch's
    ``clip_grad_norm_``), so this replaces ``clip_gradients_norm`` on this Fabric's strategy
    instance only. ``error_if_nonfinite`` is then ignored: an inf/NaN norm skips the step (and
    backs off the scale) instead of raising. Refused for strategies that clip their own way
    (FSDP, DeepSpeed, XLA: sharded norms the scaler does not see).

    Example::

        fabric = enable_fused_clipping(
            Fabric(accelerator="cuda", plugins=[FabricFusedClipPrecision("16-mixed", "cuda")])
        )

    Args:
        fabric: a ``Fabric`` whose precision plugin is a :class:`FabricFusedClipPrecision`.

    Returns:
        ``fabric`` itself, its strategy's norm clipping now the fused clip.

    Raises:
        TypeError: the precision plugin is not a :class:`FabricFusedClipPrecision`.
        NotImplementedError: a strategy that clips its own way (FSDP, DeepSpeed, XLA).
    """
    strategy = fabric.strategy
    plugin = strategy.precision
    if not isinstance(plugin, FabricFusedClipPrecision):
        raise TypeError(
            f"enable_fused_clipping needs Fabric(plugins=[FabricFusedClipPrecision(...)]), "
            f"got precision plugin {type(plugin).__name__}"
        )
    if type(strategy).clip_gradients_norm is not FabricStrategy.clip_gradients_norm:
        raise NotImplementedError(
            f"{type(strategy).__name__} clips gradients its own way; the fused clip supports strategies "
            "that use Fabric's default clipping (single device, DDP)"
        )

    def clip_gradients_norm(
        module: torch.nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        # error_if_nonfinite: the scaler's skip replaces the error (see the docstring).
        return plugin.clip_grad_norm_(optimizer, max_norm, norm_type)

    strategy.clip_gradients_norm = clip_gradients_norm  # this instance only
    return fabric
