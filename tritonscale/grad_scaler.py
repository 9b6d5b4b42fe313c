"""GradScaler: a drop-in for torch.amp.GradScaler whose passes are the fused Triton kernels.

Per iteration and optimizer the stages are READY -> UNSCALED (unscale_ or clip_grad_norm_) ->
STEPPED, and update() starts the next iteration, as in torch. The scale, the growth tracker and
every found_inf stay on the device; only get_scale()/state_dict() (explicitly) and step() for an
optimizer that cannot take found_inf read a device value on the host.
"""

from __future__ import annotations

import math
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch

from .backends import CheckResult, check_backend_name, resolve_backend
from .errors import ScalerConfigError
from .grad_groups import DeviceGroups, collect_grads
from .policy import (
    DynamicScalePolicy,
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_growth_tracker,
    check_scale_value,
)

STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _PerDevice:
    """Copies of one device tensor, made on demand (non-blocking) for each device that asks."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return self._copies[device]


class GradScaler:
    """Dynamic loss scaling with a fused unscale / inf-check / clip pass and no host sync.

    Same constructor, methods and state_dict as ``torch.amp.GradScaler``; adds
    :meth:`clip_grad_norm_` and the keyword-only ``backend`` ("auto", "triton" or "torch").

    Example::

        scaler = tritonscale.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).square().mean()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # fused unscale + inf-check + clip
        scaler.step(optimizer)                                   # skipped on inf/NaN
        scaler.update()
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        backend: str = "auto",
    ) -> None:
        self._device = device
        self._enabled = enabled
        self._backend_name = check_backend_name(backend)
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("tritonscale.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        if self._enabled:
            self._init_scale = check_scale_value("init_scale", init_scale)
            self._policy = DynamicScalePolicy.checked(growth_factor, backoff_factor, growth_interval)
        else:  # like torch, a disabled scaler keeps its arguments unchecked
            self._init_scale = init_scale
            self._policy = DynamicScalePolicy(growth_factor, backoff_factor, growth_interval)
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # ------------------------------------------------------------------ scale
    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or each tensor of a (nested) list/tuple/iterable, by the scale.

        Example::

            scaler.scale(loss).backward()
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        replicas: list[_PerDevice] = []

        def apply_scale(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not replicas:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(value.device)
                    replicas.append(_PerDevice(self._scale))
                return value * replicas[0].get(value.device)
            if isinstance(value, abc.Iterable):
                scaled = map(apply_scale, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ------------------------------------------------------- gradient passes
    def _stage_for_unscale(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict[str, Any]:
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(f"{funcname}() is being called after step().")
        return state

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record inf/NaN on the device.

        One fused read+check+write pass per (device, dtype) group; no host sync.

        Example::

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)      # gradients now hold their true values
            scaler.step(optimizer)
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._stage_for_unscale(optimizer, "unscale_")
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        groups = collect_grads(optimizer, allow_fp16=False)
        found_infs = self._zero_found_infs(groups, scale.device)
        per_device_scale = _PerDevice(scale)
        for device, device_groups in groups.items():
            backend = resolve_backend(self._backend_name, device)
            backend.unscale_(device_groups, per_device_scale.get(device), found_infs[device])
        state["found_inf_per_device"] = found_infs
        state["stage"] = OptState.UNSCALED

    @staticmethod
    def _zero_found_infs(groups: DeviceGroups, scale_device: torch.device) -> dict[torch.device, torch.Tensor]:
        devices = list(groups) or [scale_device]  # no gradients at all: a clean record, not an error
        return {d: torch.zeros((), dtype=torch.float32, device=d) for d in devices}

    def _clip(
        self, groups: DeviceGroups, scale: torch.Tensor | None, norm_type: float, max_norm: float
    ) -> tuple[torch.device, CheckResult]:
        """Check pass -> finalize -> apply pass on the one device holding ``groups``."""
        if len(groups) > 1:
            devices = ", ".join(map(str, groups))
            raise NotImplementedError(f"clip_grad_norm_() over gradients on several devices ({devices})")
        device = next(iter(groups), scale.device if scale is not None else torch.device("cpu"))
        if scale is None:  # nothing to unscale: clip only
            scale = torch.ones((), dtype=torch.float32, device=device)
        backend = resolve_backend(self._backend_name, device)
        result = backend.check(groups.get(device, []), scale.to(device, non_blocking=True), norm_type, max_norm)
        backend.apply_(result)
        return device, result

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale, inf-check and clip the optimizer's gradients by their global norm, fused.

        Returns the total norm of the unscaled gradients before clipping (0-dim float32 tensor on
        the gradients' device), equal to ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_``.
        It counts as this optimizer's ``unscale_`` for the iteration; called after ``unscale_`` it
        only clips. The gradients are read once, then read and written once; no host sync.

        Example::

            scaler.scale(loss).backward()
            grad_norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0, norm_type=2.0)
            scaler.step(optimizer)
            scaler.update()
        """
        max_norm = _check_max_norm(max_norm)
        norm_type = _check_norm_type(norm_type)
        if not self._enabled:
            # Nothing is unscaled, so float16 gradients are fine: this is plain clipping.
            _, result = self._clip(collect_grads(optimizer, allow_fp16=True), None, norm_type, max_norm)
            return result.norm
        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._stage_for_unscale(optimizer, "clip_grad_norm_")
        already_unscaled = state["stage"] is OptState.UNSCALED
        groups = collect_grads(optimizer, allow_fp16=False)
        device, result = self._clip(groups, None if already_unscaled else scale, norm_type, max_norm)
        if already_unscaled:
            found = state["found_inf_per_device"]
            found[device] = torch.maximum(found[device], result.found_inf) if device in found else result.found_inf
        else:
            state["found_inf_per_device"] = {device: result.found_inf}
        state["stage"] = OptState.UNSCALED
        return result.norm

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless already done this iteration) and step, skipping the step on inf/NaN.

        Optimizers that accept ``grad_scale``/``found_inf`` (torch's fused Adam, AdamW, SGD) get
        them as device tensors and skip on the device: no host sync. Others cost one host read of
        found_inf, as in torch. Closures are refused, as in torch.

        Example::

            scaler.step(optimizer)
            scaler.update()
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if state["stage"] is OptState.READY:
                # The optimizer divides by grad_scale itself: only the read-only check pass runs.
                groups = collect_grads(optimizer, allow_fp16=True)
                found_infs = self._zero_found_infs(groups, scale.device)
                for device, device_groups in groups.items():  # no cross-device reduction needed
                    backend = resolve_backend(self._backend_name, device)
                    result = backend.check(device_groups, scale.to(device, non_blocking=True), 2.0, None)
                    found_infs[device] = result.found_inf
                state["found_inf_per_device"] = found_infs
                grad_scale = scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            found_inf = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            state["stage"] = OptState.STEPPED
            return retval

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        retval = None
        if not sum(v.item() for v in state["found_inf_per_device"].values()):  # the one host read
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    # ---------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any optimizer step this iteration saw inf/NaN, else maybe grow it.

        ``new_scale`` sets the scale instead. Runs on the device; no host sync.

        Example::

            scaler.step(optimizer)
            scaler.update()
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
                scale.fill_(check_scale_value("new_scale", new_scale))
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if not isinstance(new_scale, torch.Tensor):
                    raise AssertionError(reason)
                if new_scale.device.type != scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                scale.copy_(new_scale.reshape(()))
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf_combined = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
            self._policy.update_(scale, growth_tracker, found_inf_combined)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    # -------------------------------------------------------- knobs and state
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._policy.growth_factor = check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._policy.backoff_factor = check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._policy.growth_interval = check_growth_interval(new_interval)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def backend(self) -> str:
        """The requested backend: "auto", "triton" or "torch"."""
        return self._backend_name

    def state_dict(self) -> dict[str, Any]:
        """The same five entries as torch.amp.GradScaler.state_dict (empty when disabled)."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._policy.growth_factor,
            "backoff_factor": self._policy.backoff_factor,
            "growth_interval": self._policy.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from this class or from torch.amp.GradScaler; validated before any change."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise ScalerConfigError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        missing = [k for k in STATE_KEYS if k not in state_dict]
        if missing:
            raise ScalerConfigError(f"state_dict is missing {missing}; expected keys {list(STATE_KEYS)}")
        new_scale = check_scale_value("scale", _as_number(state_dict["scale"], "scale"))
        policy = DynamicScalePolicy.checked(
            _as_number(state_dict["growth_factor"], "growth_factor"),
            _as_number(state_dict["backoff_factor"], "backoff_factor"),
            _as_int(state_dict["growth_interval"], "growth_interval"),
        )
        tracker = check_growth_tracker(_as_int(state_dict["_growth_tracker"], "_growth_tracker"))
        self._policy = policy
        self._init_scale = new_scale
        self._init_growth_tracker = tracker
        if self._scale is not None:
            self._scale.fill_(new_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        state["_per_optimizer_states"] = dict(state["_per_optimizer_states"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_per_optimizer_states"] = defaultdict(_fresh_optimizer_state, state["_per_optimizer_states"])
        self.__dict__.update(state)


def _as_number(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScalerConfigError(f"state_dict[{name!r}] must be a number, got {value!r}")
    return float(value)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScalerConfigError(f"state_dict[{name!r}] must be an int, got {value!r}")
    return value


def _check_max_norm(max_norm: float) -> float:
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not max_norm > 0
        or not math.isfinite(max_norm)
    ):
        raise ValueError(f"max_norm must be a positive finite float, got {max_norm!r}")
    return float(max_norm)


def _check_norm_type(norm_type: float) -> float:
    if norm_type not in (1, 2, 1.0, 2.0, math.inf):
        raise ValueError(f"norm_type must be 1.0, 2.0 or inf, got {norm_type!r}")
    return float(norm_type)
