"""The scaler's state: where it lives, how it is saved, loaded and pickled.

``ScalerStateIO`` (mixed into GradScaler) saves, loads and pickles them, and rolls an iteration
back to a ``snapshot()``. The loss scale and the
policy's trackers exist in two forms:

* ``HostState``: Python numbers. What a fresh scaler starts from, what ``state_dict()`` and a
  pickle hold, and what ``load_state_dict`` validates before anything changes.
* ``DeviceState``: the same four values as device tensors, made at the first ``scale()`` and from
  then on updated in place at fixed addresses (so a step can be captured in a CUDA graph).

``state_dict()`` is torch.amp.GradScaler's five keys plus this library's policy knobs, counters
and norm statistics; torch's scaler loads it (it reads its five keys), and ours loads torch's.
"""

from __future__ import annotations

import math
import warnings
from collections import abc, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ..errors import ScalerConfigError
from ..grads.optimizer_wrappers import unwrap_optimizer
from ..policy.knob_checks import INT32_LIMIT, check_counter, check_scale_value, is_int, is_number
from ..policy.loss_scale_policy import (
    CONSECUTIVE_SKIPS,
    COUNTER_NAMES,
    HYSTERESIS_LEFT,
    LAST_SKIPPED,
    NORM_AVERAGE,
    NORM_COUNT,
    SKIPPED_STEPS,
    LossScalePolicy,
    as_float32,
)
from .compile_boundary import runs_eagerly
from .optimizer_record import OptimizerRecord

#: torch.amp.GradScaler's default ``init_scale`` (its other defaults are LossScalePolicy's).
TORCH_INIT_SCALE = 2.0**16
#: torch.amp.GradScaler's state_dict keys; ours adds "policy", "counters" and "norm_stats".
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: The knobs torch's constructor and state_dict carry themselves (not inside ``policy``).
TORCH_KNOBS = ("growth_factor", "backoff_factor", "growth_interval")


@dataclass
class HostState:
    """The loss scale and the policy's trackers as Python numbers."""

    scale: float
    growth_tracker: int
    counters: list[int]  # COUNTER_NAMES order
    norm_stats: list[float]  # [average, count]

    @classmethod
    def initial(cls, scale: float, policy: LossScalePolicy) -> HostState:
        """Where a fresh scaler starts: a full hysteresis budget, every other tracker at zero."""
        return cls(scale, 0, [policy.hysteresis] + [0] * (len(COUNTER_NAMES) - 1), [0.0, 0.0])

    def copy(self) -> HostState:
        return HostState(self.scale, self.growth_tracker, list(self.counters), list(self.norm_stats))

    def to_device(self, device: torch.device) -> DeviceState:
        return DeviceState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), self.growth_tracker, dtype=torch.int32, device=device),
            counters=torch.tensor(self.counters, dtype=torch.int32, device=device),
            norm_stats=torch.tensor(self.norm_stats, dtype=torch.float32, device=device),
        )


@dataclass
class DeviceState:
    """The loss scale and the trackers on the device; only ever updated in place."""

    scale: torch.Tensor  # float32 0-dim
    growth_tracker: torch.Tensor  # int32 0-dim
    counters: torch.Tensor  # int32 [len(COUNTER_NAMES)]
    norm_stats: torch.Tensor  # float32 [2]

    def to_host(self) -> HostState:
        """Read every value back (a host sync)."""
        return HostState(
            scale=float(self.scale.item()),
            growth_tracker=int(self.growth_tracker.item()),
            counters=[int(v) for v in self.counters.tolist()],
            norm_stats=[float(v) for v in self.norm_stats.tolist()],
        )

    def load_(self, host: HostState) -> None:
        """Overwrite every value in place (the addresses stay)."""
        loaded = host.to_device(self.scale.device)
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(loaded, field.name))


class ScalerSnapshot(NamedTuple):
    """``GradScaler.snapshot()``: what ``abandon_iteration`` puts back."""

    policy: LossScalePolicy | None  # a copy; None for a disabled scaler (nothing to put back)
    host: HostState | None  # the scale and trackers, read to the host
    last_found_inf: torch.Tensor | None  # stats()["found_inf"] and ["norm"]: the last update's
    last_norm: torch.Tensor | None

    @property
    def state(self) -> dict[str, Any]:
        """What ``state_dict()`` returned when the snapshot was taken."""
        return to_state_dict(self.policy, self.host) if self.policy is not None else {}


def cuda_missing(device: str, enabled: bool) -> bool:
    """True, with torch's warning, when an enabled scaler asks for "cuda" and there is none."""
    if device == "cuda" and enabled and not torch.cuda.is_available():
        warnings.warn("tritonscale.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=3)
        return True
    return False


def checked_init_scale(init_scale: float | torch.Tensor, policy: LossScalePolicy) -> float:
    """An enabled scaler's ``init_scale``: a number (or a 1-element tensor, as torch takes), finite
    and nonzero in float32, within the policy's [min_scale, max_scale]; the policy validated too."""
    if isinstance(init_scale, torch.Tensor) and init_scale.numel() == 1:
        init_scale = init_scale.item()
    init_scale = check_scale_value("init_scale", init_scale)
    return policy.validate().check_scale_in_bounds("init_scale", init_scale)


class ScalerStateIO:
    """Mixed into GradScaler: ``state_dict``, ``load_state_dict``, pickling, and the in-memory save
    and restore an adapter rolls an iteration back with (``snapshot``, ``abandon_iteration``).

    It reads and writes only the GradScaler fields declared below (set in ``grad_scaler.py``'s
    ``__init__``) and calls only ``_host_state`` there; ``tests/scaler/test_controller_fields.py``
    holds it to that."""

    _enabled: bool
    _policy: LossScalePolicy
    _host: HostState  # the values before the first scale()
    _tensors: DeviceState | None  # ... and after
    _per_optimizer_states: dict
    _last_found_inf: torch.Tensor | None  # stats()'s found_inf and norm, which a snapshot keeps
    _last_norm: torch.Tensor | None
    _process_group: Any
    _host_state: Callable[[], HostState]  # a method: the values read to the host

    @runs_eagerly
    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's five entries, plus this scaler's policy knobs and counters.

        torch.amp.GradScaler.load_state_dict reads its five keys and ignores the rest, so the
        checkpoint loads there too. Empty when disabled. Reads device values (a host sync).
        """
        if not self._enabled:
            return {}
        return to_state_dict(self._policy, self._host_state())

    @runs_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from this class or from torch.amp.GradScaler; validated before any change.

        Knobs and counters a torch checkpoint lacks keep this scaler's configured values.
        """
        if not self._enabled:
            return
        policy, host = from_state_dict(state_dict, self._policy)
        # Everything is valid: only now change state.
        self._policy, self._host = policy, host
        if self._tensors is not None:
            self._tensors.load_(host)

    def snapshot(self) -> ScalerSnapshot:
        """The scale, its trackers and policy (a host read) and stats()'s last found_inf and norm:
        what ``abandon_iteration(optimizer, snapshot)`` puts back. Example: ``saved = scaler.snapshot()``."""
        policy, host = (LossScalePolicy(**self._policy.knobs()), self._host_state()) if self._enabled else (None, None)
        return ScalerSnapshot(policy, host, self._last_found_inf, self._last_norm)

    def abandon_iteration(
        self, optimizer: torch.optim.Optimizer | None = None, snapshot: ScalerSnapshot | None = None
    ) -> None:
        """Forget what this iteration recorded for ``optimizer`` (every optimizer when None), as if
        it had not begun; with a ``snapshot``, also undo the update()s since it was taken. The
        gradients stay as the passes left them. Example::

            snapshot = scaler.snapshot()  # then an update() (e.g. a backoff) and an error
            scaler.abandon_iteration(optimizer, snapshot)  # the scaler as at the snapshot
        """
        if optimizer is None:
            self._per_optimizer_states = defaultdict(OptimizerRecord)
        else:
            self._per_optimizer_states.pop(id(unwrap_optimizer(optimizer)), None)
        if snapshot is not None:  # in place: the device tensors keep their addresses
            if self._enabled and snapshot.host is not None:
                self._policy, self._host = LossScalePolicy(**snapshot.policy.knobs()), snapshot.host.copy()
                if self._tensors is not None:
                    self._tensors.load_(snapshot.host)
            self._last_found_inf, self._last_norm = snapshot.last_found_inf, snapshot.last_norm

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors do not travel: the values go as Python numbers, made anew at the next scale().
        if self._process_group is not None:
            raise TypeError(
                "a GradScaler with a process_group cannot be pickled (process groups do not travel); "
                "save state_dict() and load it into a scaler made with the group"
            )
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_host"], state["_tensors"] = self._host_state(), None
        return state


def set_scale_(scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
    """``update(new_scale)``: a positive finite float, or a 1-element tensor on the scale's device
    type that does not require grad (torch.amp.GradScaler's contract and messages)."""
    if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
        scale.fill_(check_scale_value("new_scale", new_scale))
        return
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    if not isinstance(new_scale, torch.Tensor):
        raise AssertionError(reason)
    if new_scale.device.type != scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
        raise AssertionError(reason)
    scale.copy_(new_scale.reshape(()))


def policy_from_torch_args(
    policy: LossScalePolicy | None,
    knobs: dict[str, Any],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> LossScalePolicy:
    """The policy of ``GradScaler(..., growth_factor, backoff_factor, growth_interval, policy=, **knobs)``.

    torch's three knobs come positionally or by keyword, the others as keywords or inside
    ``policy``; setting torch's knobs both ways is refused rather than silently merged.
    """
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()) | (set(knobs) & set(TORCH_KNOBS)))
    if unknown:
        raise TypeError(f"GradScaler got unexpected keyword arguments {unknown}")
    torch_knobs = {"growth_factor": growth_factor, "backoff_factor": backoff_factor, "growth_interval": growth_interval}
    if policy is None:
        return LossScalePolicy(**torch_knobs, **knobs)
    if not isinstance(policy, LossScalePolicy):
        raise TypeError(f"policy must be a tritonscale.LossScalePolicy, got {type(policy).__name__}")
    defaults = {name: getattr(LossScalePolicy, name) for name in TORCH_KNOBS}
    if torch_knobs != defaults:
        raise ScalerConfigError("with policy=..., set growth_factor/backoff_factor/growth_interval inside the policy")
    return LossScalePolicy(**{**policy.knobs(), **knobs})


def to_state_dict(policy: LossScalePolicy, host: HostState) -> dict[str, Any]:
    """torch's five entries, then the other policy knobs, the counters and the norm statistics."""
    return {
        "scale": host.scale,
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "growth_interval": policy.growth_interval,
        "_growth_tracker": host.growth_tracker,
        "policy": {k: v for k, v in policy.knobs().items() if k not in TORCH_KNOBS},
        "counters": dict(zip(COUNTER_NAMES, host.counters)),
        "norm_stats": {"average": host.norm_stats[NORM_AVERAGE], "count": host.norm_stats[NORM_COUNT]},
    }


def from_state_dict(state_dict: Any, current: LossScalePolicy) -> tuple[LossScalePolicy, HostState]:
    """Validate a state_dict of this class or of torch.amp.GradScaler; change nothing.

    Every value is checked before anything is built from it: its type, the range of the device
    dtype that will hold it (float32 scale, int32 counters), and the invariants the policy's rule
    keeps (a hysteresis budget within [0, hysteresis], a 0/1 skip flag, a scale within
    [min_scale, max_scale], ...). Knobs and counters a torch checkpoint lacks keep ``current``'s
    configured values.
    """
    if not isinstance(state_dict, abc.Mapping):
        raise ScalerConfigError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    missing = [k for k in STATE_KEYS if k not in state_dict]
    if missing:
        raise ScalerConfigError(f"state_dict is missing {missing}; expected keys {list(STATE_KEYS)}")
    scale = _as_number(state_dict["scale"], "scale")
    knobs = _section(state_dict, "policy")
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()))
    if unknown:
        raise ScalerConfigError(f"state_dict['policy'] has unknown knobs {unknown}")
    try:
        policy = LossScalePolicy(
            **{
                **current.knobs(),
                **knobs,
                "growth_factor": _as_number(state_dict["growth_factor"], "growth_factor"),
                "backoff_factor": _as_number(state_dict["backoff_factor"], "backoff_factor"),
                "growth_interval": _as_int(state_dict["growth_interval"], "growth_interval"),
            }
        ).validate()
    except ScalerConfigError as error:
        raise ScalerConfigError(f"state_dict: {error}") from None
    if scale == 0:  # torch's backoff can leave 0 (ours stops at the policy's floor): loads as ours would be
        scale = policy.backoff_floor()
    policy.check_scale_in_bounds("state_dict['scale']", check_scale_value("scale", scale))
    host = HostState.initial(scale, policy)
    # Good steps since the last growth. Any count that fits the int32 tracker loads, as in torch,
    # also one at or past growth_interval (our own state_dict after set_growth_interval lowered it):
    # torch's rule grows when the count *equals* the interval, so such a tracker counts on without
    # growing, and ours continues the same way (the rule is torch's own op).
    host.growth_tracker = check_counter(
        "state_dict['_growth_tracker']", _as_int(state_dict["_growth_tracker"], "_growth_tracker")
    )
    saved_counters = _section(state_dict, "counters")
    unknown = sorted(set(saved_counters) - set(COUNTER_NAMES))
    if unknown:
        raise ScalerConfigError(f"state_dict['counters'] has unknown entries {unknown}; expected {list(COUNTER_NAMES)}")
    limits = {HYSTERESIS_LEFT: policy.hysteresis + 1, LAST_SKIPPED: 2}  # the rest: the int32 range
    for i, name in enumerate(COUNTER_NAMES):
        if name in saved_counters:
            value = _as_int(saved_counters[name], f"counters.{name}")
            host.counters[i] = check_counter(f"state_dict['counters'][{name!r}]", value, limits.get(i, INT32_LIMIT))
    if host.counters[CONSECUTIVE_SKIPS] > host.counters[SKIPPED_STEPS] and "skipped_steps" in saved_counters:
        raise ScalerConfigError(
            f"state_dict['counters']: consecutive_skips={host.counters[CONSECUTIVE_SKIPS]} is more than "
            f"skipped_steps={host.counters[SKIPPED_STEPS]}"
        )
    saved_norm = _section(state_dict, "norm_stats")
    host.norm_stats = [
        _as_number(saved_norm.get("average", 0.0), "norm_stats.average"),
        _as_number(saved_norm.get("count", 0.0), "norm_stats.count"),
    ]
    for name, value in zip(("average", "count"), host.norm_stats):
        if not (math.isfinite(value) and value >= 0 and math.isfinite(as_float32(value))):
            raise ScalerConfigError(f"state_dict['norm_stats'][{name!r}] must be a finite number >= 0, got {value!r}")
    return policy, host


def _section(state_dict: abc.Mapping, key: str) -> abc.Mapping:
    """One of our own sections (``policy``, ``counters``, ``norm_stats``): a dict, or absent (torch's)."""
    section = state_dict.get(key)
    if section is None:
        return {}
    if not isinstance(section, abc.Mapping):
        raise ScalerConfigError(f"state_dict[{key!r}] must be a dict, got {type(section).__name__}: {section!r}")
    return section


def _as_number(value: Any, name: str) -> float:
    """A saved number as a Python float: torch's state_dict holds numpy knobs as they were given."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not is_number(value):
        raise ScalerConfigError(f"state_dict[{name!r}] must be a number, got {value!r}")
    return float(value)


def _as_int(value: Any, name: str) -> int:
    """A saved count as a Python int (a float with an integer value is one too)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if is_number(value) and not is_int(value) and float(value).is_integer():
        value = int(value)
    if not is_int(value):
        raise ScalerConfigError(f"state_dict[{name!r}] must be an int, got {value!r}")
    return int(value)
