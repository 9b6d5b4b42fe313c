"""bench/replan.py on a fake run: fake stages that take their estimate times a factor on a fake
clock, re-planned as run_all does. The oracle is the estimate the run printed (the budget's plan);
nothing here looks at a real time."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name

import budget  # noqa: E402
import replan  # noqa: E402

PRESET_STEPS = 150


def measurement() -> dict:
    """A made-up machine in ``budget.measure``'s shape, with figures close to the committed CPU run's
    (bench/results/cpu/run_all.json: a 2-core EPYC, float16 autocast ~30x float32)."""
    return {
        "matmul_time_vs_float32": {"float16": 31.0, "bfloat16": 0.7},
        "notes": [],
        "unit_ms": 0.7,
        "lm_step_ms": {"float16@64": 82.0, "float16@32": 29.0, "bfloat16@64": 12.0},
        "mlp_float16_step_ms": 10.0,
        "sweep": {"round_overhead_ms": 4.9, "ms_per_mb": 0.023, "setup_ms_per_melement": 48.0},
        "train_step": {"forward_backward_ms": 47.0, "adamw_step_ms": 2.1},
        "seconds": 1.0,
    }


def fake_run(slowdown, replanning: bool = True, probe: bool = False) -> tuple[float, float, replan.Replanner, list]:
    """(estimate, fake seconds the run took, the replanner, its notes): each stage takes the pilots'
    estimate at the size it is given times ``slowdown(k, stage)`` (k: its place in the run); with
    ``probe``, a probe of the load before each stage reads that slowdown."""
    m = measurement()
    plan = budget.plan(m, 240.0, PRESET_STEPS)
    replanner = replan.Replanner(m, plan, PRESET_STEPS)
    clock, notes = m["seconds"], []
    for k, stage in enumerate(replanner.order):
        note = replanner.before(stage, clock, slowdown(k, stage) if probe else None) if replanning else None
        notes += [note] if note else []
        seconds = budget.estimate_s(m, stage, replanner.sizes[stage]) * slowdown(k, stage)
        clock += seconds
        replanner.after(stage, seconds)
    return plan["estimate_s"], clock, replanner, notes


SCENARIOS = {
    "the sweep runs 3x its estimate": lambda k, stage: 3.0 if stage == "sweep" else 1.0,
    "the whole-step benchmark runs 3x": lambda k, stage: 3.0 if stage == "train_step" else 1.0,
    "every stage runs 2x (load from after the pilots)": lambda k, stage: 2.0,
    "every stage runs 3x": lambda k, stage: 3.0,
    "2.5x from the second stage on": lambda k, stage: 2.5 if k >= 1 else 1.0,
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_run_that_falls_behind_is_resized_and_ends_within_25_percent_of_its_estimate(scenario):
    estimate, unplanned, _, _ = fake_run(SCENARIOS[scenario], replanning=False)
    assert unplanned > 1.25 * estimate  # without re-planning this run misses its estimate
    estimate, took, replanner, notes = fake_run(SCENARIOS[scenario])
    assert abs(took / estimate - 1.0) <= 0.25, (took, estimate)
    resized = [s for s, r in replanner.stages.items() if r["size"] != r["planned_size"]]
    assert resized and notes and all(stage in " ".join(notes) for stage in resized)  # said when and why
    assert all("their estimates" in note and "left of the" in note for note in notes)
    record = replanner.record()
    assert record["estimate_s"] == estimate and len(record["replans"]) == len(replanner.order) - 1
    assert all({"planned_size", "size", "planned_estimate_s", "estimate_s", "seconds"} <= set(r)
               for r in record["stages"].values())  # fmt: skip


def test_a_run_on_time_keeps_its_plan():
    estimate, took, replanner, notes = fake_run(lambda k, stage: 1.0)
    assert notes == [] and all(r["size"] == r["planned_size"] for r in replanner.stages.values())
    assert took == pytest.approx(estimate)


def test_the_slowdown_seen_is_pulled_toward_one_by_its_prior():
    replanner = replan.Replanner(measurement(), budget.plan(measurement(), 240.0, PRESET_STEPS), PRESET_STEPS)
    assert replanner.slowdown() == 1.0  # nothing run yet
    expected = budget.estimate_s(replanner.m, "kernel_report", {})
    replanner.after("kernel_report", 3 * expected)
    assert 1.0 < replanner.slowdown() < 3.0  # one short stage is little evidence
    replanner.after("sweep", 3 * budget.estimate_s(replanner.m, "sweep", replanner.sizes["sweep"]))
    assert 2.5 < replanner.slowdown() < 3.0  # a long one is more


def test_a_probe_of_the_load_resizes_before_the_first_stage_overruns():
    # Two busy loops started after the pilots: every stage runs 3x, and the probe reads it before
    # the first stage, where the stages done have nothing to say yet.
    estimate, took, replanner, notes = fake_run(lambda k, stage: 3.0, probe=True)
    first = replanner.replans[0]
    assert first["before"] == replanner.order[0] and first["probe"] == 3.0 and 1.0 < first["slowdown"] <= 3.0
    assert "probe of the load now reads 3.00x" in notes[0]
    assert abs(took / estimate - 1.0) <= 0.25, (took, estimate)


# ------------------------------------------------------- torch's threads on a shared machine


def test_threads_go_to_one_only_when_one_thread_runs_the_parallel_op_faster():
    contended = {2: 3.8, 1: 0.2}  # the figures of two busy loops beside a 2-core machine
    assert replan.threads_for_load(2, contended.get) == (1, {"2 threads": 3.8, "1 thread": 0.2})
    assert replan.threads_for_load(2, {2: 0.11, 1: 0.18}.get) == (2, {"2 threads": 0.11, "1 thread": 0.18})

    def never(threads):
        raise AssertionError("one thread already: nothing to time")

    assert replan.threads_for_load(1, never) == (1, None)
    note = replan.fewer_threads_note({"2 threads": 3.8, "1 thread": 0.2}, "before sweep")
    assert note.startswith("run_all: torch threads 2 -> 1 before sweep") and "3.80 ms on 2 threads" in note


def test_the_parallel_op_is_timed_on_the_threads_asked_and_leaves_torchs_threads_as_they_were():
    import torch

    before = torch.get_num_threads()
    seen = []
    real_add = torch.Tensor.add_

    def add_(self, *args):
        seen.append(torch.get_num_threads())
        return real_add(self, *args)

    torch.Tensor.add_ = add_
    try:
        assert replan.parallel_op_ms(1) > 0.0
    finally:
        torch.Tensor.add_ = real_add
    assert seen == [1] * (replan.PARALLEL_OP_CALLS + 1) and torch.get_num_threads() == before


def test_under_load_the_pilots_and_every_stage_after_run_on_one_thread(monkeypatch, capsys):
    # The oracle: the thread count the fake pilots see, and what run_all records and prints.
    import run_all
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(run_all, "threads_for_load", lambda threads: (1, {f"{threads} threads": 3.8, "1 thread": 0.2}))
    pilots_ran_on = []

    def fake_measure(fp16_slowdown):
        pilots_ran_on.append(torch.get_num_threads())
        return measurement()

    monkeypatch.setattr(run_all.budget, "measure", fake_measure)
    threads = {"at_start": 2, "changes": []}
    torch.set_num_threads(2)
    try:
        plan = run_all.size_to_budget(run_all.parse_args([]), threads)
        assert plan is not None and pilots_ran_on == [1] and torch.get_num_threads() == 1
        assert run_all.fit_threads("before sweep", threads) is None  # one thread already: stays
    finally:
        torch.set_num_threads(before)
    assert threads["changes"] == [{"where": "before measuring", "threads": 1,
                                   "parallel_op_ms": {"2 threads": 3.8, "1 thread": 0.2}}]  # fmt: skip
    assert "run_all: torch threads 2 -> 1 before measuring" in capsys.readouterr().out


# ------------------------------------------------------- a cut is said: run_all's summary, the stage's title


def test_a_cut_says_planned_against_run_and_why():
    why = {"slowdown": 3.1, "time_left_s": 52.0}
    assert replan.cut_note({"steps": 40}, {"steps": 10}, why, 206.0) == (
        "CUT by the re-planner: 10 of 40 planned steps (the machine 3.1x slower than the pilots, 52 s left of the "
        "206 s estimate)"
    )
    sweep = replan.cut_note({"max_size": 2**26, "repeats": 15}, {"max_size": 2**22, "repeats": 5}, why, 206.0)
    assert sweep.startswith("CUT by the re-planner: 4M of 64M planned elements at the largest size, 5 of 15 planned "
                            "repeats (")  # fmt: skip
    grown = replan.cut_note({"max_size": 2**26, "repeats": 9}, {"max_size": 2**24, "repeats": 15}, why, 206.0)
    assert "16M of 64M planned elements at the largest size, 15 repeats (9 planned)" in grown
    assert replan.is_cut({"steps": 40}, {"steps": 10}) and not replan.is_cut({"steps": 40}, {"steps": 50})


def test_every_stage_run_below_its_plan_is_recorded_as_cut_and_no_other():
    _, _, replanner, _ = fake_run(SCENARIOS["every stage runs 3x"])
    record = replanner.record()
    below = [s for s, r in record["stages"].items() if replan.is_cut(r["planned_size"], r["size"])]
    assert below and list(record["cuts"]) == below  # the oracle: the sizes run against the sizes planned
    for stage, cut in record["cuts"].items():
        planned, size = cut["planned_size"], cut["size"]
        assert (planned, size) == (record["stages"][stage]["planned_size"], record["stages"][stage]["size"])
        assert cut["note"].startswith("CUT by the re-planner: ") and "slower than the pilots" in cut["note"]
        for key in planned:
            if size[key] < planned[key]:
                assert f"{replan.count(size[key])} of {replan.count(planned[key])} planned" in cut["note"]
    assert all(record["stages"][s]["cut"] is None for s in record["stages"] if s not in record["cuts"])


def test_a_run_on_time_cuts_nothing_and_its_summary_says_so():
    import run_all

    _, _, replanner, _ = fake_run(lambda k, stage: 1.0)
    assert replanner.record()["cuts"] == {} and replanner.cut("train_step") is None
    assert run_all.cut_summary(replanner.record()) == (
        "run_all: no stage cut: every stage ran at its planned size or above"
    )


def test_run_all_tells_each_cut_stage_and_lists_every_cut_at_the_end(monkeypatch, tmp_path, capsys):
    # The oracle: the command line each (fake) stage is given, and the sizes run_all.json says it ran at.
    import json

    import run_all

    m = measurement()
    plan = budget.plan(m, 240.0, PRESET_STEPS)
    given, clock = {}, [m["seconds"]]

    def fake_stage(name):
        def main(argv, progress):
            given[name] = argv
            clock[0] += 3.0 * plan["stage_estimate_s"][name]  # load from after the pilots: 3x
            return 0

        return main

    monkeypatch.setattr(run_all, "ENTRY_POINTS", {name: fake_stage(name) for name in run_all.ENTRY_POINTS})
    monkeypatch.setattr(run_all, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    monkeypatch.setattr(run_all, "probe_slowdown", lambda m: 3.0)
    monkeypatch.setattr(run_all, "fit_threads", lambda where, threads: None)
    monkeypatch.setattr(run_all.budget, "measure", lambda fp16_slowdown: measurement())
    assert run_all.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "run_all.json").read_text())["replanning"]
    cuts = record["cuts"]
    assert "train_step" in cuts  # at 3x the whole-step benchmark does not keep its planned steps
    for stage, argv in given.items():
        if stage in cuts:
            assert argv[argv.index("--cut-note") + 1] == cuts[stage]["note"]
            assert shown_in(argv, cuts[stage]["size"])  # and the size it was cut to
        else:
            assert "--cut-note" not in argv
    summary = run_all.cut_summary(record)
    assert summary in out and f"; {', '.join(cuts)} CUT by the re-planner (above); results in" in out
    assert summary.splitlines()[0] == f"run_all: {len(cuts)} stage{'s' * (len(cuts) != 1)} CUT by the re-planner " \
                                      "(their plots' titles say so too):"
    for stage, cut in cuts.items():
        line = next(line for line in summary.splitlines() if line.split()[1:2] == [stage])
        assert line == f"run_all:   {stage:<12} {cut['note'].removeprefix('CUT by the re-planner: ')}"


def shown_in(argv: list[str], size: dict) -> bool:
    """Whether ``argv`` gives the stage every number of ``size`` (``budget.stage_arguments``' options)."""
    return all(argv[argv.index("--" + key.replace("_", "-")) + 1] == str(value) for key, value in size.items())
