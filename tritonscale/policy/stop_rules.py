"""The opt-in checks that must stop training (or warn): the only host reads of a policy update.

Three of the peers' rules end a run from inside the scale update, and a device value cannot raise:

* DeepSpeed's ``raise_error_at_min_scale`` (``on_min_scale="raise"`` / ``"warn"``): an overflow
  that would back off a scale already at ``min_scale``;
* MindSpore's ``bad_step_max`` (``max_consecutive_skips``): more than that many skips in a row;
* fairseq's ``min_loss_scale`` (``raise_at_scale``): an overflow that leaves the scale at or below it
  raises ``FloatingPointError``.

``host_check_flags`` computes the conditions before the update as tensor ops (one integer tensor); the runner reads that one value and ``act_on_host_checks`` raises or
warns. A raising update changes nothing. Example: ``flags = host_check_flags(policy, scale,
counters, found_inf, skipped)``, then ``act_on_host_checks(policy, HostCheck(int(flags)),
HostCheckRead.of(scale, counters))``. On a GPU the policy kernel computes the same bits in its one
launch and, where a raising one fires, leaves the state untouched (``kernels/policy_update.py``).

On the device a read waits for the stream, so ``UpdatesWithoutRead`` reads only when a condition
could hold: from the scale and the skip count of its last read it knows how many updates must pass
before one can (each update backs off at most once, and adds at most one skip), and it reads again
once they have passed, or as soon as anything else wrote the state (``update(new_scale)``, a load,
a knob's setter).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from enum import IntFlag
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .counters import CONSECUTIVE_SKIPS, UPDATES
from .rounding import as_float32, rounded_to_float32

if TYPE_CHECKING:
    from .loss_scale_policy import LossScalePolicy


class HostCheck(IntFlag):
    """Bits of ``host_check_flags``: the opt-in conditions that stop or warn."""

    AT_MIN_SCALE = 1  # an overflow would back off a scale already at min_scale
    TOO_MANY_SKIPS = 2  # this skip makes more than max_consecutive_skips in a row
    AT_RAISE_SCALE = 4  # this overflow leaves the scale at or below raise_at_scale


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


def host_check_flags(
    policy: LossScalePolicy,
    scale: torch.Tensor,
    counters: torch.Tensor,
    found_inf: torch.Tensor,
    skipped: torch.Tensor,
) -> torch.Tensor:
    """``HostCheck`` bits, an integer 0-dim tensor on ``scale``'s device, computed before the update."""
    overflow = found_inf > 0
    flags = torch.zeros((), dtype=torch.int64, device=scale.device)
    if policy.dynamic and policy.min_scale is not None and policy.on_min_scale != "clamp":
        at_floor = policy.backs_off(overflow, counters) & (scale <= as_float32(policy.min_scale))
        flags = flags + torch.where(at_floor, int(HostCheck.AT_MIN_SCALE), 0)
    if policy.max_consecutive_skips is not None:
        # Counted with this update's skip, before the update.
        limit = (skipped > 0) & past_skip_limit(counters[CONSECUTIVE_SKIPS] + 1, policy.max_consecutive_skips)
        flags = flags + torch.where(limit, int(HostCheck.TOO_MANY_SKIPS), 0)
    if policy.dynamic and policy.raise_at_scale is not None:
        after = torch.where(policy.backs_off(overflow, counters), policy.backed_off(scale), scale)
        too_low = overflow & (after.double() <= policy.raise_at_scale)  # fairseq compares Python floats
        flags = flags + torch.where(too_low, int(HostCheck.AT_RAISE_SCALE), 0)
    return flags


class HostCheckRead(NamedTuple):
    """What a check's message names, as read before the update: the scale, the consecutive skips,
    the updates so far (the step). Example: ``HostCheckRead.of(state.scale, state.counters)``."""

    scale: float
    in_a_row: int
    step: int

    @classmethod
    def of(cls, scale: torch.Tensor, counters: torch.Tensor) -> HostCheckRead:
        """Read from the state tensors (host reads: only once a check fired)."""
        return cls(float(scale.item()), int(counters[CONSECUTIVE_SKIPS].item()), int(counters[UPDATES].item()))


def act_on_host_checks(policy: LossScalePolicy, flags: HostCheck, read: HostCheckRead) -> None:
    """Raise or warn for the conditions in ``flags`` (read once on the host, before the update).

    The warning points at the caller of ``GradScaler.update()``.
    """
    if not flags:
        return
    step, scale = read.step, read.scale
    if flags & HostCheck.TOO_MANY_SKIPS:
        raise RuntimeError(
            f"{read.in_a_row + 1} consecutive steps were skipped, more than "
            f"max_consecutive_skips={policy.max_consecutive_skips}; loss scale {scale:g} at step {step}"
        )
    if flags & HostCheck.AT_RAISE_SCALE:
        raise FloatingPointError(
            f"Minimum loss scale reached: the overflow at step {step} would leave the loss scale (now "
            f"{scale:g}) at or below raise_at_scale={policy.raise_at_scale:g} (fairseq's min_loss_scale). "
            "The loss is probably exploding: lower the learning rate, clip the gradients or grow the batch"
        )
    if flags & HostCheck.AT_MIN_SCALE:
        message = (
            f"overflow at step {step} with the loss scale already at min_scale={policy.min_scale:g} "
            f"(scale {scale:g}): it cannot back off further"
        )
        if policy.on_min_scale == "raise":
            raise RuntimeError(message)
        warnings.warn(message + "; holding it there and skipping the step", RuntimeWarning, stacklevel=4)


class UpdatesWithoutRead:
    """How many more updates can pass without reading the host check on the device: none of its
    conditions can hold before then. Valid only while the rule alone has written the state since
    it was set: the scale and counter tensors' version counters and the knobs it depends on are
    compared before each skipped read. Example::

        bound = UpdatesWithoutRead()
        if not bound.skips_read(policy, state):   # the first update always reads
            ...read flags, scale, consecutive skips...; bound.set(policy, scale, in_a_row)
        ...the rule's update...; bound.seen(policy, state)
    """

    #: Backoffs simulated at most: past that many, the next read comes after this many updates.
    LOOKAHEAD = 1024

    def __init__(self) -> None:
        self.left = 0
        self.witness: tuple | None = None

    @staticmethod
    def _witness(policy: LossScalePolicy, state: Any) -> tuple:
        knobs = (policy.dynamic, policy.backoff_factor, policy.min_scale, policy.on_min_scale, policy.raise_at_scale,
                 policy.max_consecutive_skips)  # fmt: skip
        return (state.scale, state.scale._version, state.counters, state.counters._version, knobs)

    def skips_read(self, policy: LossScalePolicy, state: Any) -> bool:
        """True (and one update fewer left) when this update's check cannot fire: no read needed."""
        if self.left <= 0 or self.witness is None:
            return False
        current = self._witness(policy, state)
        unchanged = all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(current, self.witness))
        if unchanged:
            self.left -= 1
        return unchanged

    def set(self, policy: LossScalePolicy, scale: float, in_a_row: int) -> None:
        """After a read before an update: ``scale`` and ``in_a_row`` (consecutive skips) as read."""
        bounds = []
        if policy.dynamic and policy.min_scale is not None and policy.on_min_scale != "clamp":
            # Can fire at the j-th update after this one only if the j backoffs before it (this
            # update's included) can bring the scale to min_scale.
            bounds.append(self._backoffs_until(policy, scale, as_float32(policy.min_scale)) - 1)
        if policy.dynamic and policy.raise_at_scale is not None:
            # ... only if j + 1 backoffs (the j-th update's own included) can bring it to raise_at_scale.
            bounds.append(self._backoffs_until(policy, scale, policy.raise_at_scale) - 2)
        if policy.max_consecutive_skips is not None:
            bounds.append(policy.max_consecutive_skips - 1 - in_a_row)  # one skip more per update
        self.left = max(0, min(bounds, default=0))

    def seen(self, policy: LossScalePolicy, state: Any) -> None:
        """After the rule's update: the state as the rule left it."""
        self.witness = self._witness(policy, state)

    def forget(self) -> None:
        """After an update that ran no check (a policy with nothing to check): the next check reads."""
        self.witness = None

    def _backoffs_until(self, policy: LossScalePolicy, scale: float, level: float) -> int:
        """The fewest backoffs from ``scale`` that reach ``level`` or below (LOOKAHEAD at most).
        On the value read, in Python numbers: ``LossScalePolicy.backed_off``'s float64 product
        rounded once to float32, then its floor (tests/policy/test_stop_rules.py holds the bound
        to a scaler that reads every update)."""
        floor = policy.backoff_floor()
        for count in range(1, self.LOOKAHEAD + 1):
            scale = max(rounded_to_float32(scale * policy.backoff_factor), floor)
            if scale <= level:
                return count
        return self.LOOKAHEAD
