"""The checks that must stop a run read the device only when they could fire, and never miss one.

The oracle is the same scaler reading the checks at every update (``UpdatesWithoutRead`` never
skipping a read): the scaler must raise or warn at the same update with the same state, whatever
else writes the state in between (``update(new_scale)``, a load, a knob's setter), while reading
the device only when the scale or the skip count could have reached a limit.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.scale_rules import Loop, call_outcome

from tritonscale import GradScaler, LossScalePolicy, presets
from tritonscale.policy.stop_rules import UpdatesWithoutRead

POLICIES = st.one_of(
    st.builds(
        lambda power, floor, hysteresis: presets.deepspeed(power, 2, hysteresis, min_loss_scale=floor).policy,
        st.integers(0, 12),
        st.sampled_from([1.0, 4.0, 0.5]),
        st.integers(1, 3),
    ),  # fmt: skip
    st.builds(
        lambda floor, tolerance: presets.fairseq(1.0, 3, tolerance, min_loss_scale=floor).policy,
        st.sampled_from([2.0**-12, 2.0**-3, 1e-4]),
        st.sampled_from([0.0, 0.3]),
    ),  # fmt: skip
    st.builds(
        lambda limit, mode: LossScalePolicy(
            growth_interval=2, min_scale=2.0**-6, on_min_scale=mode, max_consecutive_skips=limit
        ),
        st.integers(1, 4),
        st.sampled_from(["warn", "raise", "clamp"]),
    ),  # fmt: skip
)
#: What a loop does: a step (overflowed or not), the scale set by hand, a knob changed.
STEP = st.tuples(st.just("step"), st.sampled_from([True, True, False]))  # runs of overflows reach the limits
OPS = st.lists(
    st.one_of(
        STEP,
        STEP,
        STEP,
        st.tuples(st.just("new_scale"), st.sampled_from([1.0, 2.0**-12, 8.0, 2.0**20])),
        st.tuples(st.just("backoff_factor"), st.sampled_from([0.5, 2.0**-10])),
    ),
    min_size=1,
    max_size=30,
)


def apply(scaler, loop, op) -> None:
    kind, value = op
    if kind == "step":
        loop.step(value)
    elif kind == "new_scale":
        scaler.update(new_scale=max(value, scaler.get_policy().min_scale or 0.0))
    else:
        scaler.set_backoff_factor(value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=POLICIES, ops=OPS, init_scale=st.sampled_from([1.0, 16.0, 2.0**14]))
def test_the_check_read_when_it_could_fire_fires_where_one_read_every_update_does(policy, ops, init_scale):
    init_scale = max(init_scale, policy.min_scale or 0.0)
    host, device = (GradScaler("cpu", init_scale=init_scale, policy=policy, backend="torch") for _ in range(2))
    host._runner._unread.skips_read = lambda policy, state: False  # the oracle reads at every update
    loops = Loop(host, "torch"), Loop(device, "torch")
    for i, op in enumerate(ops):
        expected = call_outcome(lambda op=op: apply(host, loops[0], op))
        seen = call_outcome(lambda op=op: apply(device, loops[1], op))
        assert seen == expected, f"op {i} {op}"
        assert device.state_dict() == host.state_dict(), f"op {i} {op}"
        if expected[0] is not None:
            return


def reads_per_update(monkeypatch, scaler, overflows) -> list[tuple[int, float, int]]:
    """Run ``overflows``: (update, scale, skips in a row) of each host check's read."""
    reads, update = [], [0]
    original = UpdatesWithoutRead.set
    monkeypatch.setattr(
        UpdatesWithoutRead,
        "set",
        lambda self, policy, *read: (reads.append((update[0], *read)), original(self, policy, *read))[1],
    )
    loop = Loop(scaler, "torch")
    for update[0], overflow in enumerate(overflows):
        loop.step(overflow)
    return reads


def test_deepspeeds_check_reads_once_per_possible_floor_not_per_update(monkeypatch):
    # From 2**16 with the floor at 1, sixteen backoffs must come before an overflow can meet the floor.
    scaler = GradScaler("cpu", policy=presets.deepspeed(hysteresis=1, loss_scale_window=1000), backend="torch")
    reads = reads_per_update(monkeypatch, scaler, [False, True, False, False] * 10)
    assert reads[0] == (0, 2.0**16, 0)  # the first update reads: the scale and the skips in a row
    assert reads[1] == (16, 2.0**12, 0)  # 15 updates cannot meet the floor; by then 4 backoffs were taken
    assert len(reads) <= 5  # of 40 updates, each of which read before


@pytest.mark.parametrize("write", ["new_scale", "backoff_factor", "load_state_dict"])
def test_anything_that_writes_the_state_makes_the_next_update_read(monkeypatch, write):
    # The bound from the first read lets ~15 updates pass; then the state is written outside the rule
    # so that the very next overflows meet the floor: the check must read, and raise, right away.
    scaler = GradScaler("cpu", policy=presets.deepspeed(hysteresis=1), backend="torch")
    reads_per_update(monkeypatch, scaler, [False, False])
    if write == "new_scale":
        scaler.update(new_scale=1.0)
    elif write == "backoff_factor":
        scaler.set_backoff_factor(2.0**-20)  # one overflow takes it to the floor
    else:
        twin = GradScaler("cpu", init_scale=1.0, policy=presets.deepspeed(hysteresis=1))
        scaler.load_state_dict(twin.state_dict())
    loop = Loop(scaler, "torch")
    if write == "backoff_factor":
        loop.step(True)  # from 2**16 to the floor in one backoff
    with pytest.raises(RuntimeError, match="already at min_scale=1"):
        loop.step(True)
