"""mmengine: ``FusedClipAmpOptimWrapper``, an ``AmpOptimWrapper`` on ``tritonscale.GradScaler``.

Registered in mmengine's ``OPTIM_WRAPPERS`` as ``"FusedClipAmpOptimWrapper"`` when this module is
imported, so a config selects it by name (``custom_imports`` makes the config import it)::

    custom_imports = dict(imports=["tritonscale.integrations.mmengine"], allow_failed_imports=False)
    optim_wrapper = dict(
        type="FusedClipAmpOptimWrapper",
        optimizer=dict(type="AdamW", lr=1e-3, fused=True),
        clip_grad=dict(max_norm=1.0),                   # runs as the fused clip
        loss_scale=dict(init_scale=2.0**16, hysteresis=2),  # any tritonscale.GradScaler keyword
    )

or in code::

    from tritonscale.integrations.mmengine import FusedClipAmpOptimWrapper

    optim_wrapper = FusedClipAmpOptimWrapper(optimizer=optimizer, clip_grad=dict(max_norm=1.0))
    with optim_wrapper.optim_context(model):
        loss = model(x).square().mean()
    optim_wrapper.update_params(loss)

Everything mmengine's ``AmpOptimWrapper`` does stays its own code (``update_params``,
``backward``, gradient accumulation, ``should_update``, ``optim_context``'s autocast,
``state_dict`` under ``"loss_scaler"``) with ``self.loss_scaler`` a ``tritonscale.GradScaler``;
only ``step`` changes. With ``clip_grad=dict(max_norm=..., norm_type=1 | 2 | inf)`` it is
``loss_scaler.clip_grad_norm_(optimizer, ...)`` -- unscale, inf/NaN check and clip in one pass,
folded into the optimizer's step for a fused optimizer -- instead of ``unscale_`` followed by
``torch.nn.utils.clip_grad_norm_``. ``clip_grad=dict(type="value", ...)``, other norm types and
``error_if_nonfinite=True`` go through mmengine's own ``AmpOptimWrapper.step`` (our ``unscale_``,
then its ``_clip_grad``).

The norm is logged as ``train/grad_norm`` like mmengine does; that read is a host sync
(``log_grad_norm=False`` drops it; ``loss_scaler.stats()["norm"]`` keeps it on the device).

On CPU: mmengine's ``AmpOptimWrapper.__init__`` asserts a CUDA/NPU/MLU/MUSA device (its scaler
is ``torch.cuda.amp.GradScaler``). This class builds its own scaler and does not run that
``__init__``, so it works on CPU: the scale and the fused clip run on the CPU tensors, and
``optim_context`` gives mmengine's CPU autocast (bfloat16 only; mmengine asserts that).
``use_fsdp=True`` (torch's ``ShardedGradScaler``) is not supported.

Skipped steps and schedulers: mmengine's ``ParamSchedulerHook`` steps every iteration-based
scheduler after every iteration, skipped steps included. ``FusedClipParamSchedulerHook`` (registered
in ``HOOKS``) steps them only when the iteration's optimizer step was applied::

    default_hooks = dict(param_scheduler=dict(type="FusedClipParamSchedulerHook"))

``wrapper.applied_steps.skipped()`` is the skip signal of the iteration's step (one host read, when
asked) and ``wrapper.applied_steps.count`` the applied steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mmengine.device import get_device
from mmengine.hooks import ParamSchedulerHook
from mmengine.optim import AmpOptimWrapper, OptimWrapper, OptimWrapperDict
from mmengine.registry import HOOKS, OPTIM_WRAPPERS

from tritonscale.loop.applied_steps import AppliedSteps
from tritonscale.passes.clip_args import kernels_compute
from tritonscale.scaler.grad_scaler import GradScaler

__all__ = ["FusedClipAmpOptimWrapper", "FusedClipParamSchedulerHook"]


@OPTIM_WRAPPERS.register_module()
class FusedClipAmpOptimWrapper(AmpOptimWrapper):
    """mmengine's ``AmpOptimWrapper`` whose norm clip is ``tritonscale.GradScaler.clip_grad_norm_``.

    Args:
        loss_scale: as in ``AmpOptimWrapper``: ``"dynamic"`` (default scaler), a float (a static
            scale, reset after every step as mmengine does) or a dict of ``tritonscale.GradScaler``
            keywords (torch's ``init_scale``, ``growth_interval``, ... and ours: ``backend``,
            ``policy``, ``hysteresis``, ``device``...). The device defaults to mmengine's
            ``get_device()``.
        dtype: the autocast dtype of ``optim_context``, as in ``AmpOptimWrapper``.
        use_fsdp: must be False.
        log_grad_norm: log the clip's norm as ``train/grad_norm`` (one host read per step).
        **kwargs: ``OptimWrapper``'s (``optimizer``, ``accumulative_counts``, ``clip_grad``).

    Example::

        wrapper = FusedClipAmpOptimWrapper(optimizer=opt, clip_grad=dict(max_norm=1.0))
        wrapper.update_params(loss)
    """

    def __init__(
        self,
        loss_scale: str | float | dict[str, Any] = "dynamic",
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        log_grad_norm: bool = True,
        **kwargs: Any,
    ) -> None:
        if use_fsdp:
            raise ValueError("FusedClipAmpOptimWrapper does not support use_fsdp=True (ShardedGradScaler)")
        # AmpOptimWrapper.__init__ is skipped on purpose: it asserts a CUDA/NPU/MLU/MUSA device and
        # builds a torch.cuda.amp.GradScaler, both of which this class replaces. The attributes it
        # sets (_scale_update_param, loss_scaler, cast_dtype) are set here instead.
        OptimWrapper.__init__(self, **kwargs)
        self._scale_update_param: float | None = None
        if loss_scale == "dynamic":
            scaler_kwargs: dict[str, Any] = {}
        elif isinstance(loss_scale, float):
            # mmengine's static scale: every update() sets it back (update(new_scale)).
            self._scale_update_param = loss_scale
            scaler_kwargs = {"init_scale": loss_scale}
        elif isinstance(loss_scale, dict):
            scaler_kwargs = dict(loss_scale)
        else:
            raise TypeError(f'loss_scale must be of type float, dict, or "dynamic", but got {loss_scale}')
        scaler_kwargs.setdefault("device", get_device())
        self.loss_scaler = GradScaler(**scaler_kwargs)
        if isinstance(dtype, str):
            if dtype not in self.valid_dtypes:
                raise ValueError(f"dtype should be any of {self.valid_dtypes}, got {dtype}")
            dtype = getattr(torch, dtype)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype should be None or instance of torch.dtype, got {dtype}")
        self.cast_dtype = dtype
        self.log_grad_norm = log_grad_norm
        self._fused_clip = self._fused_clip_arguments()
        self.applied_steps = AppliedSteps()  # read by FusedClipParamSchedulerHook

    def _fused_clip_arguments(self) -> dict[str, float] | None:
        """(max_norm, norm_type) when the configured clip is one the fused pass computes exactly.

        OptimWrapper.__init__ has popped ``type`` and set ``grad_name``; what is left of
        ``clip_grad`` are ``torch.nn.utils.clip_grad_norm_``'s keywords.
        """
        if not self.clip_grad_kwargs or self.grad_name != "grad_norm":
            return None
        kwargs = dict(self.clip_grad_kwargs)
        kwargs.pop("foreach", None)  # how torch loops over the tensors: no effect on the result
        if kwargs.pop("error_if_nonfinite", False):
            return None  # torch's raise on an inf/NaN norm (even on an overflowed fp16 step)
        max_norm, norm_type = kwargs.pop("max_norm", None), kwargs.pop("norm_type", 2.0)
        if kwargs or isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            return None  # let torch's clip_grad_norm_ report what it makes of these
        try:
            norm_type = float(norm_type)  # torch takes "inf" too
        except (TypeError, ValueError):
            return None
        if not kernels_compute(norm_type) or not 0 < max_norm < math.inf:  # other norm types: torch's
            return None
        return {"max_norm": float(max_norm), "norm_type": norm_type}

    def step(self, **kwargs: Any) -> None:
        """Clip (fused), step (skipped on inf/NaN) and update the scale.

        Called by ``update_params`` when ``should_update()``; ``kwargs`` go to the optimizer's step.

        Args:
            **kwargs: passed to the optimizer's ``step``.
        """
        if self._fused_clip is None or self._frozen_params_have_grads():
            super().step(**kwargs)  # mmengine's own AmpOptimWrapper.step, on our scaler
        else:
            # = AmpOptimWrapper.step's unscale_ + _clip_grad (torch.nn.utils.clip_grad_norm_), one pass.
            norm = self.loss_scaler.clip_grad_norm_(self.optimizer, **self._fused_clip)
            if self.log_grad_norm:
                self.message_hub.update_scalar("train/grad_norm", float(norm))
            self.loss_scaler.step(self.optimizer, **kwargs)
            self.loss_scaler.update(self._scale_update_param)
        self.applied_steps.record(self.loss_scaler)  # no host read

    def _frozen_params_have_grads(self) -> bool:
        # mmengine clips only parameters with requires_grad; the fused clip covers every gradient
        # the optimizer holds. They differ only for a frozen parameter that still has a gradient.
        return any(
            p.grad is not None and not p.requires_grad for group in self.optimizer.param_groups for p in group["params"]
        )


@HOOKS.register_module()
class FusedClipParamSchedulerHook(ParamSchedulerHook):
    """mmengine's ``ParamSchedulerHook`` whose iteration-based schedulers advance only on applied steps.

    After an iteration whose ``FusedClipAmpOptimWrapper`` step was skipped, the iteration-based
    schedulers of that wrapper do not step (one host read of the skip flag per iteration that
    stepped); epoch-based ones, other wrappers' schedulers and iterations without an optimizer
    step (gradient accumulation) keep mmengine's behaviour.

    Example (config)::

        default_hooks = dict(param_scheduler=dict(type="FusedClipParamSchedulerHook"))
    """

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        for wrapper in _wrappers(runner.optim_wrapper):
            wrapper.applied_steps.clear()  # an iteration without a step (accumulation) skipped nothing

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        wrappers, schedulers = runner.optim_wrapper, runner.param_schedulers
        if isinstance(wrappers, OptimWrapperDict) and isinstance(schedulers, dict):
            skipped = {key: _skipped(wrapper) for key, wrapper in wrappers.items()}
            kept = {key: value for key, value in schedulers.items() if not skipped.get(key, False)}
        else:
            kept = None if any(_skipped(wrapper) for wrapper in _wrappers(wrappers)) else schedulers
        runner.param_schedulers = kept  # what ParamSchedulerHook steps (None: nothing)
        try:
            super().after_train_iter(runner, batch_idx, data_batch, outputs)
        finally:
            runner.param_schedulers = schedulers


def _wrappers(optim_wrapper: Any) -> list[FusedClipAmpOptimWrapper]:
    """The runner's FusedClipAmpOptimWrappers (one, or those of an OptimWrapperDict)."""
    each = optim_wrapper.values() if isinstance(optim_wrapper, OptimWrapperDict) else [optim_wrapper]
    return [wrapper for wrapper in each if isinstance(wrapper, FusedClipAmpOptimWrapper)]


def _skipped(wrapper: Any) -> bool:
    """Whether ``wrapper`` skipped this iteration's step (one host read; False for other wrappers)."""
    return isinstance(wrapper, FusedClipAmpOptimWrapper) and wrapper.applied_steps.skipped()
