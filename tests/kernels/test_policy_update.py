"""The policy kernel (``kernels/policy_update.py``) is the policy's rule, bit for bit.

The oracle is the rule's other executor, its tensor ops (``LossScalePolicy.update_`` /
``record_iteration_``), held to the peers and torch by the policy tests. Twin states are driven
through trajectories of a few dozen iterations (overflows, growth, spikes, NaN/inf norms, one to
three optimizers' flags, unscale_-only iterations, ``update(new_scale)`` to float32's edges) for
every policy column of the crossing harness and for knob combinations; after every call each state
tensor is compared by its bits, and so are the combined found_inf and the host-check read-out.
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle
import random
import struct

import pytest
import torch
from crossings.policies import POLICIES

from tritonscale import LossScalePolicy
from tritonscale.flags import combine_flags
from tritonscale.kernels import policy_update as kernel
from tritonscale.kernels.interfaces import KERNEL_CONSTANTS
from tritonscale.policy import counters, spike_rules
from tritonscale.policy.rounding import SCALE_FLOOR
from tritonscale.policy.stop_rules import HostCheck, host_check_flags
from tritonscale.policy.kernel_form import kernel_rule
from tritonscale.policy.state import HostState
from tritonscale.scaler.scaler_args import peer_policy

STATE = ("scale", "growth_tracker", "counters", "norm_stats", "spike_stats")
# Norms as the rule meets them: ordinary, a spike, equal to thresholds, at float32's edges, inf and NaN.
NORMS = [1.0, 1.5, 2.0, 2.5, 1.25, 0.75, 3.0, 40.0, 1e-45, 3.4e38, math.inf, math.nan]
# update(new_scale) values: float32's largest powers (growth to inf), the floor, a subnormal.
NEW_SCALES = [1.0, 2.0**127, 3.0e38, SCALE_FLOOR, 2.0**-140, 2.0**16]

KNOB_COMBINATIONS = {
    "hysteresis3_consecutive": dict(hysteresis=3, consecutive_hysteresis=True, growth_interval=2),
    "hysteresis2_refill_min1": dict(hysteresis=2, hysteresis_refill_on_backoff=True, min_scale=1.0, growth_interval=3),
    "tolerance_third_delay2": dict(overflow_tolerance=1 / 3, growth_delay=2, growth_interval=2),
    "min_max_warn_delay": dict(
        min_scale=4.0, max_scale=2.0**20, on_min_scale="warn", growth_delay=1, growth_interval=1
    ),
    "min_raise": dict(min_scale=2.0**10, on_min_scale="raise", growth_interval=2, backoff_factor=0.25),
    "skip_limit_raise_at": dict(max_consecutive_skips=2, raise_at_scale=2.0**-20, growth_interval=2),
    "static_goes_ahead": dict(dynamic=False, skip_on_overflow=False),
    "static_skips": dict(dynamic=False, skip_on_overflow=True, skip_norm_above=4.0),
    "to_the_floor_and_inf": dict(backoff_factor=1e-20, growth_factor=3.0, growth_interval=1),
    "odd_factors": dict(backoff_factor=0.8, growth_factor=1.1, growth_interval=2),
    "zclip_percentile_skip_on_spike": dict(
        clip_norm_z=1.0, clip_norm_warmup_steps=2, clip_norm_mode="percentile", clip_norm_skip_update_on_spike=True
    ),
    "zclip_mean_zscore_average": dict(
        clip_norm_z=2.0,
        clip_norm_option="mean",
        clip_norm_warmup_steps=4,
        skip_norm_sigma=1.5,
        skip_norm_window=3,
        skip_norm_factor=2.0,
        norm_average_decay=0.9,
        norm_warmup_steps=2,
        hysteresis=2,
    ),  # fmt: skip
}


def column_policy(context) -> LossScalePolicy:
    """The LossScalePolicy a crossing-harness column gives our scaler."""
    policy, _ = peer_policy(context.kwargs().get("policy"))
    return (policy or LossScalePolicy()).validate()


CASES = {f"column-{c.name}": (lambda c=c: column_policy(c)) for c in POLICIES}
CASES |= {name: (lambda knobs=knobs: LossScalePolicy(**knobs).validate()) for name, knobs in KNOB_COMBINATIONS.items()}


def bits(t: torch.Tensor) -> list:
    """Bit patterns, so that NaN equals NaN and -0.0 differs from 0.0."""
    flat = t.detach().reshape(-1)
    if flat.dtype is torch.float32:
        return [struct.pack("f", v) for v in flat.tolist()]
    if flat.dtype is torch.float64:
        return [struct.pack("d", v) for v in flat.tolist()]
    return flat.tolist()


def raises(policy: LossScalePolicy, flags: int) -> bool:
    """The host check's bits that stop the run (stop_rules.act_on_host_checks): the state stays."""
    stop = HostCheck.TOO_MANY_SKIPS | HostCheck.AT_RAISE_SCALE
    if policy.on_min_scale == "raise":
        stop |= HostCheck.AT_MIN_SCALE
    return bool(flags & stop)


class Iteration:
    """One iteration's flags: each optimizer's found_inf and skip (the tensor-op skip_decision on
    its own found_inf), the last norm; no skips when only unscale_ ran."""

    def __init__(self, rng: random.Random, policy: LossScalePolicy, host, optimizers: int, unscale_only: bool):
        overflow = rng.random() < 0.3
        self.found_infs = [torch.tensor(float(overflow and (k == 0 or rng.random() < 0.5))) for k in range(optimizers)]
        self.norm = None if rng.random() < 0.15 else torch.tensor(rng.choice(NORMS), dtype=torch.float32)
        self.skips = [] if unscale_only else [
            policy.skip_decision(f, self.norm, host.norm_stats, spike_stats=host.spike_stats)
            for f in self.found_infs
        ]  # fmt: skip
        self.found_inf = combine_flags(self.found_infs)
        self.skipped = (
            combine_flags(self.skips)
            if self.skips
            else policy.skip_decision(self.found_inf, None, host.norm_stats)
        )


def host_step(policy: LossScalePolicy, host, it: Iteration, count_only: bool) -> int:
    """The oracle: the rule's tensor ops; returns the host-check bits (0 without checks)."""
    if count_only:
        policy.record_iteration_(host.counters, host.norm_stats, it.skipped, it.norm, host.spike_stats)
        return 0
    flags = 0
    if policy.needs_host_check():
        flags = host_check_flags(policy, host.scale, host.counters, it.found_inf, it.skipped)
    if not raises(policy, flags):
        policy.update_(
            host.scale, host.growth_tracker, host.counters, host.norm_stats, it.found_inf, it.skipped, it.norm,
            spike_stats=host.spike_stats,
        )  # fmt: skip
    return int(flags)


def drive(policy: LossScalePolicy, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    start = 2.0**16 if policy.min_scale is None else max(2.0**16, policy.min_scale)
    start = start if policy.max_scale is None else min(start, policy.max_scale)
    ours, host = (HostState.initial(start, policy).to_device(torch.device("cpu")) for _ in range(2))
    checks = policy.needs_host_check()
    prepared = kernel.PreparedUpdates()  # as the runner launches it: the calls after the first prepared
    for step in range(steps):
        kind = rng.choice(["step"] * 6 + ["unscale_only", "new_scale"])
        if kind == "new_scale":
            value = rng.choice(NEW_SCALES)
            value = value if policy.min_scale is None else max(value, policy.min_scale)
            value = value if policy.max_scale is None else min(value, policy.max_scale)
            ours.scale.fill_(value)
            host.scale.fill_(value)
        it = Iteration(rng, policy, host, rng.choice([1, 1, 2, 3]), kind == "unscale_only")
        before = host.to_host()
        flags = host_step(policy, host, it, kind == "new_scale")
        tensors = tuple(getattr(ours, name) for name in STATE)
        result = kernel.update_policy_state_(
            tensors, it.found_infs, it.skips, it.norm, kernel_rule(policy),
            count_only=kind == "new_scale", checks=checks and kind != "new_scale", hold=True, prepared=prepared,
        )  # fmt: skip
        where = f"step {step} ({kind}, {len(it.found_infs)} optimizers)"
        for name in STATE:
            assert bits(getattr(ours, name)) == bits(getattr(host, name)), f"{where}: {name}"
        assert bits(result.found_inf) == bits(it.found_inf), f"{where}: combined found_inf"
        if result.checks is not None:
            read = (flags, before.scale, before.counters[counters.CONSECUTIVE_SKIPS], before.counters[counters.UPDATES])
            assert tuple(result.checks.tolist()) == read, f"{where}: the host check's read-out"


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_tensor_ops_bit_for_bit(case):
    drive(CASES[case](), seed=sum(map(ord, case)), steps=36)


def test_every_policy_column_is_a_case():
    # The crossing harness's 16 columns (9 presets, apex static, spike rules, norm skips, host checks).
    assert len(POLICIES) == 16 and all(f"column-{c.name}" in CASES for c in POLICIES)


def test_a_check_that_raises_leaves_the_state_untouched():
    policy = LossScalePolicy(max_consecutive_skips=1, hysteresis=2, skip_norm_factor=2.0).validate()
    state = HostState.initial(8.0, policy).to_device(torch.device("cpu"))
    state.counters[counters.CONSECUTIVE_SKIPS] = 1
    tensors = tuple(getattr(state, name) for name in STATE)
    before = [bits(t) for t in tensors]
    one, norm = torch.tensor(1.0), torch.tensor(3.0)
    result = kernel.update_policy_state_(tensors, [one], [one], norm, kernel_rule(policy), checks=True, hold=True)
    assert int(result.checks[0].item()) == HostCheck.TOO_MANY_SKIPS
    assert [bits(t) for t in tensors] == before
    # Without hold (the host proved no check can fire) the update goes ahead.
    kernel.update_policy_state_(tensors, [one], [one], norm, kernel_rule(policy), checks=True, hold=False)
    assert state.counters[counters.CONSECUTIVE_SKIPS].item() == 2


def test_more_flags_than_the_kernel_reads_are_refused():
    policy = LossScalePolicy()
    state = HostState.initial(8.0, policy).to_device(torch.device("cpu"))
    flags = [torch.tensor(0.0)] * (kernel.MAX_FLAGS + 1)
    with pytest.raises(ValueError, match="sum more first"):
        kernel.update_policy_state_(tuple(getattr(state, n) for n in STATE), flags, [], None, kernel_rule(policy))


def test_a_knob_set_later_makes_a_new_rule():
    policy = LossScalePolicy()
    first = kernel_rule(policy)
    policy.growth_interval = 7
    assert kernel_rule(policy).GROWTH_INTERVAL == 7 and first.GROWTH_INTERVAL == 2000


def test_a_loaded_policy_never_takes_a_rule_cached_for_another():
    """The rule is cached under the policy's stamp; a pickled policy carries its stamp, which in
    another process may be a live policy's with other knobs: loading takes a new one."""
    other = LossScalePolicy(growth_interval=9)
    assert kernel_rule(other).GROWTH_INTERVAL == 9
    policy = LossScalePolicy(growth_interval=5)
    object.__setattr__(policy, "stamp", other.stamp)  # as a stamp counted in another process may be
    loaded = pickle.loads(pickle.dumps(policy))
    assert kernel_rule(loaded).GROWTH_INTERVAL == 5
    assert kernel_rule(copy.deepcopy(loaded)).GROWTH_INTERVAL == 5


def test_the_kernel_reads_the_policys_slots():
    # One home, kernels/interfaces.py: the policy imports the layouts from there, and the kernel reads
    # them as its K parameter, defaulted to KERNEL_CONSTANTS (no module global: Triton would check it
    # on every launch; tests/test_launch_path.py counts them).
    assert inspect.signature(kernel.policy_update_kernel.fn).parameters["K"].default is KERNEL_CONSTANTS
    K = KERNEL_CONSTANTS
    slots = ("HYSTERESIS_LEFT", "CONSECUTIVE_SKIPS", "SKIPPED_STEPS", "LAST_SKIPPED", "UPDATES",
             "OVERFLOWS_SINCE_BACKOFF", "UPDATES_SINCE_RESCALE", "NORM_AVERAGE", "NORM_COUNT")  # fmt: skip
    assert [getattr(K, name) for name in slots] == [getattr(counters, name) for name in slots]
    # The counters' slots number state_dict()'s names in order.
    assert [counters.COUNTER_NAMES.index(name.lower()) for name in slots[:7]] == [getattr(K, n) for n in slots[:7]]
    spike = (spike_rules.Z_SEEN, spike_rules.EMA_MEAN, spike_rules.EMA_VAR, spike_rules.EMA_SEEN, spike_rules.HEADER)
    assert (K.Z_SEEN, K.EMA_MEAN, K.EMA_VAR, K.EMA_SEEN, K.SPIKE_HEADER) == spike
    assert K.SCALE_FLOOR == SCALE_FLOOR
    assert (K.AT_MIN_SCALE, K.TOO_MANY_SKIPS, K.AT_RAISE_SCALE) == tuple(HostCheck)
