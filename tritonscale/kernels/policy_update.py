"""The loss-scale policy's update in one program: the scale, its trackers and the spike rules' state.

One launch per ``GradScaler.update()`` whatever the policy (torch's own update is one kernel,
``_amp_update_scale_``). The rule is ``tritonscale/policy/loss_scale_policy.py``'s
``LossScalePolicy.update_`` + ``record_iteration_`` (read it there, top to bottom); this kernel is
that rule for a GPU, written with the knobs as ``tl.constexpr`` (one compile per policy) and held to
the rule's tensor ops bit for bit by ``tests/kernels/test_policy_update.py``:

    found    = sum of the optimizers' found_inf flags        (torch combines them by summing)
    skipped  = sum of their skip flags > 0, or, when no optimizer stepped (unscale_ only),
               skip_on_overflow and found > 0
    checks   = the opt-in host checks' bits (policy/stop_rules.py), before anything changes; with
               ``hold`` a check that raises leaves the state untouched (the host reads the bits and raises)
    if dynamic:
        back_off = found, or gated by hysteresis / fairseq's overflow tolerance (their counters move)
        torch's _amp_update_scale_: back_off -> scale = f32(f64(scale) * backoff), tracker = 0;
            else tracker + 1 == interval -> scale = f32(f64(scale) * growth) if finite, tracker = 0;
            else tracker += 1
        floor (2**-126 on a backoff), clamp to [min_scale, max_scale], growth_delay
    count the step (skip counters), the norm's running average (float32, skip_norm_factor),
    the z-score window (shift in a finite norm) and ZClip's warm-up / EMA (float64)

Contract: every state tensor is updated in place (one program, addresses fixed: a CUDA graph can
capture it). Up to ``MAX_FLAGS`` optimizers' flags are read by pointer; a caller with more sums
them first (extra launches, documented there). Floating-point contraction is off for this kernel
(``enable_fp_fusion=False``): the rule rounds after every operation, as its tensor ops do.

Slot layouts, the check bits and the scale floor are ``kernels/interfaces.py``'s (the policy
imports them from there), read as ``K``: one constexpr parameter the kernel declares with its
default, so that Triton checks no global on a launch (interfaces.py's docstring).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .bound_launch import BoundLaunch, PreparedLaunch
from .interfaces import CHECK_SLOTS, KERNEL_CONSTANTS, MAX_FLAGS, UpdateRule


@triton.jit
def _f64(value: tl.constexpr):
    return tl.full([], value, tl.float64)


@triton.jit
def _f32(value: tl.constexpr):
    return tl.full([], value, tl.float32)


@triton.jit
def _summed(p0, p1, p2, p3, COUNT: tl.constexpr):
    """The sum of COUNT 0-dim flags, left to right, in float32."""
    total = tl.load(p0).to(tl.float32)
    if COUNT > 1:
        total += tl.load(p1).to(tl.float32)
    if COUNT > 2:
        total += tl.load(p2).to(tl.float32)
    if COUNT > 3:
        total += tl.load(p3).to(tl.float32)
    return total


@triton.jit
def _backs_off(overflow, left, overflows, since, R: tl.constexpr):
    """LossScalePolicy.backs_off: once the hysteresis budget is spent, or the share reaches the tolerance."""
    back_off = overflow
    if R.HYSTERESIS > 1:
        back_off = back_off & (left <= 1)
    if R.TOLERANCE > 0:
        share = (overflows + 1).to(tl.float64) / (since + 1).to(tl.float64)
        back_off = back_off & (share >= _f64(R.TOLERANCE))
    return back_off


@triton.jit
def _host_checks(scale, consecutive, overflow, skipped, back_off, R: tl.constexpr, K: tl.constexpr):
    """policy/stop_rules.host_check_flags: the opt-in conditions, before the update."""
    flags = tl.zeros([], tl.int32)
    if R.CHECK_MIN_SCALE:
        flags += tl.where(back_off & (scale <= _f32(R.MIN_SCALE)), K.AT_MIN_SCALE, 0)
    if R.SKIP_LIMIT > 0:
        flags += tl.where(skipped & (consecutive + 1 > R.SKIP_LIMIT), K.TOO_MANY_SKIPS, 0)
    if R.CHECK_RAISE_AT:
        lowered = (scale.to(tl.float64) * _f64(R.BACKOFF_FACTOR)).to(tl.float32).to(tl.float64)
        lowered = tl.maximum(lowered, _f64(R.BACKOFF_FLOOR))
        after = tl.where(back_off, lowered, scale.to(tl.float64))
        flags += tl.where(overflow & (after <= _f64(R.RAISE_AT)), K.AT_RAISE_SCALE, 0)
    return flags


@triton.jit
def _new_scale(scale, tracker, found, back_off, R: tl.constexpr, K: tl.constexpr):
    """torch's _amp_update_scale_ (the backoff gated), then the floor, the clamps, the growth delay."""
    lowered = (scale.to(tl.float64) * _f64(R.BACKOFF_FACTOR)).to(tl.float32)
    grown = (scale.to(tl.float64) * _f64(R.GROWTH_FACTOR)).to(tl.float32)
    grows = tracker + 1 == R.GROWTH_INTERVAL
    grown_ok = grows & (grown - grown == 0)  # non-finite growth keeps the scale (torch)
    new = tl.where(back_off, lowered, tl.where(grown_ok, grown, scale))
    tracker = tl.where(back_off | grows, 0, tracker + 1)
    if R.RAISE_FLOOR:  # never to 0, unlike torch
        floor = _f32(K.SCALE_FLOOR)
        new = tl.where(back_off & (new < floor), floor, new)
    if R.HAS_MIN:
        new = tl.maximum(new, _f32(R.MIN_SCALE), propagate_nan=tl.PropagateNan.ALL)
    if R.HAS_MAX:
        new = tl.minimum(new, _f32(R.MAX_SCALE), propagate_nan=tl.PropagateNan.ALL)
    if R.GROWTH_DELAY:  # DeepSpeed: the good steps after an overflow count from -delay
        tracker = tl.where(found > 0, -R.GROWTH_DELAY, tracker)
    return new, tracker


@triton.jit
def _update_scale(scale_ptr, tracker_ptr, counters_ptr, found, R: tl.constexpr, K: tl.constexpr):
    """LossScalePolicy.update_'s dynamic part (with _gated_backoff_), in place."""
    scale = tl.load(scale_ptr)
    tracker = tl.load(tracker_ptr)
    overflow = found > 0
    back_off = found != 0  # torch's kernel tests the flag's truth
    if R.HYSTERESIS > 1 or R.TOLERANCE > 0:
        left = tl.load(counters_ptr + K.HYSTERESIS_LEFT)
        overflows = tl.load(counters_ptr + K.OVERFLOWS_SINCE_BACKOFF)
        since = tl.load(counters_ptr + K.UPDATES_SINCE_RESCALE)
        back_off = _backs_off(overflow, left, overflows, since, R)
        grow = ~overflow & (tracker + 1 == R.GROWTH_INTERVAL)
        if R.HYSTERESIS > 1:
            refill = ~overflow if R.CONSECUTIVE_HYSTERESIS else grow
            spent = tl.maximum(left - 1, 0)
            if R.REFILL_ON_BACKOFF:
                spent = tl.where(back_off, R.HYSTERESIS, spent)
            tl.store(counters_ptr + K.HYSTERESIS_LEFT, tl.where(overflow, spent, tl.where(refill, R.HYSTERESIS, left)))
        if R.TOLERANCE > 0:  # fairseq: an overflow counts until a backoff; a rescale restarts the updates
            counted = tl.where(back_off, 0, tl.where(overflow, overflows + 1, overflows))
            tl.store(counters_ptr + K.OVERFLOWS_SINCE_BACKOFF, counted)
            tl.store(counters_ptr + K.UPDATES_SINCE_RESCALE, tl.where(back_off | grow, 0, since + 1))
        tracker = tl.where(overflow & ~back_off, -1, tracker)  # restarts the growth count
    scale, tracker = _new_scale(scale, tracker, found, back_off, R, K)
    tl.store(scale_ptr, scale)
    tl.store(tracker_ptr, tracker)


@triton.jit
def _count_step(counters_ptr, skipped, K: tl.constexpr):
    """policy/counters.count_step_: consecutive and total skips, the last flag, the updates."""
    step = skipped.to(tl.int32)
    tl.store(counters_ptr + K.CONSECUTIVE_SKIPS, tl.where(skipped, tl.load(counters_ptr + K.CONSECUTIVE_SKIPS) + 1, 0))
    tl.store(counters_ptr + K.SKIPPED_STEPS, tl.load(counters_ptr + K.SKIPPED_STEPS) + step)
    tl.store(counters_ptr + K.LAST_SKIPPED, step)
    tl.store(counters_ptr + K.UPDATES, tl.load(counters_ptr + K.UPDATES) + 1)


@triton.jit
def _average_norm(norm_stats_ptr, value, skipped, R: tl.constexpr, K: tl.constexpr):
    """LossScalePolicy._average_norm_ in float32: the first norm, then the decayed average."""
    average = tl.load(norm_stats_ptr + K.NORM_AVERAGE)
    count = tl.load(norm_stats_ptr + K.NORM_COUNT)
    take = ~skipped & (value - value == 0)
    decay = tl.where(count > 0, _f32(R.NORM_DECAY), _f32(0.0))
    moved = decay * average + (1.0 - decay) * value  # each product and the sum rounded (no fusion)
    tl.store(norm_stats_ptr + K.NORM_AVERAGE, tl.where(take, moved, average))
    tl.store(norm_stats_ptr + K.NORM_COUNT, tl.where(take, count + 1.0, count))


@triton.jit
def _shift_window(spike_ptr, x, take, R: tl.constexpr, K: tl.constexpr):
    """The z-score window, oldest first: a finite norm shifts in at the end; ``seen`` counts it."""
    o_w = tl.arange(0, K.WINDOW_BLOCK)
    p_window = spike_ptr + K.SPIKE_HEADER
    for start in range(0, R.Z_WINDOW, K.WINDOW_BLOCK):
        o_dst = start + o_w  # [K.WINDOW_BLOCK]
        m_dst = tl.where(take, o_dst < R.Z_WINDOW, False)  # (the interpreter cannot & a scalar with a block)
        b_next = tl.load(p_window + o_dst + 1, mask=m_dst & (o_dst + 1 < R.Z_WINDOW), other=0.0)
        b_new = tl.where(o_dst == R.Z_WINDOW - 1, x, b_next)
        tl.debug_barrier()  # every slot of this block read before any is written
        tl.store(p_window + o_dst, b_new, mask=m_dst)
    tl.store(spike_ptr + K.Z_SEEN, tl.load(spike_ptr + K.Z_SEEN) + take.to(tl.float64))


@triton.jit
def _zclip_threshold(mean, var, x, R: tl.constexpr, K: tl.constexpr):
    """spike_rules._zclip_threshold on float64, op for op: (clip value, spike)."""
    std = tl.sqrt(var)  # float64: sqrt.rn.f64, correctly rounded (as torch.sqrt)
    if R.ZCLIP_MODE == K.ZCLIP_PERCENTILE:
        threshold = mean + _f64(R.ZCLIP_Z) * std
        spike = x > threshold
    else:
        z = (x - mean) / (std + _f64(R.ZCLIP_EPS))
        spike = z > _f64(R.ZCLIP_Z)
        if R.ZCLIP_OPTION == K.ZCLIP_MEAN:
            threshold = mean
        else:
            eta = z / _f64(R.ZCLIP_Z)  # a larger outlier is clipped harder
            threshold = (mean + (_f64(R.ZCLIP_Z) * std) / eta) * _f64(R.ZCLIP_FACTOR)
    return threshold, spike


@triton.jit
def _zclip_ema(spike_ptr, x, take, R: tl.constexpr, K: tl.constexpr):
    """spike_rules._update_ema_: the warm-up buffer, its first mean and variance (summed left to
    right, as the host's cumsum), then the exponential averages."""
    p_buffer = spike_ptr + K.SPIKE_HEADER + R.Z_WINDOW
    seen = tl.load(spike_ptr + K.EMA_SEEN)
    mean = tl.load(spike_ptr + K.EMA_MEAN)
    var = tl.load(spike_ptr + K.EMA_VAR)
    steps = _f64(R.ZCLIP_WARMUP)
    warming = take & (seen < steps)
    slot = seen.to(tl.int32)
    completes = warming & (seen + 1.0 >= steps)
    first_mean = mean
    first_var = var
    if completes:  # the buffer with this norm in its slot, read without re-reading the store below
        total = tl.zeros([], tl.float64)
        for i in range(0, R.ZCLIP_WARMUP):
            total += tl.where(i == slot, x, tl.load(p_buffer + i))
        first_mean = total / steps
        total = tl.zeros([], tl.float64)
        for i in range(0, R.ZCLIP_WARMUP):
            deviation = tl.where(i == slot, x, tl.load(p_buffer + i)) - first_mean
            total += deviation * deviation
        first_var = total / steps
    tl.store(p_buffer + slot, x, mask=warming)
    threshold, spike = _zclip_threshold(mean, var, x, R, K)
    value = tl.where(spike, threshold, x)  # the clip value where it clipped
    new_mean = _f64(R.ZCLIP_ALPHA) * mean + _f64(R.ZCLIP_ONE_MINUS_ALPHA) * value
    deviation = value - new_mean
    new_var = _f64(R.ZCLIP_ALPHA) * var + _f64(R.ZCLIP_ONE_MINUS_ALPHA) * (deviation * deviation)
    moves = take & (seen >= steps)
    if R.ZCLIP_SKIP_ON_SPIKE:
        moves = moves & ~spike
    tl.store(spike_ptr + K.EMA_MEAN, tl.where(completes, first_mean, tl.where(moves, new_mean, mean)))
    tl.store(spike_ptr + K.EMA_VAR, tl.where(completes, first_var, tl.where(moves, new_var, var)))
    tl.store(spike_ptr + K.EMA_SEEN, seen + warming.to(tl.float64))


@triton.jit
def _record_iteration(counters_ptr, norm_stats_ptr, spike_ptr, norm_ptr, skipped, HAS_NORM: tl.constexpr, R, K):
    """LossScalePolicy.record_iteration_: the skip counters and the norm rules' histories."""
    _count_step(counters_ptr, skipped, K)
    if HAS_NORM:
        norm = tl.load(norm_ptr)
        if R.AVERAGE_NORM:
            _average_norm(norm_stats_ptr, norm.to(tl.float32), skipped, R, K)
        x = norm.to(tl.float64)
        take = x - x == 0
        if R.Z_WINDOW > 0:
            _shift_window(spike_ptr, x, take, R, K)
        if R.ZCLIP_WARMUP > 0:
            _zclip_ema(spike_ptr, x, take, R, K)


# A pointer the kernel does not follow is passed as None (update_policy_state_): a constexpr, so it
# is neither specialized nor handed to the launcher.
@triton.jit
def policy_update_kernel(
    scale_ptr,  # fp32 [] loss scale
    tracker_ptr,  # i32 [] growth tracker
    counters_ptr,  # i32 [7] policy/counters.py's slots
    norm_stats_ptr,  # fp32 [2] norm average, count
    spike_ptr,  # fp64 [n] spike_rules.py's layout (None without a spike rule)
    found0_ptr,  # fp32 [] found_inf of the first optimizer (the others: found1..3, None past NUM_FOUND)
    found1_ptr,
    found2_ptr,
    found3_ptr,
    skip0_ptr,  # fp32 [] skip flag of the first optimizer that stepped (skip1..3 likewise; None with NUM_SKIPS=0)
    skip1_ptr,
    skip2_ptr,
    skip3_ptr,
    norm_ptr,  # [] the iteration's last clip norm (None without HAS_NORM)
    found_out_ptr,  # fp32 [] the combined found_inf (written when NUM_FOUND > 1, else None)
    check_out_ptr,  # fp64 [CHECK_SLOTS]: check bits, scale, consecutive skips, updates before (with CHECKS, else None)
    hold,  # i32: 1 = a raising check leaves the state untouched
    NUM_FOUND: tl.constexpr,
    NUM_SKIPS: tl.constexpr,  # 0: no optimizer stepped, the skip follows found_inf
    HAS_NORM: tl.constexpr,
    COUNT_ONLY: tl.constexpr,  # update(new_scale): record_iteration_ only
    CHECKS: tl.constexpr,
    R: tl.constexpr,  # UpdateRule
    K: tl.constexpr = KERNEL_CONSTANTS,  # never passed: the constants (interfaces.py)
):
    found = _summed(found0_ptr, found1_ptr, found2_ptr, found3_ptr, NUM_FOUND)
    if NUM_FOUND > 1:
        tl.store(found_out_ptr, found)
    if NUM_SKIPS > 0:
        skipped = _summed(skip0_ptr, skip1_ptr, skip2_ptr, skip3_ptr, NUM_SKIPS) > 0
    elif R.SKIP_ON_OVERFLOW:  # unscale_ only: what overflowed counts as skipped (skip_decision, no norm)
        skipped = found > 0
    else:
        skipped = tl.full([], 0, tl.int1)
    go = True
    if CHECKS:
        scale = tl.load(scale_ptr)
        consecutive = tl.load(counters_ptr + K.CONSECUTIVE_SKIPS)
        left = tl.load(counters_ptr + K.HYSTERESIS_LEFT)
        back_off = _backs_off(found > 0, left, tl.load(counters_ptr + K.OVERFLOWS_SINCE_BACKOFF),
                              tl.load(counters_ptr + K.UPDATES_SINCE_RESCALE), R)  # fmt: skip
        flags = _host_checks(scale, consecutive, found > 0, skipped, back_off, R, K)
        tl.store(check_out_ptr + K.CHECK_BITS, flags.to(tl.float64))
        tl.store(check_out_ptr + K.CHECK_SCALE, scale.to(tl.float64))
        tl.store(check_out_ptr + K.CHECK_CONSECUTIVE_SKIPS, consecutive.to(tl.float64))
        tl.store(check_out_ptr + K.CHECK_UPDATES, tl.load(counters_ptr + K.UPDATES).to(tl.float64))
        go = (hold == 0) | ((flags & R.HOLD_MASK) == 0)
    if go:
        if not COUNT_ONLY and R.DYNAMIC:
            _update_scale(scale_ptr, tracker_ptr, counters_ptr, found, R, K)
        _record_iteration(counters_ptr, norm_stats_ptr, spike_ptr, norm_ptr, skipped, HAS_NORM, R, K)


class UpdateResult(NamedTuple):
    """What the launch leaves for the host: the combined found_inf (0-dim float32) and, with checks,
    the float64 [4] check read-out (bits, scale, consecutive skips, updates before the update)."""

    found_inf: torch.Tensor
    checks: torch.Tensor | None


_ONE_PROGRAM = (1,)
_UPDATE = BoundLaunch(policy_update_kernel)
_AT = {name: i for i, name in enumerate(policy_update_kernel.arg_names)}  # a parameter's position


def _slots(flags: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``MAX_FLAGS`` pointer slots: the flags, then None (a constexpr: the kernel reads no slot past
    NUM_FOUND / NUM_SKIPS, and a None is neither specialized nor passed to the launcher)."""
    return (*flags, *_NONE[: MAX_FLAGS - len(flags)])


_NONE = (None,) * MAX_FLAGS


class PreparedUpdates:
    """One caller's policy-update launches, prepared (``bound_launch.PreparedLaunch``): a call with
    the state tensors and the rule object of the caller's last call, and flag counts it made before,
    launches through the launch prepared from that earlier call, with only the flags, the norm and
    the outputs passed. Another state or rule drops them all. One per scaler (``PolicyRunner``).
    Example: ``update_policy_state_(state, [found_inf], [skip], norm, rule, prepared=PreparedUpdates())``.
    """

    __slots__ = ("state", "rule", "launches")

    def __reduce__(self) -> tuple:  # a copy or an unpickled scaler prepares its own
        return (PreparedUpdates, ())

    def __init__(self) -> None:
        self.state: tuple = (None,) * 5
        self.rule: UpdateRule | None = None
        #: (flags, skips, has a norm, count_only, checks, hold) -> the launch prepared for it.
        self.launches: dict[tuple, PreparedLaunch] = {}

    def held(self, state: tuple, rule: UpdateRule) -> bool:
        """Whether the launches were prepared for ``state`` (these very tensors) and ``rule``."""
        held = self.state
        return (
            self.rule is rule and held[0] is state[0] and held[1] is state[1] and held[2] is state[2]
            and held[3] is state[3] and held[4] is state[4]
        )  # fmt: skip


def update_policy_state_(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    found_infs: list[torch.Tensor],
    skips: list[torch.Tensor],
    norm: torch.Tensor | None,
    rule: UpdateRule,
    *,
    count_only: bool = False,
    checks: bool = False,
    hold: bool = False,
    prepared: PreparedUpdates | None = None,
) -> UpdateResult:
    """One launch: the policy's update (or, ``count_only``, its record_iteration_) of ``state`` =
    (scale, growth_tracker, counters, norm_stats, spike_stats), in place, from up to ``MAX_FLAGS``
    0-dim flags each (on the state's device). ``prepared``: the caller's :class:`PreparedUpdates`,
    through which a call like its last one launches. Example::

        update_policy_state_(state, [found_inf], [skip], norm, rule_of(policy))
    """
    scale, tracker, counters, norm_stats, spike_stats = state
    num_found, num_skips = len(found_infs), len(skips)
    if not 1 <= num_found <= MAX_FLAGS or num_skips > MAX_FLAGS:
        raise ValueError(f"1 to {MAX_FLAGS} found_inf flags and at most {MAX_FLAGS} skip flags: sum more first")
    # Every pointer the kernel does not follow is None: a constexpr, never specialized nor launched.
    found_out = torch.empty((), dtype=torch.float32, device=scale.device) if num_found > 1 else None
    check_out = torch.empty(CHECK_SLOTS, dtype=torch.float64, device=scale.device) if checks else None
    result = UpdateResult(found_out if found_out is not None else found_infs[0], check_out)
    varying = [*found_infs, *skips]
    if norm is not None:
        varying.append(norm)
    if found_out is not None:
        varying.append(found_out)
    if check_out is not None:
        varying.append(check_out)
    shape = (num_found, num_skips, norm is not None, count_only, checks, hold)
    if prepared is not None and prepared.held(state, rule):
        launch = prepared.launches.get(shape)
        if launch is not None:
            launch(*varying)
            return result
    args = (
        scale, tracker, counters, norm_stats, spike_stats if spike_stats.numel() else None,
        *_slots(found_infs), *_slots(skips), norm, found_out, check_out, int(hold),
    )  # fmt: skip
    kwargs = dict(
        NUM_FOUND=num_found, NUM_SKIPS=num_skips, HAS_NORM=norm is not None, COUNT_ONLY=count_only,
        CHECKS=checks, R=rule, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    _UPDATE(_ONE_PROGRAM, *args, **kwargs)
    if prepared is not None:  # the next call like this one: its flags, norm and outputs vary
        positions = [*range(_AT["found0_ptr"], _AT["found0_ptr"] + num_found)]
        positions += range(_AT["skip0_ptr"], _AT["skip0_ptr"] + num_skips)
        positions += [_AT[name] for name in ("norm_ptr", "found_out_ptr", "check_out_ptr") if args[_AT[name]] is not None]
        if not prepared.held(state, rule):
            prepared.state, prepared.rule, prepared.launches = tuple(state), rule, {}
        prepared.launches[shape] = _UPDATE.prepare(_ONE_PROGRAM, args, kwargs, tuple(positions))
    return result
