"""Loss-scale policies: the knobs, their validation, and the one on-device update rule.

Every policy other frameworks ship is a setting of these knobs (README, "Policies"):

* dynamic scaling (torch.amp.GradScaler): back off by ``backoff_factor`` on an overflow, grow by
  ``growth_factor`` after ``growth_interval`` consecutive good steps -- the defaults, exactly torch's;
* hysteresis (Megatron-LM's ``hysteresis``, DeepSpeed's ``delayed_shift``): back off only once
  ``hysteresis`` overflows have been seen since the last growth; with ``consecutive_hysteresis``
  (DeepSpeed) every good step restores the budget, with ``hysteresis_refill_on_backoff``
  (TensorFlow's ExponentialUpdateLossScaleManager) every backoff does too;
* ``min_scale`` / ``max_scale`` clamps (Megatron, DeepSpeed, ColossalAI, apex), and what happens
  when an overflow meets a scale already at the floor: ``on_min_scale`` = "clamp", "warn" or
  "raise" (DeepSpeed's ``raise_error_at_min_scale``); ``min_scale=None`` (the default, torch's
  behaviour) allows scales below 1, but a backoff never below 2**-126 (torch's can reach 0);
* ``max_consecutive_skips`` (MindSpore's ``bad_step_max``): raise when more than that many steps in
  a row were skipped;
* ``growth_delay`` (DeepSpeed's ``stable_interval``): the first growth after an overflow, and at the
  start, waits that many more good steps;
* ``overflow_tolerance`` (fairseq's ``fp16_scale_tolerance``): back off only when the share of
  overflowed updates since the scale last changed reaches it; ``raise_at_scale`` (fairseq's
  ``min_loss_scale``): an overflow that leaves the scale at or below it raises FloatingPointError;
* a fixed scale (``dynamic=False``; TensorFlow's and MindSpore's FixedLossScaleManager) that never
  changes, with ``skip_on_overflow`` choosing whether an overflow skips the step (MindSpore's
  ``drop_overflow_update``) or the step goes ahead;
* a gradient-norm spike skip (Megatron-LM's ``grad_norm_skip_threshold``, and a ratio to the
  running average): ``skip_norm_above`` and/or ``skip_norm_factor`` times the running average of past
  norms skip the step on the device like an overflow, without backing the scale off;
* spike rules (``spike_rules.py``): OLMo-core's z-score skip (``skip_norm_sigma`` standard
  deviations above the mean of the last ``skip_norm_window`` norms) and ZClip's adaptive clip
  (``clip_norm_z`` and its ``clip_norm_*`` knobs: the clip's max_norm from an average of the norm).

The rule is written once, as tensor ops over the device-resident state (so nothing branches on a
device value, and the update can be compiled and captured in a CUDA graph); the same tensor ops
run on every device, the CPU included. Its other executor is the one Triton kernel
(``kernels/policy_update.py``, where kernels launch; ``kernel_form.py``), held to these ops by
tests/kernels/test_policy_update.py. Every tensor is updated in place at a fixed address. Only the
opt-in checks that must stop training ("warn"/"raise"
at the floor, ``max_consecutive_skips``, ``raise_at_scale``; ``stop_rules.py``) read a device value
on the host, and only in the updates where they could fire. Each peer's rule as these knobs, by the
peer's own argument names: ``peer_presets.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ScalerConfigError
from .counters import (
    HYSTERESIS_LEFT,
    NORM_AVERAGE,
    NORM_COUNT,
    OVERFLOWS_SINCE_BACKOFF,
    UPDATES_SINCE_RESCALE,
    count_step_,
)
from .rounding import SCALE_FLOOR, as_float32
from .knob_validation import (
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_optional_scale,
    check_positive_int,
    is_count,
    is_finite,
    is_number,
)
from .spike_rules import check_spike_knobs, update_spike_stats_, zscore_spike

ON_MIN_SCALE = ("clamp", "warn", "raise")
#: The rules decided from clip_grad_norm_'s norm, and those of them that keep a history of norms
#: (a running average, a window) in the scaler's state.
NORM_RULE_KNOBS = ("skip_norm_above", "skip_norm_factor", "skip_norm_sigma", "clip_norm_z")
NORM_HISTORY_KNOBS = ("skip_norm_factor", "skip_norm_sigma", "clip_norm_z")
#: Each knob set anywhere (the constructor, a user's ``policy.hysteresis = 3``) takes the next stamp.
_STAMPS = itertools.count()


@dataclass
class LossScalePolicy:
    """The knobs of the loss-scale rule. Defaults are torch.amp.GradScaler's behaviour exactly.

    The knobs are checked by :meth:`validate` (a GradScaler calls it), not by the constructor.

    Args:
        growth_factor: the factor the scale grows by (2.0, torch's).
        backoff_factor: the factor an overflow multiplies the scale by (0.5, torch's).
        growth_interval: the consecutive good steps before the scale grows (2000, torch's).
        dynamic: False for a fixed scale that never changes (True: dynamic scaling).
        skip_on_overflow: whether an overflow skips the optimizer step (True); False lets it go ahead.
        hysteresis: the overflows seen since the last growth before a backoff (1: every overflow).
        consecutive_hysteresis: whether every good step restores the hysteresis budget (DeepSpeed's;
            False: only a growth does).
        hysteresis_refill_on_backoff: whether every backoff restores the budget too (TensorFlow's; False).
        min_scale: the scale's floor (None: no clamp, a backoff never below 2**-126).
        max_scale: the scale's ceiling (None: none).
        on_min_scale: what an overflow at the floor does: "clamp" (the default), "warn" or "raise".
        max_consecutive_skips: raise when more than this many steps in a row were skipped (None: never).
        skip_norm_above: skip the step when the norm is above this (None: off).
        skip_norm_factor: skip the step when the norm is above this times the running average of
            past norms (None: off).
        norm_average_decay: the decay of that running average (0.99).
        norm_warmup_steps: the norms averaged before ``skip_norm_factor`` applies (10).
        growth_delay: the extra good steps the first growth after an overflow, and at the start,
            waits (DeepSpeed's ``stable_interval``; 0: none).
        overflow_tolerance: back off only when the share of overflowed updates since the scale last
            changed reaches this (fairseq's ``fp16_scale_tolerance``; 0.0: every overflow).
        raise_at_scale: an overflow that leaves the scale at or below this raises FloatingPointError
            (fairseq's ``min_loss_scale``; None: never).
        skip_norm_sigma: OLMo-core's z-score skip: skip when the norm is this many standard deviations
            above the mean of the last ``skip_norm_window`` norms (None: off).
        skip_norm_window: the norms that z-score window holds (128).
        skip_norm_min_steps: the constant in the z-score skip's start, ``max(min_steps, window // 2)``
            norms seen (2).
        clip_norm_z: ZClip's adaptive clip: the z-score above which the norm is clipped (None: off).
        clip_norm_alpha: the decay of ZClip's averages of the norm's mean and variance (0.97).
        clip_norm_warmup_steps: the first norms ZClip's averages start from (25).
        clip_norm_mode: ZClip's mode, "zscore" (the default) or "percentile".
        clip_norm_option: what a z-score spike is clipped to: "adaptive_scaling" (the default) or "mean".
        clip_norm_factor: the factor the adaptive clip value is multiplied by (1.0).
        clip_norm_eps: added to the standard deviation in ZClip's z-score (1e-6).
        clip_norm_skip_update_on_spike: whether a clipped spike stays out of ZClip's averages (False).

    Example::

        # Megatron-LM's DynamicGradScaler: floor 1, back off after 2 overflows
        policy = LossScalePolicy(min_scale=1.0, hysteresis=2, growth_interval=1000)
        scaler = tritonscale.GradScaler("cuda", policy=policy)
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    dynamic: bool = True
    skip_on_overflow: bool = True
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    hysteresis_refill_on_backoff: bool = False
    min_scale: float | None = None
    max_scale: float | None = None
    on_min_scale: str = "clamp"
    max_consecutive_skips: int | None = None
    skip_norm_above: float | None = None
    skip_norm_factor: float | None = None
    norm_average_decay: float = 0.99
    norm_warmup_steps: int = 10
    # The peers' own rules.
    growth_delay: int = 0
    overflow_tolerance: float = 0.0
    raise_at_scale: float | None = None
    # Spike rules (spike_rules.py): OLMo-core's z-score skip and ZClip's adaptive clip.
    skip_norm_sigma: float | None = None
    skip_norm_window: int = 128
    skip_norm_min_steps: int = 2
    clip_norm_z: float | None = None
    clip_norm_alpha: float = 0.97
    clip_norm_warmup_steps: int = 25
    clip_norm_mode: str = "zscore"
    clip_norm_option: str = "adaptive_scaling"
    clip_norm_factor: float = 1.0
    clip_norm_eps: float = 1e-6
    clip_norm_skip_update_on_spike: bool = False

    def validate(self, names: Mapping[str, str] | None = None) -> LossScalePolicy:
        """Raise ScalerConfigError naming the first bad knob; return self.

        Args:
            names: the caller's name for a knob it spells otherwise, used in the refusal in place of the
                knob's: a preset passes its peer's argument (``{"growth_interval": "loss_scale_window"}``).

        Returns:
            This policy, its numeric knobs as plain Python numbers.
        """
        names = names or {}

        def name(knob: str) -> dict[str, str]:  # the check's own wording where the caller has no name
            return {"name": names[knob]} if knob in names else {}

        self.growth_factor = check_growth_factor(self.growth_factor, **name("growth_factor"))
        self.backoff_factor = check_backoff_factor(self.backoff_factor, **name("backoff_factor"))
        self.growth_interval = check_growth_interval(self.growth_interval, **name("growth_interval"))
        self.hysteresis = check_positive_int(names.get("hysteresis", "hysteresis"), self.hysteresis)
        self.min_scale = check_optional_scale(names.get("min_scale", "min_scale"), self.min_scale)
        self.max_scale = check_optional_scale(names.get("max_scale", "max_scale"), self.max_scale)
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ScalerConfigError(
                f"{names.get('min_scale', 'min_scale')} {self.min_scale} is above "
                f"{names.get('max_scale', 'max_scale')} {self.max_scale}"
            )
        if self.on_min_scale not in ON_MIN_SCALE:
            raise ScalerConfigError(f"on_min_scale must be one of {ON_MIN_SCALE}, got {self.on_min_scale!r}")
        self.max_consecutive_skips = check_positive_int("max_consecutive_skips", self.max_consecutive_skips, True)
        self.skip_norm_above = check_optional_scale("skip_norm_above", self.skip_norm_above)
        if self.skip_norm_factor is not None and not (is_number(self.skip_norm_factor) and self.skip_norm_factor > 1):
            raise ScalerConfigError(f"skip_norm_factor must be a float > 1 or None, got {self.skip_norm_factor!r}")
        if not (is_number(self.norm_average_decay) and 0 < self.norm_average_decay < 1):
            raise ScalerConfigError(f"norm_average_decay must be in (0, 1), got {self.norm_average_decay!r}")
        self.skip_norm_factor = None if self.skip_norm_factor is None else float(self.skip_norm_factor)
        self.norm_average_decay = float(self.norm_average_decay)
        self.norm_warmup_steps = check_positive_int("norm_warmup_steps", self.norm_warmup_steps)
        self._validate_peer_knobs(names)
        check_spike_knobs(self)
        flags = ("dynamic", "skip_on_overflow", "consecutive_hysteresis", "hysteresis_refill_on_backoff")
        for flag in (*flags, "clip_norm_skip_update_on_spike"):
            if not isinstance(getattr(self, flag), bool):
                raise ScalerConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        return self

    def _validate_peer_knobs(self, names: Mapping[str, str]) -> None:
        """The knobs one peer each needs: DeepSpeed's growth delay, fairseq's tolerance and error scale."""
        if not is_count(self.growth_delay, 0, 2**30):
            raise ScalerConfigError(f"growth_delay must be an int >= 0, got {self.growth_delay!r}")
        self.growth_delay = int(self.growth_delay)
        if not (is_finite(self.overflow_tolerance) and self.overflow_tolerance >= 0):
            raise ScalerConfigError(
                f"{names.get('overflow_tolerance', 'overflow_tolerance')} must be a finite number >= 0, "
                f"got {self.overflow_tolerance!r}"
            )
        self.overflow_tolerance = float(self.overflow_tolerance)
        if self.overflow_tolerance > 0 and self.hysteresis > 1:
            raise ScalerConfigError(
                "overflow_tolerance (fairseq's rule) and hysteresis > 1 (Megatron's, DeepSpeed's) both decide "
                "which overflows back the scale off: set one of them"
            )
        if self.raise_at_scale is not None and not (is_finite(self.raise_at_scale) and self.raise_at_scale >= 0):
            named = names.get("raise_at_scale", "raise_at_scale")
            raise ScalerConfigError(f"{named} must be a finite number >= 0 or None, got {self.raise_at_scale!r}")
        self.raise_at_scale = None if self.raise_at_scale is None else float(self.raise_at_scale)

    def check_scale_in_bounds(self, name: str, scale: float) -> float:
        """``scale`` within [min_scale, max_scale]: a scale outside would be used as is until the
        first update clamps it, so it is refused where it is set (constructor, load_state_dict).

        Args:
            name: the scale's name in the refusal (``"init_scale"``).
            scale: the scale to check.

        Returns:
            ``scale``, unchanged.

        Raises:
            ScalerConfigError: ``scale`` below ``min_scale`` or above ``max_scale``.
        """
        if self.min_scale is not None and scale < self.min_scale:
            raise ScalerConfigError(f"{name}={scale!r} is below min_scale={self.min_scale!r}")
        if self.max_scale is not None and scale > self.max_scale:
            raise ScalerConfigError(f"{name}={scale!r} is above max_scale={self.max_scale!r}")
        return scale

    def __setattr__(self, name: str, value: Any) -> None:
        # What is derived from the knobs (the update kernel's constexprs) is
        # cached under ``stamp``: a knob changed in place gets a new one, unique across every
        # policy, so a cache keyed on it is proved valid by one lookup.
        object.__setattr__(self, name, value)
        object.__setattr__(self, "stamp", next(_STAMPS))

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy or an unpickled policy (from another process too, where stamps count apart) gets
        # a stamp of this process.
        self.__dict__.update(state)
        object.__setattr__(self, "stamp", next(_STAMPS))

    # ------------------------------------------------------------- presets
    @classmethod
    def fixed(cls, skip_on_overflow: bool = True) -> LossScalePolicy:
        """A scale that never changes (TensorFlow/MindSpore FixedLossScaleManager).

        ``skip_on_overflow=False`` lets the step go ahead on inf/NaN (MindSpore's
        ``drop_overflow_update=False``; TensorFlow 1.x's LossScaleOptimizer always drops it).

        Args:
            skip_on_overflow: whether an overflow skips the step (True by default).

        Returns:
            a policy with ``dynamic=False``.
        """
        return cls(dynamic=False, skip_on_overflow=skip_on_overflow)

    @classmethod
    def tensorflow_exponential(
        cls, incr_every_n_steps: int, decr_every_n_nan_or_inf: int = 2, incr_ratio: float = 2.0, decr_ratio: float = 0.8
    ) -> LossScalePolicy:
        """TensorFlow 1.x ExponentialUpdateLossScaleManager's knobs, expressed as this policy's.

        Its bad steps need not be consecutive: the counter is refilled when the scale grows or backs
        off, not on a good step; a backoff never goes below 1. The ratios are rounded to float32, as
        TensorFlow multiplies its float32 scale by them (0.8 is not a float32 number: unrounded, about
        one update in three would differ from TensorFlow's in the last bit).

        Args:
            incr_every_n_steps: the good steps before the scale grows (``growth_interval``).
            decr_every_n_nan_or_inf: the overflows before a backoff (``hysteresis``; 2 by default).
            incr_ratio: the growth factor (2.0 by default), rounded to float32.
            decr_ratio: the backoff factor (0.8 by default), rounded to float32.

        Returns:
            the policy, with ``hysteresis_refill_on_backoff=True`` and ``min_scale=1.0``.
        """
        return cls(
            growth_factor=as_float32(incr_ratio),
            backoff_factor=as_float32(decr_ratio),
            growth_interval=incr_every_n_steps,
            hysteresis=decr_every_n_nan_or_inf,
            hysteresis_refill_on_backoff=True,
            min_scale=1.0,
        )

    # ------------------------------------------------------------ the rule
    # Every method below computes with tensor ops on the 0-dim device tensors and reads nothing
    # back. Tensors are only ever written by torch's in-place ops, at their addresses.
    def knobs_set(self, names: tuple[str, ...]) -> list[str]:
        """``name=value`` of each knob of ``names`` that is on (not None). Example:
        ``LossScalePolicy(clip_norm_z=2.5).knobs_set(NORM_RULE_KNOBS) == ["clip_norm_z=2.5"]``.

        Args:
            names: the knobs' names to look at.

        Returns:
            a list of ``"name=value"`` strings, in the order of ``names``.
        """
        return [f"{name}={getattr(self, name)!r}" for name in names if getattr(self, name) is not None]

    def has_norm_history(self) -> bool:
        """A rule that keeps a history of clip_grad_norm_'s norms is on (``NORM_HISTORY_KNOBS``).

        Returns:
            True when any of those knobs is not None.
        """
        return any(getattr(self, name) is not None for name in NORM_HISTORY_KNOBS)

    def has_norm_skip(self) -> bool:
        """A rule that skips the step from the norm is on.

        Returns:
            True when ``skip_norm_above``, ``skip_norm_factor`` or ``skip_norm_sigma`` is not None.
        """
        return self.skip_norm_above is not None or self.skip_norm_factor is not None or self.skip_norm_sigma is not None

    def has_spike_state(self) -> bool:
        """A spike rule that keeps ``spike_stats`` (spike_rules.py) is on.

        Returns:
            True when ``skip_norm_sigma`` or ``clip_norm_z`` is not None.
        """
        return self.skip_norm_sigma is not None or self.clip_norm_z is not None

    def skip_decision(
        self,
        found_inf: torch.Tensor,
        norm: torch.Tensor | None,
        norm_stats: torch.Tensor,
        spike_stats: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 0-dim: 1.0 where the optimizer step must be skipped. ``spike_stats``: the z-score
        skip's window (spike_rules.py), needed with ``skip_norm_sigma``.

        Args:
            found_inf: the overflow flag, a 0-dim tensor (> 0: inf/NaN).
            norm: the clip's norm, a 0-dim tensor; None when nothing was clipped.
            norm_stats: the running norm average's state tensor.
            spike_stats: the spike rules' state tensor; None where no spike rule is on.

        Returns:
            a float32 0-dim tensor on ``found_inf``'s device: 1.0 to skip, else 0.0.
        """
        return self.skips(found_inf, norm, norm_stats, spike_stats).float()

    def skips(
        self,
        found_inf: torch.Tensor,
        norm: torch.Tensor | None,
        norm_stats: torch.Tensor,
        spike_stats: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`skip_decision`'s condition before it becomes a flag: a bool 0-dim tensor.

        Args:
            found_inf: the overflow flag, a 0-dim tensor (> 0: inf/NaN).
            norm: the clip's norm, a 0-dim tensor; None when nothing was clipped.
            norm_stats: the running norm average's state tensor.
            spike_stats: the spike rules' state tensor; None where no spike rule is on.

        Returns:
            a bool 0-dim tensor on ``found_inf``'s device, true when the step must be skipped.
        """
        no = torch.zeros_like(found_inf, dtype=torch.bool)
        skip = found_inf > 0 if self.skip_on_overflow else no
        if norm is not None and self.has_norm_skip():
            value = norm.to(found_inf.device, torch.float32)
            spike = no
            if self.skip_norm_above is not None:
                spike = spike | (value > as_float32(self.skip_norm_above))
            if self.skip_norm_factor is not None:
                warmed_up = norm_stats[NORM_COUNT] >= self.norm_warmup_steps
                limit = as_float32(self.skip_norm_factor) * norm_stats[NORM_AVERAGE]
                spike = spike | (warmed_up & (value > limit))
            if self.skip_norm_sigma is not None:
                spike = spike | zscore_spike(self, spike_stats, norm.to(found_inf.device))
            skip = skip | (spike & torch.isfinite(value))
        return skip

    def backoff_floor(self) -> float:
        """The lowest scale a backoff leaves: ``min_scale``, never below ``SCALE_FLOOR`` (kernels/interfaces.py).

        Returns:
            the floor, a float.
        """
        return SCALE_FLOOR if self.min_scale is None else max(SCALE_FLOOR, self.min_scale)

    def needs_host_check(self) -> bool:
        """True when an update may have to read a device value (``stop_rules.py``): "warn"/"raise" at
        the floor, a skip limit, or fairseq's error scale.

        Returns:
            True when such a check is on.
        """
        floor_check = self.dynamic and self.min_scale is not None and self.on_min_scale != "clamp"
        return (
            floor_check or self.max_consecutive_skips is not None or (self.dynamic and self.raise_at_scale is not None)
        )

    def backs_off(self, overflow: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """This overflow backs the scale off: with hysteresis, once the budget is spent; with an
        overflow tolerance, once the share of overflowed updates since the scale last changed
        (counting this one, in float64 as fairseq's Python floats) reaches it.

        Args:
            overflow: whether the step overflowed, a bool 0-dim tensor.
            counters: the policy's counters tensor.

        Returns:
            whether the scale backs off, a bool 0-dim tensor.
        """
        back_off = overflow
        if self.hysteresis > 1:
            back_off = back_off & (counters[HYSTERESIS_LEFT] <= 1)
        if self.overflow_tolerance > 0:
            share = (counters[OVERFLOWS_SINCE_BACKOFF] + 1).double() / (counters[UPDATES_SINCE_RESCALE] + 1).double()
            back_off = back_off & (share >= self.overflow_tolerance)
        return back_off

    def backed_off(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale one backoff leaves from ``scale``: torch's float64 product rounded once to
        float32, then the floor. Example: ``policy.backed_off(torch.tensor(8.0)) == 4.0``.

        Args:
            scale: the scale, a float32 tensor.

        Returns:
            the backed-off scale, a new float32 tensor.
        """
        lowered = (scale.double() * self.backoff_factor).float()
        return torch.clamp(lowered, min=self.backoff_floor())

    def _gated_backoff_(
        self, growth_tracker: torch.Tensor, counters: torch.Tensor, found_inf: torch.Tensor
    ) -> torch.Tensor:
        """Spend or refill the hysteresis budget, count toward the tolerance; return the float32
        flag "back off now"."""
        overflow = found_inf > 0
        back_off = self.backs_off(overflow, counters)
        grow = ~overflow & (growth_tracker + 1 == self.growth_interval)
        if self.hysteresis > 1:
            left = counters[HYSTERESIS_LEFT]
            # Megatron refills the budget when the scale grows; DeepSpeed's consecutive_hysteresis on
            # every good step; TensorFlow also after each backoff.
            refill = ~overflow if self.consecutive_hysteresis else grow
            spent = torch.clamp(left - 1, min=0)
            if self.hysteresis_refill_on_backoff:
                spent = torch.where(back_off, self.hysteresis, spent)
            left.copy_(torch.where(overflow, spent, torch.where(refill, self.hysteresis, left)))
        if self.overflow_tolerance > 0:
            # fairseq: an overflow counts until a backoff; any change of the scale restarts the updates.
            overflows, since = counters[OVERFLOWS_SINCE_BACKOFF], counters[UPDATES_SINCE_RESCALE]
            overflows.copy_(torch.where(back_off, 0, torch.where(overflow, overflows + 1, overflows)))
            since.copy_(torch.where(back_off | grow, 0, since + 1))
        # An overflow that does not back off still restarts the growth count: -1 here, +1 in the update.
        growth_tracker.copy_(torch.where(overflow & ~back_off, -1, growth_tracker))
        return back_off.float()

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        counters: torch.Tensor,
        norm_stats: torch.Tensor,
        found_inf: torch.Tensor,
        skipped: torch.Tensor,
        norm: torch.Tensor | None,
        spike_stats: torch.Tensor | None = None,
    ) -> None:
        """One step of the rule, in place. ``found_inf`` > 0: the step overflowed (backs off);
        ``skipped`` > 0: the optimizer step was skipped (counted; includes norm spikes).

        The rule, read as plain Python on numbers (it runs as tensor ops on the device; the policy
        kernel computes the same, held to it by tests/kernels/test_policy_update.py)::

            if dynamic:
                if found_inf (and, with hysteresis or a tolerance, that allows it):
                    scale = max(scale * backoff_factor, floor); tracker = 0
                elif tracker + 1 == growth_interval:
                    scale = scale * growth_factor (unless that is inf); tracker = 0
                else:
                    tracker += 1
                scale = min(max(scale, min_scale), max_scale)
                if found_inf: tracker = -growth_delay
            record_iteration_: the skip counters and the norm rules' histories

        Args:
            scale: the scale, a 0-dim float32 tensor, updated in place.
            growth_tracker: the good steps counted toward growth, a 0-dim int32 tensor, updated in place.
            counters: the policy's counters tensor, updated in place.
            norm_stats: the running norm average's state tensor, updated in place.
            found_inf: the overflow flag, a 0-dim tensor (> 0: inf/NaN).
            skipped: the skip flag, a 0-dim tensor (> 0: the optimizer step was skipped).
            norm: the clip's norm, a 0-dim tensor; None when nothing was clipped.
            spike_stats: the spike rules' state tensor, updated in place; None where no spike rule is on.
        """
        if self.dynamic:
            back_off = found_inf
            if self.hysteresis > 1 or self.overflow_tolerance > 0:
                back_off = self._gated_backoff_(growth_tracker, counters, found_inf)
            # The growth/backoff arithmetic is torch's own kernel (one launch): torch's rule by
            # construction, float32 scale times float64 factor rounded once, non-finite growth kept out.
            torch._amp_update_scale_(
                scale, growth_tracker, back_off, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            if self.backoff_floor() == SCALE_FLOOR:  # else min_scale is the floor: the clamp keeps it
                scale.clamp_(min=torch.where(back_off > 0, SCALE_FLOOR, 0.0))  # never to 0, unlike torch
            if self.min_scale is not None or self.max_scale is not None:
                scale.clamp_(min=self.min_scale, max=self.max_scale)
            if self.growth_delay:  # DeepSpeed: the good steps after an overflow count from -delay
                growth_tracker.copy_(torch.where(found_inf > 0, -self.growth_delay, growth_tracker))
        self.record_iteration_(counters, norm_stats, skipped, norm, spike_stats)

    def record_iteration_(
        self,
        counters: torch.Tensor,
        norm_stats: torch.Tensor,
        skipped: torch.Tensor,
        norm: torch.Tensor | None,
        spike_stats: torch.Tensor | None = None,
    ) -> None:
        """What an iteration's outcome feeds besides the scale, in place: ``update_``'s last part,
        and all of ``update(new_scale)``'s (the scale set by hand, the iteration counted all the
        same: mmengine's static scale calls it every step)::

            count the step: skipped or not, consecutive skips
            if a norm came and the step was not skipped: average = decayed average with norm
            if a finite norm came: the spike rules' window and average take it (spike_rules.py)

        Args:
            counters: the policy's counters tensor, updated in place.
            norm_stats: the running norm average's state tensor, updated in place.
            skipped: the skip flag, a 0-dim tensor (> 0: the optimizer step was skipped).
            norm: the clip's norm, a 0-dim tensor; None when nothing was clipped.
            spike_stats: the spike rules' state tensor, updated in place; None where no spike rule is on.
        """
        was_skipped = skipped > 0
        count_step_(counters, was_skipped)
        if norm is not None and self.skip_norm_factor is not None:
            self._average_norm_(norm_stats, norm.to(norm_stats.device, torch.float32), was_skipped)
        if norm is not None and self.has_spike_state():
            update_spike_stats_(self, spike_stats, norm.to(spike_stats.device))

    def _average_norm_(self, norm_stats: torch.Tensor, norm: torch.Tensor, was_skipped: torch.Tensor) -> None:
        """Fold a stepped iteration's finite norm into the running average (``skip_norm_factor``)."""
        average, count = norm_stats[NORM_AVERAGE], norm_stats[NORM_COUNT]
        take = ~was_skipped & torch.isfinite(norm)
        # Bias-corrected start: the first norm is the average, then an exponential average.
        decay = torch.where(count > 0, torch.full_like(count, as_float32(self.norm_average_decay)), 0.0)
        moved = decay * average + (1 - decay) * norm
        average.copy_(torch.where(take, moved, average))
        count.copy_(torch.where(take, count + 1, count))

    def knobs(self) -> dict:
        """The knobs by name. Example: ``LossScalePolicy(**policy.knobs())`` is a copy.

        Returns:
            a new dict from each knob's name to its value.
        """
        return asdict(self)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        """The knobs' names, in the constructor's order.

        Returns:
            a tuple of str.
        """
        return tuple(f.name for f in fields(cls))
