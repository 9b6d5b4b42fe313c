"""bench/launch_cost.py: its reading of callgrind's dumps (against a dump written by hand), and one
tiny run under valgrind (skipped without it, saying so). A benchmark, not a test: no figure is
asserted, only that every phase was counted, through the stub's launches, and the last line's form."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers by name
import launch_cost  # noqa: E402

#: A dump as callgrind writes it: compressed names ("(id) name" once, then "(id)"), relative
#: positions, a call's inclusive cost on the line after its "calls=".
DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
desc: Trigger: Client Request: ours|1x1024|defaults

positions: line
events: Ir
summary: 1234

ob=(1) /tmp/tsmark.so
fl=(1) ???
fn=(10) tsin_bare
0 7
cob=(2) /usr/lib/libffi.so
cfi=(2) ???
cfn=(11) 0x0000000000004010
calls=3 0
0 293
fn=(12) tsin_update
0 7
cfn=(11)
calls=3 0
+2 900
* 27
fn=(13) other
0 5000
fn=(10)
0 3

totals: 1234
"""


def test_inclusive_costs_sum_each_markers_own_lines_and_its_calls(tmp_path):
    path = tmp_path / "callgrind.out.1"
    path.write_text(DUMP)
    label, totals, costs = launch_cost.inclusive_costs(path)
    assert label == "ours|1x1024|defaults" and totals == 1234
    assert costs == {"tsin_bare": 7 + 293 + 3, "tsin_update": 7 + 900 + 27}  # "other" is no marker
    # Per call: the marker's inclusive cost less the bare marker's, over the calls.
    assert launch_cost.per_call(costs, 3) == {"update": (934 - 303) / 3}


def test_breakdown_wraps_one_callable_at_a_time_and_restores_it():
    import tritonscale.policy.runner as runner
    from tritonscale.scaler.optimizer_record import OptimizerRecord

    class Marks:  # the marker library's stand-in: runs the callable, notes the marker
        def __init__(self):
            self.phases = []

        def run(self, phase, fn):
            self.phases.append(phase)
            return fn()

    marks = Marks()
    targets = ["tritonscale.policy.runner:_last_norm", "tritonscale.scaler.optimizer_record:OptimizerRecord.outcome"]
    originals = (runner._last_norm, vars(OptimizerRecord)["outcome"])
    breakdown = launch_cost.Breakdown(targets, marks)
    breakdown.install(1)
    assert runner._last_norm is originals[0] and isinstance(vars(OptimizerRecord)["outcome"], staticmethod)
    assert OptimizerRecord.outcome([]) == originals[1].__func__([])  # outside a measured phase: not marked
    assert marks.phases == [] and breakdown.calls == [0, 0]
    breakdown.inside = True
    assert OptimizerRecord.outcome([]) == originals[1].__func__([])  # the wrapper returns the callable's value
    assert marks.phases == ["part1"] and breakdown.calls == [0, 1]
    breakdown.remove(1)
    assert (runner._last_norm, vars(OptimizerRecord)["outcome"]) == originals
    with pytest.raises(SystemExit, match="no attribute 'missing'"):
        launch_cost.Breakdown(["tritonscale.policy.runner:missing"], marks)


@pytest.mark.slow
def test_one_tiny_run_counts_every_phase_through_the_stub(tmp_path, capsys):
    missing = launch_cost.valgrind_missing()
    if missing:
        pytest.skip(f"bench/launch_cost.py needs callgrind: {missing}")
    out = tmp_path / "launch_cost.json"
    inside = "tritonscale.policy.runner:PolicyRunner.update_"  # called once per update(), inside it
    assert launch_cost.main(["--quick", "--bound", "on", "--out", str(out), "--breakdown", inside]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["on_valgrind"] and run["bound"] == "on" and run["calls"] == 3
    assert run["cases"] == ["torch|1x1024|torch", "ours|1x1024|defaults"]
    ours, theirs = run["results"]["ours|1x1024|defaults"], run["results"]["torch|1x1024|torch"]
    for result in (ours, theirs):
        assert set(result["per_call"]) == set(launch_cost.PHASES)
        assert all(n > 0 for n in result["per_call"].values())
    # Ours launched its kernels through Triton's C launcher into the stub; torch's CPU ops launch nothing.
    assert {"check_pass_kernel", "finalize_kernel", "policy_update_kernel", "advance_lr_kernel"} <= set(
        ours["stub_launches"]
    )
    assert theirs["stub_launches"] == []
    # The breakdown: the callable ran once per step inside update(), and cost part of it.
    (figure,) = ours["breakdown"].values()
    assert figure["calls"] == 1 and 0 < figure["per_step"] < ours["per_call"]["update"]
    assert "breakdown" not in theirs
    assert [(r["phase"], r["policy"]) for r in data["rows"]] == [(p, "defaults") for p in launch_cost.PHASES]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    number = r"\d+\.\d\d"
    assert re.fullmatch(rf"host instructions at 1 tensor, ours/torch: scale {number}, clip {number}, "
                        rf"step {number}, update {number}", last), last  # fmt: skip
