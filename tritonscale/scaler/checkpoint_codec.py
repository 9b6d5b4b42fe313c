"""The checkpoint format: ``state_dict()`` to and from the policy and the scale's host state.

``state_dict()`` is torch.amp.GradScaler's five keys plus this library's policy knobs, counters
and norm statistics; torch's scaler loads it (it reads its five keys), and ours loads torch's.
Free functions over values (no scaler in them): ``GradScaler.state_dict``/``load_state_dict``,
its ``snapshot()`` and the checkpoint importers call them.
"""

from __future__ import annotations

import math
import warnings
from collections import abc
from typing import Any, NamedTuple

import torch

from ..errors import ScalerConfigError
from ..policy.counters import (
    CONSECUTIVE_SKIPS,
    COUNTER_NAMES,
    HYSTERESIS_LEFT,
    LAST_SKIPPED,
    NORM_AVERAGE,
    NORM_COUNT,
    SKIPPED_STEPS,
)
from ..policy.knob_validation import INT32_LIMIT, check_counter, check_scale_value, is_int, is_number
from ..policy.loss_scale_policy import LossScalePolicy, as_float32
from ..policy.spike_rules import HEADER, SPIKE_STAT_NAMES
from ..policy.state import HostState
from .scaler_args import TORCH_KNOBS

#: torch.amp.GradScaler's state_dict keys; ours adds "policy", "counters", "norm_stats" and, with a
#: spike rule on (policy/spike_rules.py), "spike_stats".
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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


def check_picklable(process_group: Any, mid_iteration: bool) -> None:
    """A scaler may be pickled without a process group (groups do not travel) and, like torch's,
    only between iterations (``mid_iteration``: an enabled scaler with records). torch's message."""
    if process_group is not None:
        raise TypeError(
            "a GradScaler with a process_group cannot be pickled (process groups do not travel); "
            "save state_dict() and load it into a scaler made with the group"
        )
    if mid_iteration:
        raise AssertionError(
            "A GradScaler instance may only be pickled at the beginning "
            "of an iteration, or at the end after scaler.update()."
        )


def to_state_dict(policy: LossScalePolicy, host: HostState) -> dict[str, Any]:
    """torch's five entries, then the other policy knobs, the counters and the norm statistics
    (and the spike rules' state, where a spike rule is on)."""
    spike = {"spike_stats": _spike_stats_to(host.spike_stats)} if host.spike_stats else {}
    return {
        "scale": host.scale,
        "growth_factor": policy.growth_factor,
        "backoff_factor": policy.backoff_factor,
        "growth_interval": policy.growth_interval,
        "_growth_tracker": host.growth_tracker,
        "policy": {k: v for k, v in policy.knobs().items() if k not in TORCH_KNOBS},
        "counters": dict(zip(COUNTER_NAMES, host.counters)),
        "norm_stats": {"average": host.norm_stats[NORM_AVERAGE], "count": host.norm_stats[NORM_COUNT]},
        **spike,
    }


def from_state_dict(state_dict: Any, current: LossScalePolicy) -> tuple[LossScalePolicy, HostState]:
    """Validate a state_dict of this class or of torch.amp.GradScaler; change nothing.

    Every value is checked before anything is built from it: its type, the range of the device
    dtype that will hold it (float32 scale, int32 counters), and the invariants the policy's rule
    keeps (a hysteresis budget within [0, hysteresis], a 0/1 skip flag, a scale within
    [min_scale, max_scale], ...). Knobs and counters a torch checkpoint lacks keep ``current``'s
    configured values. Example: ``policy, host = from_state_dict(torch_scaler.state_dict(), policy)``.
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
    policy = _policy_from(state_dict, current)
    _warn_torch_knobs_over_a_peer_rule(state_dict, current, policy)
    scale = _as_number(state_dict["scale"], "scale")
    if scale == 0:  # torch's backoff can leave 0 (ours stops at the policy's floor): loads as ours would be
        scale = policy.backoff_floor()
    policy.check_scale_in_bounds("state_dict['scale']", check_scale_value("scale", scale))
    host = HostState.initial(scale, policy)
    # Good steps since the last growth. Any count that fits the int32 tracker loads, as in torch,
    # also one at or past growth_interval (our own state_dict after set_growth_interval lowered it):
    # torch's rule grows when the count *equals* the interval, so such a tracker counts on without
    # growing, and ours continues the same way (the rule is torch's own op).
    # A growth delay (DeepSpeed's) starts the count after an overflow at -growth_delay.
    host.growth_tracker = check_counter(
        "state_dict['_growth_tracker']",
        _as_int(state_dict["_growth_tracker"], "_growth_tracker"),
        minimum=-policy.growth_delay,
    )
    host.counters = _counters_from(state_dict, policy, host.counters)
    host.norm_stats = _norm_stats_from(state_dict)
    host.spike_stats = _spike_stats_from(state_dict, host.spike_stats)
    return policy, host


def _policy_from(state_dict: abc.Mapping, current: LossScalePolicy) -> LossScalePolicy:
    """The saved knobs (torch's three at the top, ours under ``policy``) over ``current``'s, validated."""
    knobs = _section(state_dict, "policy")
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()))
    if unknown:
        raise ScalerConfigError(f"state_dict['policy'] has unknown knobs {unknown}")
    try:
        return LossScalePolicy(
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


def _warn_torch_knobs_over_a_peer_rule(state_dict: abc.Mapping, current: LossScalePolicy, loaded: LossScalePolicy) -> None:
    """torch's checkpoint (no ``policy`` entry) loaded over a rule that is not torch's (a preset, a
    knob of ours): torch's three knobs replace the configured ones, as torch's own load does, and the
    rule's other knobs stay: say so, naming both, where a configured knob changes."""
    torch_rule = LossScalePolicy()
    others = [name for name in LossScalePolicy.knob_names() if name not in TORCH_KNOBS]
    if "policy" in state_dict or all(getattr(current, name) == getattr(torch_rule, name) for name in others):
        return
    replaced = [
        f"{name}={getattr(loaded, name)!r} (was {getattr(current, name)!r})"
        for name in TORCH_KNOBS
        if getattr(loaded, name) != getattr(current, name)
    ]
    if replaced:
        warnings.warn(
            "load_state_dict: a torch.amp.GradScaler checkpoint (no 'policy' entry) sets "
            f"{', '.join(replaced)} over this scaler's configured rule, as torch's own load does; the rule's "
            "other knobs (hysteresis, floors, skip rules) are kept. To keep the configured "
            "growth_interval/growth_factor/backoff_factor, set them again after loading.",
            stacklevel=5,  # the caller of GradScaler.load_state_dict (through its compile boundary)
        )


def _counters_from(state_dict: abc.Mapping, policy: LossScalePolicy, counters: list[int]) -> list[int]:
    """The saved counters over ``counters`` (a fresh state's), each within what the rule keeps."""
    counters = list(counters)
    saved_counters = _section(state_dict, "counters")
    unknown = sorted(set(saved_counters) - set(COUNTER_NAMES))
    if unknown:
        raise ScalerConfigError(f"state_dict['counters'] has unknown entries {unknown}; expected {list(COUNTER_NAMES)}")
    limits = {HYSTERESIS_LEFT: policy.hysteresis + 1, LAST_SKIPPED: 2}  # the rest: the int32 range
    for i, name in enumerate(COUNTER_NAMES):
        if name in saved_counters:
            value = _as_int(saved_counters[name], f"counters.{name}")
            counters[i] = check_counter(f"state_dict['counters'][{name!r}]", value, limits.get(i, INT32_LIMIT))
    if counters[CONSECUTIVE_SKIPS] > counters[SKIPPED_STEPS] and "skipped_steps" in saved_counters:
        raise ScalerConfigError(
            f"state_dict['counters']: consecutive_skips={counters[CONSECUTIVE_SKIPS]} is more than "
            f"skipped_steps={counters[SKIPPED_STEPS]}"
        )
    return counters


def _norm_stats_from(state_dict: abc.Mapping) -> list[float]:
    """The saved norm statistics ([average, count]; zeros when absent), finite and >= 0 in float32."""
    saved_norm = _section(state_dict, "norm_stats")
    norm_stats = [
        _as_number(saved_norm.get("average", 0.0), "norm_stats.average"),
        _as_number(saved_norm.get("count", 0.0), "norm_stats.count"),
    ]
    for name, value in zip(("average", "count"), norm_stats):
        if not (math.isfinite(value) and value >= 0 and math.isfinite(as_float32(value))):
            raise ScalerConfigError(f"state_dict['norm_stats'][{name!r}] must be a finite number >= 0, got {value!r}")
    return norm_stats


def _spike_stats_to(spike_stats: list[float]) -> dict[str, Any]:
    """The spike rules' slots by name (spike_rules.py), the window and warm-up norms as lists."""
    named = dict(zip(SPIKE_STAT_NAMES, spike_stats))
    return {**named, "norms": list(spike_stats[HEADER:])}


def _spike_stats_from(state_dict: abc.Mapping, fresh: list[float]) -> list[float]:
    """The saved spike state, or ``fresh`` (the loaded policy's zeros) where it is absent (an older
    checkpoint, torch's): its length the loaded policy's, every value a finite number >= 0."""
    saved = _section(state_dict, "spike_stats")
    if not saved:
        return list(fresh)
    if not fresh:
        raise ScalerConfigError(
            "state_dict['spike_stats'] is given but its policy has no spike rule (skip_norm_sigma, clip_norm_z)"
        )
    norms = saved.get("norms", [])
    if not isinstance(norms, abc.Sequence) or len(norms) + HEADER != len(fresh):
        raise ScalerConfigError(
            f"state_dict['spike_stats']['norms'] must hold {len(fresh) - HEADER} norms for the policy's "
            f"spike rules (skip_norm_window, clip_norm_warmup_steps), got {norms!r}"
        )
    values = [_as_number(saved.get(name, 0.0), f"spike_stats.{name}") for name in SPIKE_STAT_NAMES]
    values += [_as_number(v, "spike_stats.norms") for v in norms]
    for name, value in zip([*SPIKE_STAT_NAMES] + ["norms"] * len(norms), values):
        if not (math.isfinite(value) and value >= 0):
            raise ScalerConfigError(f"state_dict['spike_stats'][{name!r}] must be a finite number >= 0, got {value!r}")
    return values


def _section(state_dict: abc.Mapping, key: str) -> abc.Mapping:
    """One of our own sections (``policy``, ``counters``, ``norm_stats``, ``spike_stats``): a dict, or
    absent (torch's)."""
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
