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
    CONSECUTIVE_SKIPS,
    COUNTER_NAMES,
    HYSTERESIS_LEFT,
    LAST_SKIPPED,
    NORM_AVERAGE,
    NORM_COUNT,
    SKIPPED_STEPS,
    UPDATES,
    LossScalePolicy,
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_growth_tracker,
    check_scale_value,
)

#: torch.amp.GradScaler's state_dict keys; ours adds the policy knobs and counters.
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: Positional torch knobs: passed to the constructor, not inside ``policy``.
TORCH_KNOBS = ("growth_factor", "backoff_factor", "growth_interval")


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> dict[str, Any]:
    # found_inf_per_device: overflow flags (drive the policy); skip: the step's skip flag on the
    # scale's device (overflow, unless the policy lets it through, or a norm spike); norm: the
    # clip norm when clip_grad_norm_ ran.
    # grad_scale: what clip_grad_norm_ folded into a fused optimizer's step.
    return {"stage": OptState.READY, "found_inf_per_device": {}, "skip": None, "norm": None, "grad_scale": None}


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
        policy: LossScalePolicy | None = None,
        fold_into_optimizer: bool = True,
        compile_policy: bool | None = None,
        **knobs: Any,
    ) -> None:
        self._device = device
        self._enabled = enabled
        self._backend_name = check_backend_name(backend)
        self._fold = bool(fold_into_optimizer)
        # The rule is ~10-40 tiny torch ops (more with hysteresis or norm skips); torch.compile
        # fuses them into one kernel on a GPU.
        self._compile_policy = compile_policy
        self._compiled: dict[str, Any] = {}
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("tritonscale.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            self._enabled = False
        self._policy = _build_policy(policy, knobs, growth_factor, backoff_factor, growth_interval)
        if self._enabled:
            self._init_scale = check_scale_value("init_scale", init_scale)
            self._policy.validate()
        else:  # like torch, a disabled scaler keeps its arguments unchecked
            self._init_scale = init_scale
        self._init_growth_tracker = 0
        self._init_counters = [self._policy.hysteresis, 0, 0, 0, 0]
        self._init_norm_stats = [0.0, 0.0]
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        self._norm_stats: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)
        self._last_found_inf: torch.Tensor | None = None
        self._last_norm: torch.Tensor | None = None

    # ------------------------------------------------------------------ scale
    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        # All policy state lives on the device at fixed addresses (updated in place only).
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._counters = torch.tensor(self._init_counters, dtype=torch.int32, device=device)
        self._norm_stats = torch.tensor(self._init_norm_stats, dtype=torch.float32, device=device)

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
        self, groups: DeviceGroups, scale: torch.Tensor | None, norm_type: float, max_norm: float, apply: bool
    ) -> tuple[torch.device, CheckResult]:
        """Check pass -> finalize (-> apply pass) on the one device holding ``groups``."""
        if len(groups) > 1:
            devices = ", ".join(map(str, groups))
            raise NotImplementedError(f"clip_grad_norm_() over gradients on several devices ({devices})")
        device = next(iter(groups), scale.device if scale is not None else torch.device("cpu"))
        if scale is None:  # nothing to unscale: clip only
            scale = torch.ones((), dtype=torch.float32, device=device)
        backend = resolve_backend(self._backend_name, device)
        result = backend.check(groups.get(device, []), scale.to(device, non_blocking=True), norm_type, max_norm)
        if apply:
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
            # Scaling is off (a bf16 run): plain clipping, float16 gradients included, but the
            # inf/NaN check still runs and the following step() skips on it.
            _, result = self._clip(collect_grads(optimizer, allow_fp16=True), None, norm_type, max_norm, True)
            self._per_optimizer_states[id(optimizer)]["skip"] = result.found_inf
            return result.norm
        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._stage_for_unscale(optimizer, "clip_grad_norm_")
        already_unscaled = state["stage"] is OptState.UNSCALED
        # A fused optimizer divides by grad_scale itself: hand it scale / clip_coef and leave the
        # gradients unwritten (read once here, once by the optimizer). We then never store unscaled
        # values in the gradients' own dtype, so float16 gradients are fine on that path.
        fold = self._fold and getattr(optimizer, "_step_supports_amp_scaling", False)
        groups = collect_grads(optimizer, allow_fp16=fold)
        pass_scale = torch.ones_like(scale) if already_unscaled else scale
        device, result = self._clip(groups, pass_scale, norm_type, max_norm, apply=not fold)
        if fold:
            state["grad_scale"] = pass_scale / result.clip_coef.to(scale.device, non_blocking=True)
        if already_unscaled:
            found = state["found_inf_per_device"]
            found[device] = torch.maximum(found[device], result.found_inf) if device in found else result.found_inf
        else:
            state["found_inf_per_device"] = {device: result.found_inf}
        state["norm"] = result.norm
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
            return self._step_unscaled(optimizer, *args, **kwargs)
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
            elif state.get("grad_scale") is not None:  # clip_grad_norm_ folded its factor in here
                grad_scale = state["grad_scale"]
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            skip = self._skip_flag(state, scale.device)
            optimizer.grad_scale = grad_scale
            optimizer.found_inf = skip
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
        if not self._skip_flag(state, scale.device).item():  # the one host read
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _step_unscaled(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """step() of a disabled scaler: torch's plain step, unless clip_grad_norm_ found inf/NaN."""
        state = self._per_optimizer_states.get(id(optimizer))
        if state is None or state["skip"] is None:
            return optimizer.step(*args, **kwargs)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = state["skip"]  # skip on the device; grad_scale stays unset
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                del optimizer.found_inf
        if state["skip"].item():  # the one host read, as in the enabled path
            return None
        return optimizer.step(*args, **kwargs)

    def _skip_flag(self, state: dict[str, Any], device: torch.device) -> torch.Tensor:
        """Decide on the device whether this optimizer's step is skipped; remember it for update()."""
        found_inf = _combine([t.to(device, non_blocking=True) for t in state["found_inf_per_device"].values()])
        if found_inf is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        norm = state["norm"].to(device, non_blocking=True) if state["norm"] is not None else None
        state["skip"] = self._rule("skip_decision")(found_inf.reshape(()), norm, self._norm_stats)
        return state["skip"]

    # ---------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any optimizer step this iteration saw inf/NaN, else maybe grow it.

        ``new_scale`` sets the scale instead. Runs on the device; no host sync.

        Example::

            scaler.step(optimizer)
            scaler.update()
        """
        if not self._enabled:
            self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
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
            states = self._per_optimizer_states.values()
            found_inf = _combine(
                [t.to(scale.device, non_blocking=True) for st in states for t in st["found_inf_per_device"].values()]
            )
            if found_inf is None:
                raise AssertionError("No inf checks were recorded prior to update.")
            skips = [st["skip"] for st in states if st["skip"] is not None]
            # An iteration whose optimizers did not step (unscale_ only) skipped what overflowed.
            skipped = _combine(skips) if skips else self._rule("skip_decision")(found_inf, None, self._norm_stats)
            norms = [st["norm"] for st in states if st["norm"] is not None]
            norm = norms[-1].to(scale.device, non_blocking=True) if norms else None
            self._policy_update_(found_inf, skipped, norm)
            self._last_found_inf, self._last_norm = found_inf, norm
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _policy_update_(self, found_inf: torch.Tensor, skipped: torch.Tensor, norm: torch.Tensor | None) -> None:
        policy, scale, counters = self._policy, self._scale, self._counters
        if policy.needs_host_check():
            # Opt-in checks that must stop or warn: one host read, before anything changes.
            flags = int(policy.host_check_flags(scale, counters, found_inf, skipped).item())
            step = int(counters[UPDATES].item())
            if flags & 2:
                in_a_row = int(counters[CONSECUTIVE_SKIPS].item()) + 1
                raise RuntimeError(
                    f"{in_a_row} consecutive steps were skipped, more than "
                    f"max_consecutive_skips={policy.max_consecutive_skips}; loss scale {scale.item():g} at step {step}"
                )
            if flags & 1:
                message = (
                    f"overflow at step {step} with the loss scale already at min_scale={policy.min_scale:g} "
                    f"(scale {scale.item():g}): it cannot back off further"
                )
                if policy.on_min_scale == "raise":
                    raise RuntimeError(message)
                warnings.warn(message + "; holding it there and skipping the step", RuntimeWarning, stacklevel=3)
        self._rule("update_")(scale, self._growth_tracker, counters, self._norm_stats, found_inf, skipped, norm)

    def _rule(self, name: str) -> Any:
        """The policy method ``name``, compiled by torch.compile where that is on (default: on
        CUDA devices, where the rule's ~10-40 small ops would otherwise each cost a launch)."""
        method = getattr(self._policy, name)
        use = self._compile_policy if self._compile_policy is not None else self._scale.device.type == "cuda"
        if not use:
            return method
        key = (name, id(self._policy))
        if key not in self._compiled:
            self._compiled = {k: v for k, v in self._compiled.items() if k[1] == id(self._policy)}
            self._compiled[key] = torch.compile(method, fullgraph=True, dynamic=False)
        return self._compiled[key]

    # ------------------------------------------------------------ diagnostics
    def stats(self) -> dict[str, torch.Tensor]:
        """This scaler's per-step statistics as 0-dim device tensors -- no host sync.

        ``scale``, ``growth_tracker``, ``norm`` (the last clip_grad_norm_'s, NaN if none),
        ``found_inf`` (last update's overflow flag), ``skipped`` (last step skipped, 0/1),
        ``skipped_steps`` (total), ``consecutive_skips`` and ``hysteresis_left``.

        Example::

            stats = scaler.stats()
            writer.add_scalar("loss_scale", stats["scale"], step)  # the logger syncs, not the step
        """
        scale, tracker = self._check_scale_growth_tracker("stats")
        nan = torch.full((), float("nan"), device=scale.device)
        return {
            "scale": scale,
            "growth_tracker": tracker,
            "norm": self._last_norm if self._last_norm is not None else nan,
            "found_inf": self._last_found_inf if self._last_found_inf is not None else torch.zeros_like(scale),
            "skipped": self._counters[LAST_SKIPPED],
            "skipped_steps": self._counters[SKIPPED_STEPS],
            "consecutive_skips": self._counters[CONSECUTIVE_SKIPS],
            "hysteresis_left": self._counters[HYSTERESIS_LEFT],
        }

    def last_step_skipped(self) -> bool:
        """Whether the last completed iteration skipped its step (a host read).

        For LR schedulers: ``if not scaler.last_step_skipped(): scheduler.step()``. The device
        flag, for loops that must not sync, is ``scaler.stats()["skipped"]``.
        """
        if not self._enabled or self._counters is None:
            return False
        return bool(self._counters[LAST_SKIPPED].item())

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

    def _host_counters(self) -> list[int]:
        return self._init_counters if self._counters is None else [int(v) for v in self._counters.tolist()]

    def _host_norm_stats(self) -> list[float]:
        return self._init_norm_stats if self._norm_stats is None else [float(v) for v in self._norm_stats.tolist()]

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's five entries, plus this scaler's policy knobs and counters.

        torch.amp.GradScaler.load_state_dict reads its five keys and ignores the rest, so the
        checkpoint loads there too. Empty when disabled. Reads device values (a host sync).
        """
        if not self._enabled:
            return {}
        knobs = {k: v for k, v in self._policy.knobs().items() if k not in TORCH_KNOBS}
        norm_stats = self._host_norm_stats()
        return {
            "scale": self.get_scale(),
            "growth_factor": self._policy.growth_factor,
            "backoff_factor": self._policy.backoff_factor,
            "growth_interval": self._policy.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "policy": knobs,
            "counters": dict(zip(COUNTER_NAMES, self._host_counters())),
            "norm_stats": {"average": norm_stats[NORM_AVERAGE], "count": norm_stats[NORM_COUNT]},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from this class or from torch.amp.GradScaler; validated before any change.

        Knobs and counters a torch checkpoint lacks keep this scaler's configured values.
        """
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
        knobs = dict(state_dict.get("policy", {}) or {})
        unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()))
        if unknown:
            raise ScalerConfigError(f"state_dict['policy'] has unknown knobs {unknown}")
        policy = LossScalePolicy(
            **{
                **self._policy.knobs(),
                **knobs,
                "growth_factor": _as_number(state_dict["growth_factor"], "growth_factor"),
                "backoff_factor": _as_number(state_dict["backoff_factor"], "backoff_factor"),
                "growth_interval": _as_int(state_dict["growth_interval"], "growth_interval"),
            }
        ).validate()
        tracker = check_growth_tracker(_as_int(state_dict["_growth_tracker"], "_growth_tracker"))
        saved_counters = state_dict.get("counters", {}) or {}
        counters = [policy.hysteresis, 0, 0, 0, 0]
        for i, name in enumerate(COUNTER_NAMES):
            if name in saved_counters:
                counters[i] = check_growth_tracker(_as_int(saved_counters[name], f"counters.{name}"))
        saved_norm = state_dict.get("norm_stats", {}) or {}
        norm_stats = [
            _as_number(saved_norm.get("average", 0.0), "norm_stats.average"),
            _as_number(saved_norm.get("count", 0.0), "norm_stats.count"),
        ]
        # Everything is valid: only now change state.
        self._policy = policy
        self._init_scale = new_scale
        self._init_growth_tracker = tracker
        self._init_counters = counters
        self._init_norm_stats = norm_stats
        if self._scale is not None:
            self._scale.fill_(new_scale)
            self._growth_tracker.fill_(tracker)
            self._counters.copy_(torch.tensor(counters, dtype=torch.int32))
            self._norm_stats.copy_(torch.tensor(norm_stats, dtype=torch.float32))

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
            state["_init_counters"] = self._host_counters()
            state["_init_norm_stats"] = self._host_norm_stats()
            for name in ("_scale", "_growth_tracker", "_counters", "_norm_stats"):
                state[name] = None
        state["_compiled"] = {}  # compiled rules are rebuilt on first use
        state["_per_optimizer_states"] = dict(state["_per_optimizer_states"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_per_optimizer_states"] = defaultdict(_fresh_optimizer_state, state["_per_optimizer_states"])
        self.__dict__.update(state)


def _combine(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """Sum of 0-dim flags on one device (the way torch combines found_inf), None for none."""
    if not flags:
        return None
    return flags[0].reshape(()) if len(flags) == 1 else torch.stack([f.reshape(()) for f in flags]).sum()


def _build_policy(
    policy: LossScalePolicy | None,
    knobs: dict[str, Any],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> LossScalePolicy:
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()) | (set(knobs) & set(TORCH_KNOBS)))
    if unknown:
        raise TypeError(f"GradScaler got unexpected keyword arguments {unknown}")
    torch_knobs = {"growth_factor": growth_factor, "backoff_factor": backoff_factor, "growth_interval": growth_interval}
    if policy is None:
        return LossScalePolicy(**torch_knobs, **knobs)
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(f"policy must be a tritonscale.LossScalePolicy, got {type(policy).__name__}")
    defaults = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
    if torch_knobs != defaults:
        raise ScalerConfigError("with policy=..., set growth_factor/backoff_factor/growth_interval inside the policy")
    return LossScalePolicy(**{**policy.knobs(), **knobs})


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
