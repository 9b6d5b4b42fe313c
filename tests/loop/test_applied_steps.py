"""AppliedSteps: the skip of the last recorded step and the count of applied ones, as the scaler's stats say.

The oracle is each step's ``scaler.stats()["skipped"]`` read at once (tests/oracles/stats.py)."""

from __future__ import annotations

import pytest
import torch
from oracles.stats import STEPS, read_at_once, run_case

from tritonscale import AppliedSteps


@pytest.mark.parametrize("case", ["sgd", "hysteresis"])
def test_skipped_and_count_follow_the_scalers_own_skips(case):
    applied, skips = AppliedSteps(), []

    def each_step(step, scaler):
        applied.record(scaler)
        skips.append(bool(read_at_once(scaler)["skipped"]))
        assert applied.skipped() == skips[-1]

    run_case(case, each_step)
    assert any(skips) and applied.count == STEPS - sum(skips)


@pytest.mark.parametrize("not_ours", [torch.amp.GradScaler("cpu"), None], ids=["torch-scaler", "none"])
def test_a_scaler_without_a_skip_flag_is_refused_and_changes_nothing(not_ours):
    applied, before = AppliedSteps(), []

    def each_step(step, scaler):
        applied.record(scaler)
        before.append((applied.skipped(), applied.count))
        refused = r"AppliedSteps.record takes a tritonscale.GradScaler \(it reads its last_skip_flag\(\)\), got"
        with pytest.raises(TypeError, match=refused):
            applied.record(not_ours)
        assert (applied.skipped(), applied.count) == before[-1]  # the recorded step is still the last one

    run_case("hysteresis", each_step, steps=4)  # step 2 is skipped: the refusal keeps a True skip too
    assert [skipped for skipped, _ in before] == [False, False, True, False]
