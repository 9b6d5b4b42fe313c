"""The policy rule's two forms (forms.py) give the same state, bit for bit.

The device form is the rule as tensor ops (what a GPU runs, and what the policy tests pin to each
framework's reference and to torch); the host form reads the state into Python numbers on the
CPU. Twin states are driven through random policies and random steps (overflow, norm, values at
float32's edges) and must agree after every call: scale, growth tracker, counters, norm
statistics, the skip flag and the host-check bits. So must the clip coefficient and 1/scale.
"""

from __future__ import annotations

import math
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonscale import LossScalePolicy, host_reads
from tritonscale.passes.backends import clip_coefficient, inverse_scale
from tritonscale.policy.counters import count_step_
from tritonscale.policy.forms import ON_DEVICE, ON_HOST, SCALE_FLOOR, as_float32
from tritonscale.policy.host_checks import host_check_flags
from tritonscale.policy.state import HostState

# Norms as the rule meets them: ordinary, equal to a threshold, at float32's edges, inf and NaN.
NORMS = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 4.0, 5.0, 1e-45, 3.4e38, math.inf, math.nan]),
    st.floats(0, 1e6, width=32),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
# Factors that are not powers of two round differently from float64 if the forms disagree.
GROWTH = st.sampled_from([2.0, 1.5, 3.0, as_float32(1.1)])
# 1e-20 and 1e-30 back a scale off to float32's bottom in a few steps: torch's rule reaches 0 there,
# ours stops at SCALE_FLOOR; min_scale 2**-140 (a subnormal) is below that floor, 2**-100 above it.
BACKOFF = st.sampled_from([0.5, 0.25, 0.8, as_float32(0.8), 1 / 3, 1e-20, 1e-30])
OPTIONAL_SCALE = st.one_of(st.none(), st.sampled_from([1.0, 0.5, 2.0**-20, 3.0, 2.0**24, 2.0**-140, 2.0**-100]))


@st.composite
def policies(draw) -> LossScalePolicy:
    min_scale, max_scale = draw(OPTIONAL_SCALE), draw(OPTIONAL_SCALE)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        min_scale, max_scale = max_scale, min_scale
    hysteresis = draw(st.integers(1, 3))
    # fairseq's tolerance (a float64 share of overflowed updates: 1/3 and 0.1 are not exact) excludes hysteresis.
    tolerance = 0.0 if hysteresis > 1 else draw(st.sampled_from([0.0, 0.0, 0.25, 1 / 3, 0.1, 0.5, 1.0]))
    return LossScalePolicy(
        growth_factor=draw(GROWTH),
        backoff_factor=draw(BACKOFF),
        growth_interval=draw(st.integers(1, 4)),
        dynamic=draw(st.booleans()),
        skip_on_overflow=draw(st.booleans()),
        hysteresis=hysteresis,
        overflow_tolerance=tolerance,
        growth_delay=draw(st.sampled_from([0, 0, 1, 2])),
        # fairseq's error scale: near the starting scales below, and one (1e-4) not a float32 number.
        raise_at_scale=draw(st.one_of(st.none(), st.sampled_from([1e-4, 0.5, 1.0, 2.0**-21, 3.0]))),
        consecutive_hysteresis=draw(st.booleans()),
        hysteresis_refill_on_backoff=draw(st.booleans()),
        min_scale=min_scale,
        max_scale=max_scale,
        on_min_scale=draw(st.sampled_from(["clamp", "warn", "raise"])),
        max_consecutive_skips=draw(st.one_of(st.none(), st.integers(1, 3))),
        skip_norm_above=draw(st.one_of(st.none(), st.sampled_from([1.0, 4.0, as_float32(0.1), 0.1]))),
        skip_norm_factor=draw(st.one_of(st.none(), st.sampled_from([1.5, 2.0, 8.0]))),
        norm_average_decay=draw(st.sampled_from([0.5, 0.9, 0.99, as_float32(0.99)])),
        norm_warmup_steps=draw(st.integers(1, 3)),
    ).validate()


STEPS = st.lists(st.tuples(st.booleans(), st.one_of(st.none(), NORMS)), min_size=1, max_size=12)


def bits(t: torch.Tensor) -> list:
    """Bit patterns, so that NaN equals NaN and -0.0 differs from 0.0."""
    flat = t.detach().reshape(-1)
    if flat.dtype is torch.float32:
        return [struct.pack("f", v) for v in flat.tolist()]
    return flat.tolist()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=policies(),
    steps=STEPS,
    scale=st.sampled_from([1.0, 2.0**16, 3.0, 2.0**-20, 3.0e38, 2.0**-120, SCALE_FLOOR, 2.0**-149, 3 * 2.0**-140]),
)
def test_host_form_equals_device_form(policy, steps, scale):
    if policy.min_scale is not None:
        scale = max(scale, policy.min_scale)
    if policy.max_scale is not None:
        scale = min(scale, policy.max_scale)
    states = [HostState.initial(scale, policy).to_device(torch.device("cpu")) for _ in range(2)]
    for step, (overflow, norm_value) in enumerate(steps):
        found_inf = torch.tensor(float(overflow))
        norm = None if norm_value is None else torch.tensor(norm_value, dtype=torch.float32)
        outcome = []
        for state, form in zip(states, (ON_DEVICE, ON_HOST)):
            skipped = policy.skip_decision(found_inf, norm, state.norm_stats, form=form)
            flags = host_check_flags(policy, state.scale, state.counters, found_inf, skipped, form=form)
            policy.update_(
                state.scale, state.growth_tracker, state.counters, state.norm_stats, found_inf, skipped, norm,
                form=form,
            )  # fmt: skip
            outcome.append((bits(skipped), int(flags)))
        device_state, host_state = states
        assert outcome[0] == outcome[1], f"step {step}: skip flag / host checks differ"
        for name in ("scale", "growth_tracker", "counters", "norm_stats"):
            assert bits(getattr(device_state, name)) == bits(getattr(host_state, name)), f"step {step}: {name}"
        # The scale never reaches 0, and a backoff leaves at least the floor (unless max_scale is lower).
        assert device_state.scale.item() > 0, f"step {step}: the scale reached 0"
        if policy.dynamic and overflow and policy.hysteresis == 1 and policy.overflow_tolerance == 0:
            lowest = min(as_float32(policy.backoff_floor()), as_float32(policy.max_scale or math.inf))
            assert device_state.scale.item() >= lowest, f"step {step}: backed off below the floor"


@settings(max_examples=100, deadline=None)
@given(policy=policies(), skipped=st.lists(st.booleans(), min_size=1, max_size=8))
def test_count_step_forms_agree(policy, skipped):
    counters = [HostState.initial(1.0, policy).to_device(torch.device("cpu")).counters for _ in range(2)]
    for flag in skipped:
        count_step_(counters[0], torch.tensor(flag), ON_DEVICE)
        count_step_(counters[1], flag, ON_HOST)
        assert counters[0].tolist() == counters[1].tolist()


@settings(max_examples=300, deadline=None)
@given(norm=NORMS, max_norm=st.one_of(st.floats(1e-30, 1e30), st.sampled_from([1.0, 0.1, 5.0, math.inf])))
def test_clip_coefficient_forms_agree(norm, max_norm):
    # torch.nn.utils.clip_grad_norm_'s own arithmetic is the oracle for the device form.
    on_device = clip_coefficient(torch.tensor(norm, dtype=torch.float32), max_norm)
    torch_own = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    on_host = clip_coefficient(as_float32(norm), max_norm, ON_HOST)
    assert bits(on_device) == bits(torch_own) == bits(torch.tensor(on_host, dtype=torch.float32))


@settings(max_examples=200, deadline=None)
@given(scale=st.floats(0, math.inf, width=32, exclude_min=True))
def test_inverse_scale_on_the_host_is_torchs_rounding(scale):
    # torch.amp.GradScaler.unscale_: the reciprocal in float64, then float32.
    expected = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    assert host_reads.are_free(torch.device("cpu"))
    assert bits(inverse_scale(torch.tensor(scale, dtype=torch.float32))) == bits(expected)


def test_forms_agree_under_a_float64_default_dtype():
    # The state stays float32 whatever torch's default dtype: a Python number in the device form
    # must not make a float64 intermediate that rounds once instead of after every operation.
    policy = LossScalePolicy(skip_norm_factor=2.0, norm_average_decay=as_float32(0.9), norm_warmup_steps=1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        states = [HostState.initial(2.0**16, policy).to_device(torch.device("cpu")) for _ in range(2)]
        values = torch.rand(40, generator=torch.Generator().manual_seed(0), dtype=torch.float32) + 0.5
        for value in values.tolist():
            found_inf, norm = torch.zeros((), dtype=torch.float32), torch.tensor(value, dtype=torch.float32)
            for state, form in zip(states, (ON_DEVICE, ON_HOST)):
                skipped = policy.skip_decision(found_inf, norm, state.norm_stats, form=form)
                policy.update_(
                    state.scale, state.growth_tracker, state.counters, state.norm_stats, found_inf, skipped, norm,
                    form=form,
                )  # fmt: skip
            assert bits(states[0].norm_stats) == bits(states[1].norm_stats)
        assert states[0].norm_stats.dtype is torch.float32
    finally:
        torch.set_default_dtype(default)
