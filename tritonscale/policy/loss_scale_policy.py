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
* a fixed scale (``dynamic=False``; TensorFlow's and MindSpore's FixedLossScaleManager) that never
  changes, with ``skip_on_overflow`` choosing whether an overflow skips the step (MindSpore's
  ``drop_overflow_update``) or the step goes ahead;
* a gradient-norm spike skip (Megatron-LM's ``grad_norm_skip_threshold``; OLMo-core's sync-free
  skip step): ``skip_norm_above`` and/or ``skip_norm_factor`` times the running average of past
  norms skip the step on the device like an overflow, without backing the scale off.

The rule is written once, over the device-resident state, and runs in one of two forms
(``policy_forms.py``): on the device with tensor ops (so nothing branches on a device value on a
GPU, and the update can be compiled and captured in a CUDA graph), or, on the CPU, where reading a
value waits for nothing, on Python numbers read from the state and written back -- bit for bit the
same state, at a fraction of the cost of ~10-40 tiny tensor ops. Every tensor is updated in place
at a fixed address. On the device, only the opt-in checks that must stop training ("warn"/"raise"
at the floor, ``max_consecutive_skips``) read one device value per update on the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from enum import IntFlag
from typing import Any

import torch

from ..errors import ScalerConfigError
from .knob_checks import (
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_optional_scale,
    check_positive_int,
    is_number,
)
from .policy_forms import ON_DEVICE, SCALE_FLOOR, RuleForm, as_float32

ON_MIN_SCALE = ("clamp", "warn", "raise")

# Slots of the int32 counters tensor.
HYSTERESIS_LEFT, CONSECUTIVE_SKIPS, SKIPPED_STEPS, LAST_SKIPPED, UPDATES = range(5)
COUNTER_NAMES = ("hysteresis_left", "consecutive_skips", "skipped_steps", "last_skipped", "updates")
# count_step_ as counters * keep + add, per counter (in the order above): consecutive_skips +1 on a
# skip and 0 after a step; skipped_steps +1 on a skip; last_skipped the flag; updates +1;
# hysteresis_left kept.
_KEEP_STEPPED, _KEEP_SKIPPED = (1, 0, 1, 0, 1), (1, 1, 1, 0, 1)
_ADD_STEPPED, _ADD_SKIPPED = (0, 0, 0, 0, 1), (0, 1, 1, 1, 1)
# Constants per device, never written: a pure function of the key.
_count_vector_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _count_vectors(device: torch.device) -> tuple[torch.Tensor, ...]:
    """(keep if stepped, keep if skipped, add if stepped, add if skipped) as int32 tensors on ``device``."""
    if device not in _count_vector_cache:
        _count_vector_cache[device] = tuple(
            torch.tensor(v, dtype=torch.int32, device=device)
            for v in (_KEEP_STEPPED, _KEEP_SKIPPED, _ADD_STEPPED, _ADD_SKIPPED)
        )
    return _count_vector_cache[device]


# Slots of the float32 norm statistics tensor.
NORM_AVERAGE, NORM_COUNT = range(2)


class HostCheck(IntFlag):
    """Bits of ``LossScalePolicy.host_check_flags``: the opt-in conditions that stop or warn."""

    AT_MIN_SCALE = 1  # an overflow would back off a scale already at min_scale
    TOO_MANY_SKIPS = 2  # this skip makes more than max_consecutive_skips in a row


def past_skip_limit(in_a_row: Any, limit: int) -> Any:
    """The consecutive-skip limit's one rule: ``in_a_row`` skipped steps (an int, or an int device
    tensor) are too many once more than ``limit`` (MindSpore's ``bad_step > bad_step_max``). Checked
    inside the update (``LossScalePolicy.max_consecutive_skips``: the raising update changes
    nothing) and after it (``ConsecutiveSkipLimit``: MindSpore's order, the update applied).
    Example: ``past_skip_limit(4, 3)`` is True."""
    return in_a_row > limit


class ConsecutiveSkipLimit:
    """MindSpore's ``bad_step_max``: after an update, raise once more than ``limit`` steps in a row
    were skipped, that update applied (``DynamicLossScaleManager``); the rule is ``past_skip_limit``.

    The counter (on the device) is read only when it could have passed the limit: ``bound`` is an
    upper bound on it, raised by one per update and set to the count by each read (or a load).
    """

    def __init__(self, limit: int, in_a_row: int = 0) -> None:
        self.limit = limit
        self.bound = in_a_row

    def after_update(self, read_in_a_row: Callable[[], int], read_scale: Callable[[], float]) -> None:
        """Count one update; raise if the count ``read_in_a_row()`` (a host read) is past the limit."""
        self.bound += 1
        if not past_skip_limit(self.bound, self.limit):
            return
        in_a_row = self.bound = read_in_a_row()  # the one host read, once per ~limit updates
        if past_skip_limit(in_a_row, self.limit):
            raise RuntimeError(
                f"Dynamic loss scale: {in_a_row} overflows in a row, more than bad_step_max={self.limit} "
                f"(MindSpore's limit); the loss scale is now {read_scale():g}"
            )


@dataclass
class LossScalePolicy:
    """The knobs of the loss-scale rule. Defaults are torch.amp.GradScaler's behaviour exactly.

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

    def validate(self) -> LossScalePolicy:
        """Raise ScalerConfigError naming the first bad knob; return self."""
        self.growth_factor = check_growth_factor(self.growth_factor)
        self.backoff_factor = check_backoff_factor(self.backoff_factor)
        self.growth_interval = check_growth_interval(self.growth_interval)
        self.hysteresis = check_positive_int("hysteresis", self.hysteresis)
        self.min_scale = check_optional_scale("min_scale", self.min_scale)
        self.max_scale = check_optional_scale("max_scale", self.max_scale)
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ScalerConfigError(f"min_scale {self.min_scale} is above max_scale {self.max_scale}")
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
        for flag in ("dynamic", "skip_on_overflow", "consecutive_hysteresis", "hysteresis_refill_on_backoff"):
            if not isinstance(getattr(self, flag), bool):
                raise ScalerConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        return self

    def check_scale_in_bounds(self, name: str, scale: float) -> float:
        """``scale`` within [min_scale, max_scale]: a scale outside would be used as is until the
        first update clamps it, so it is refused where it is set (constructor, load_state_dict)."""
        if self.min_scale is not None and scale < self.min_scale:
            raise ScalerConfigError(f"{name}={scale!r} is below min_scale={self.min_scale!r}")
        if self.max_scale is not None and scale > self.max_scale:
            raise ScalerConfigError(f"{name}={scale!r} is above max_scale={self.max_scale!r}")
        return scale

    # ------------------------------------------------------------- presets
    @classmethod
    def fixed(cls, skip_on_overflow: bool = True) -> LossScalePolicy:
        """A scale that never changes (TensorFlow/MindSpore FixedLossScaleManager).

        ``skip_on_overflow=False`` lets the step go ahead on inf/NaN (MindSpore's
        ``drop_overflow_update=False``; TensorFlow 1.x's LossScaleOptimizer always drops it).
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
    # Every method below takes ``form`` (policy_forms.py): ON_DEVICE computes on the 0-dim device
    # tensors and reads nothing back; ON_HOST reads them into Python numbers first (on the CPU).
    # Tensors are only ever written through ``form.store`` or torch's in-place ops, at their addresses.
    def has_norm_skip(self) -> bool:
        return self.skip_norm_above is not None or self.skip_norm_factor is not None

    def skip_decision(
        self, found_inf: torch.Tensor, norm: torch.Tensor | None, norm_stats: torch.Tensor, form: RuleForm = ON_DEVICE
    ) -> torch.Tensor:
        """float32 0-dim: 1.0 where the optimizer step must be skipped."""
        found = form.read(found_inf)
        skip = found > 0 if self.skip_on_overflow else form.false(found)
        if norm is not None and self.has_norm_skip():
            value = form.read(norm.to(found_inf.device, torch.float32))
            spike = form.false(found)
            if self.skip_norm_above is not None:
                spike = spike | (value > as_float32(self.skip_norm_above))
            if self.skip_norm_factor is not None:
                stats = form.read(norm_stats)
                warmed_up = stats[NORM_COUNT] >= self.norm_warmup_steps
                limit = form.f32(as_float32(self.skip_norm_factor) * stats[NORM_AVERAGE])
                spike = spike | (warmed_up & (value > limit))
            skip = skip | (spike & form.isfinite(value))
        return form.flag(skip, found_inf.device)

    def backoff_floor(self) -> float:
        """The lowest scale a backoff leaves: ``min_scale``, never below ``SCALE_FLOOR`` (policy_forms.py)."""
        return SCALE_FLOOR if self.min_scale is None else max(SCALE_FLOOR, self.min_scale)

    def needs_host_check(self) -> bool:
        """True when an update must read one device value: "warn"/"raise" at the floor, or a skip limit."""
        floor_check = self.dynamic and self.min_scale is not None and self.on_min_scale != "clamp"
        return floor_check or self.max_consecutive_skips is not None

    def _backs_off(self, overflow: Any, counters: Any) -> Any:
        """This overflow backs the scale off (with hysteresis, once the budget is spent)."""
        return overflow if self.hysteresis == 1 else overflow & (counters[HYSTERESIS_LEFT] <= 1)

    def _hysteresis_update_(
        self, growth_tracker: torch.Tensor, counters: torch.Tensor, found_inf: torch.Tensor, form: RuleForm
    ) -> torch.Tensor:
        """Spend or refill the hysteresis budget; return the float32 flag "back off now"."""
        read = form.read(counters)
        left, tracker = read[HYSTERESIS_LEFT], form.read(growth_tracker)
        overflow = form.read(found_inf) > 0
        back_off = self._backs_off(overflow, read)
        grow = form.not_(overflow) & (tracker + 1 == self.growth_interval)
        # Megatron refills the budget when the scale grows; DeepSpeed's consecutive_hysteresis on
        # every good step; TensorFlow also after each backoff.
        refill = form.not_(overflow) if self.consecutive_hysteresis else grow
        spent = form.at_least(left - 1, 0)
        if self.hysteresis_refill_on_backoff:
            spent = form.where(back_off, self.hysteresis, spent)
        new_left = form.where(overflow, spent, form.where(refill, self.hysteresis, left))
        # An overflow the budget absorbs still restarts the growth count: -1 here, +1 in the update.
        new_tracker = form.where(overflow & form.not_(back_off), -1, tracker)
        form.store(counters, HYSTERESIS_LEFT, new_left, left)
        form.store(growth_tracker, (), new_tracker, tracker)
        return form.flag(back_off, found_inf.device)

    def host_check_flags(
        self,
        scale: torch.Tensor,
        counters: torch.Tensor,
        found_inf: torch.Tensor,
        skipped: torch.Tensor,
        form: RuleForm = ON_DEVICE,
    ) -> Any:
        """``HostCheck`` bits (an int, or an integer 0-dim tensor on the device) computed before the
        update: AT_MIN_SCALE is DeepSpeed's raise_error_at_min_scale condition, TOO_MANY_SKIPS
        MindSpore's bad_step_max condition."""
        read = form.read(counters)
        flags = 0
        if self.dynamic and self.min_scale is not None and self.on_min_scale != "clamp":
            at_floor = self._backs_off(form.read(found_inf) > 0, read) & (
                form.read(scale) <= as_float32(self.min_scale)
            )
            flags = flags + form.where(at_floor, int(HostCheck.AT_MIN_SCALE), 0)
        if self.max_consecutive_skips is not None:
            # Counted with this update's skip, before the update.
            limit = (form.read(skipped) > 0) & past_skip_limit(read[CONSECUTIVE_SKIPS] + 1, self.max_consecutive_skips)
            flags = flags + form.where(limit, int(HostCheck.TOO_MANY_SKIPS), 0)
        return flags

    def act_on_host_checks(self, flags: HostCheck, scale: torch.Tensor, counters: torch.Tensor) -> None:
        """Raise or warn for the conditions in ``flags`` (read once on the host, before the update).

        The warning points at the caller of ``GradScaler.update()``.
        """
        if not flags:
            return
        step = int(counters[UPDATES].item())
        if flags & HostCheck.TOO_MANY_SKIPS:
            in_a_row = int(counters[CONSECUTIVE_SKIPS].item()) + 1
            raise RuntimeError(
                f"{in_a_row} consecutive steps were skipped, more than "
                f"max_consecutive_skips={self.max_consecutive_skips}; loss scale {scale.item():g} at step {step}"
            )
        if flags & HostCheck.AT_MIN_SCALE:
            message = (
                f"overflow at step {step} with the loss scale already at min_scale={self.min_scale:g} "
                f"(scale {scale.item():g}): it cannot back off further"
            )
            if self.on_min_scale == "raise":
                raise RuntimeError(message)
            warnings.warn(message + "; holding it there and skipping the step", RuntimeWarning, stacklevel=4)

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        counters: torch.Tensor,
        norm_stats: torch.Tensor,
        found_inf: torch.Tensor,
        skipped: torch.Tensor,
        norm: torch.Tensor | None,
        form: RuleForm = ON_DEVICE,
    ) -> None:
        """One step of the rule, in place. ``found_inf`` > 0: the step overflowed (backs off);
        ``skipped`` > 0: the optimizer step was skipped (counted; includes norm spikes).

        The rule, read as plain Python on numbers (``form`` runs it as tensor ops on the device,
        or on numbers read from it where that is free; ``tests/test_policy_forms.py`` holds the two
        to the same bits)::

            if dynamic:
                if found_inf (and, with hysteresis, the hysteresis is used up):
                    scale = max(scale * backoff_factor, floor); tracker = 0
                elif tracker + 1 == growth_interval:
                    scale = scale * growth_factor (unless that is inf); tracker = 0
                else:
                    tracker += 1
                scale = min(max(scale, min_scale), max_scale)
            count the step: skipped or not, consecutive skips
            if a norm came and the step was not skipped: average = decayed average with norm
        """
        if self.dynamic:
            back_off = found_inf
            if self.hysteresis > 1:
                back_off = self._hysteresis_update_(growth_tracker, counters, found_inf, form)
            # The growth/backoff arithmetic is torch's own kernel (one launch): torch's rule by
            # construction, float32 scale times float64 factor rounded once, non-finite growth kept out.
            torch._amp_update_scale_(
                scale, growth_tracker, back_off, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            if self.backoff_floor() == SCALE_FLOOR:  # else min_scale is the floor: the clamp keeps it
                form.raise_to_(scale, SCALE_FLOOR, form.read(back_off) > 0)  # never to 0, unlike torch
            if self.min_scale is not None or self.max_scale is not None:
                scale.clamp_(min=self.min_scale, max=self.max_scale)
        was_skipped = form.read(skipped) > 0
        self.count_step_(counters, was_skipped, form)
        if norm is not None and self.skip_norm_factor is not None:
            value = form.read(norm.to(scale.device, torch.float32))
            stats = form.read(norm_stats)
            average, count = stats[NORM_AVERAGE], stats[NORM_COUNT]
            take = form.not_(was_skipped) & form.isfinite(value)
            # Bias-corrected start: the first norm is the average, then an exponential average.
            decay = form.where(count > 0, form.full_like(count, as_float32(self.norm_average_decay)), 0.0)
            moved = form.f32(form.f32(decay * average) + form.f32(form.f32(1 - decay) * value))
            form.store(norm_stats, NORM_AVERAGE, form.where(take, moved, average), average)
            form.store(norm_stats, NORM_COUNT, form.where(take, form.f32(count + 1), count), count)

    @staticmethod
    def count_step_(counters: torch.Tensor, skipped: Any, form: RuleForm = ON_DEVICE) -> None:
        """The skip counters of one finished iteration, in place (also when the scale was set by hand).

        ``skipped``: a bool 0-dim tensor (ON_DEVICE) or a bool (ON_HOST). Two vector ops, whose
        operands are picked by the flag: ``counters <- counters * keep + add``.
        """
        keep_stepped, keep_skipped, add_stepped, add_skipped = _count_vectors(counters.device)
        counters.mul_(form.where(skipped, keep_skipped, keep_stepped)).add_(
            form.where(skipped, add_skipped, add_stepped)
        )

    def knobs(self) -> dict:
        return asdict(self)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
