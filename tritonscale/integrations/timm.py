"""timm: ``FusedNativeScaler``, a drop-in for ``timm.utils.NativeScaler`` on ``tritonscale.GradScaler``.

timm's training scripts drive mixed precision through one call,
``loss_scaler(loss, optimizer, clip_grad=..., clip_mode=..., parameters=..., create_graph=...,
need_update=...)``, and checkpoint it through ``state_dict_key``/``state_dict``/``load_state_dict``.
``FusedNativeScaler`` keeps that surface (it is a ``NativeScaler`` subclass; ``state_dict_key`` is
still ``"amp_scaler"``, and the checkpoints load into either class) and changes what runs inside:

* ``clip_mode="norm"``: ``scaler.clip_grad_norm_(optimizer, clip_grad)`` -- unscale, inf/NaN check
  and global-norm clip in one fused pass, instead of timm's ``unscale_`` followed by
  ``torch.nn.utils.clip_grad_norm_``. With a fused optimizer (``AdamW(fused=True)``) the gradients
  are not written at all: ``scale / clip_coef`` is folded into the optimizer's step.
* ``clip_mode="value"`` / ``"agc"``, no clipping, or a ``parameters`` list that is not the
  optimizer's own: timm's own ``NativeScaler.__call__`` runs (``unscale_`` + timm's
  ``dispatch_clip_grad``) on top of the tritonscale scaler, so only the ``unscale_`` is ours.

The call returns ``None``, as timm's does. The norm of the last fused clip is
``loss_scaler.scaler.stats()["norm"]`` (a device tensor: reading it is the only sync).

Schedulers: timm's ``train.py`` counts ``num_updates`` on every optimizer update, skipped ones
included, and drives ``lr_scheduler.step_update(num_updates)`` with it, so after a skipped step
the schedule runs ahead of the updates actually applied. ``loss_scaler.applied_steps.count`` is
the number of applied updates (counted on the device, no read per step; reading it is one host
read): pass it to ``step_update`` and the scheduler advances exactly on applied steps.
``loss_scaler.applied_steps.skipped()`` says whether the last update was skipped. The count
starts at 0 with the scaler (it is not part of the checkpoint).

Example::

    from tritonscale.integrations.timm import FusedNativeScaler

    loss_scaler = FusedNativeScaler(device="cuda")  # instead of timm.utils.NativeScaler(device="cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
        lr_scheduler.step_update(num_updates=loss_scaler.applied_steps.count)  # applied updates only
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from timm.utils.cuda import NativeScaler

from tritonscale.loop.applied_steps import AppliedSteps
from tritonscale.scaler.step_protocols import unwrap_optimizer
from tritonscale.scaler.grad_scaler import GradScaler

__all__ = ["FusedNativeScaler"]


def _counted(tensors: Iterable[torch.Tensor]) -> set[int]:
    # The tensors torch.nn.utils.clip_grad_norm_ would count: those that have, or will get, a grad.
    return {id(p) for p in tensors if p.requires_grad or p.grad is not None}


class FusedNativeScaler(NativeScaler):
    """``timm.utils.NativeScaler`` with the fused ``clip_grad_norm_`` of ``tritonscale.GradScaler``.

    ``device`` as in timm; every other keyword goes to ``tritonscale.GradScaler`` (``init_scale``,
    ``growth_interval``, ``backend``, ``policy``, ``hysteresis``, ...). ``applied_steps`` counts the
    applied updates for timm's ``step_update`` (see the module docstring).

    Example::

        loss_scaler = FusedNativeScaler("cpu", backend="torch")
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())

    Args:
        device: the scaler's device, as in timm ("cuda").
        **scaler_kwargs: ``tritonscale.GradScaler`` keywords.
    """

    state_dict_key = NativeScaler.state_dict_key  # timm's CheckpointSaver files the state under it

    def __init__(self, device: str = "cuda", **scaler_kwargs: Any) -> None:
        # timm's __init__ would only build a torch.amp.GradScaler that we replace: not called.
        self._scaler = GradScaler(device=device, **scaler_kwargs)
        self.applied_steps = AppliedSteps()

    @property
    def scaler(self) -> GradScaler:
        """The ``tritonscale.GradScaler`` inside (``stats()``, ``last_step_skipped()``, ...).

        Returns:
            the ``tritonscale.GradScaler`` this scaler runs on.
        """
        return self._scaler

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.Tensor] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """timm's ``loss_scaler(...)`` call: scaled backward and, where ``need_update``, the clip, the
        step (skipped on inf/NaN) and the scale update; the fused pass for a norm clip of the
        optimizer's own gradients, timm's ``NativeScaler.__call__`` otherwise (see the module docstring).

        Args:
            loss: the loss to scale and backpropagate.
            optimizer: the optimizer to step.
            clip_grad: the clip threshold; None (the default): no clipping.
            clip_mode: timm's clip mode: "norm" (the default, fused), "value" or "agc".
            parameters: the tensors timm clips; None (the default) for the optimizer's.
            create_graph: passed to ``backward()`` (False).
            need_update: whether this call clips, steps and updates (False: an accumulation micro-step).
        """
        if parameters is not None:
            parameters = list(parameters)  # a generator would be spent by the check below
        if (
            not need_update
            or clip_grad is None
            or clip_mode != "norm"
            or not 0 < clip_grad < math.inf
            or not self._clips_optimizer(optimizer, parameters)
        ):
            # Nothing for the fused clip to do (accumulation micro-step, no clipping), a mode it
            # does not cover ("value", "agc", and an unknown mode raises there as in timm), a
            # threshold it refuses (torch zeroes the gradients at 0), or a clip over other tensors
            # than the optimizer's: timm's own sequence, on our scaler.
            super().__call__(loss, optimizer, clip_grad, clip_mode, parameters, create_graph, need_update)
        else:
            self._scaler.scale(loss).backward(create_graph=create_graph)
            # = timm's unscale_(optimizer) + dispatch_clip_grad(parameters, clip_grad, "norm"), one pass.
            self._scaler.clip_grad_norm_(optimizer, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()
        if need_update:
            self.applied_steps.record(self._scaler)  # no host read
        return None

    @staticmethod
    def _clips_optimizer(optimizer: Any, parameters: list[torch.Tensor] | None) -> bool:
        """Whether a clip over the optimizer's gradients is the clip timm would do over ``parameters``.

        timm clips ``parameters`` (train.py passes the model's); the fused clip covers the
        optimizer's gradients. They agree when both name the same tensors, which is the usual
        case (frozen parameters are outside both). ``parameters=None`` means the optimizer's.
        """
        if parameters is None:
            return True
        real = unwrap_optimizer(optimizer)
        return _counted(parameters) == _counted(p for group in real.param_groups for p in group["params"])
