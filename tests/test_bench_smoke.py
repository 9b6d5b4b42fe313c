"""Each benchmark / experiment entry point runs once at a tiny size, so none of them rots.

Benchmarks are not tests: nothing here looks at a time. What is checked is what the scripts claim
besides times -- the experiments follow torch's trajectory, every point and variant is written.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tritonscale.torch_compat import COMPILED_CLIP, has_torch

#: The entry points run end to end (bars' bar 4 in a process of its own): the slow tier.
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name


def load(name: str):
    """A bench/ script as a module (registered in sys.modules, as its dataclasses need)."""
    return importlib.import_module(name)


def test_run_all_quick_writes_every_result(tmp_path):
    # The README's main job as a user runs it: its own process, without the interpreter that
    # conftest.py sets (there "auto" would run the kernels through it, at ~1 ms a program).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--quick", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "%" in done.stderr  # the progress bar
    for name in ("experiments/experiments.png", "experiments/experiments.json", "sweep/sweep.png",
                 "sweep/sweep.json", "kernel_report.json", "collectives/collectives.json",
                 "train_step/train_step.json", "train_step/train_step.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
        assert str(tmp_path / name) in out  # the main job says where its results are

    experiments = json.loads((tmp_path / "experiments/experiments.json").read_text())["results"]
    assert [r["experiment"] for r in experiments] == ["lm-fp16", "lm-bf16", "mlp-fp16", "overflow"]
    for r in experiments:
        assert r["same_scales"] and r["same_skipped_steps"], r["experiment"]
        assert r["steps"] == 3 and all(len(s["loss"]) == 3 for s in r["runs"].values())
        spread = r["step_time_spread"]  # 3 steps, the first 2 warm-up: one round, no spread to judge by
        assert spread["rounds"] == 1 and spread["q20"] == spread["q80"] and spread["within_noise"] is None
        assert set(r["grad_time_spread"]) == {"ratio", "q20", "q80", "rounds", "within_noise"}
    overflow = experiments[-1]
    # init_scale 2**24 overflows the first steps: both skip them, the policy run too.
    assert overflow["skipped_steps"]["torch"] == overflow["skipped_steps"]["tritonscale"] >= 1
    assert len(overflow["runs"]) == 3

    collectives = json.loads((tmp_path / "collectives/collectives.json").read_text())
    assert collectives["ranks"] == 2 and len(collectives["per_rank"]) == 2
    for timings in collectives["per_rank"]:
        assert set(timings) == {"all-gather (ours)", "all-gather alone", "2 all-reduces (Megatron)",
                                "1 all-reduce", "clip, local", "clip, partitioned"}  # fmt: skip
        assert all(t["median_ms"] > 0 and len(t["samples_ms"]) == 3 for t in timings.values())
    assert [len(r["per_rank"]) for r in collectives["ratios"]] == [2, 2, 2]

    sweep = json.loads((tmp_path / "sweep/sweep.json").read_text())
    assert sweep["machine"]["device"] == "cpu" and sweep["machine"]["torch"] and sweep["machine"]["triton"]
    assert {(p["dtype"], p["layout"]) for p in sweep["points"]} == {
        (d, lay) for d in ("float32", "bfloat16", "float16") for lay in ("flat", "200")
    }
    for p in sweep["points"]:
        variants = (
            ("fold", "copy") if p["dtype"] == "float16" else ("torch", "tritonscale", "torch-fused", "fold", "copy")
        )
        assert all(p[v]["median_ms"] > 0 and p[v]["bytes"] > 0 for v in variants)
        if p["dtype"] != "float16":  # the speed-ups' spreads over the interleaved rounds (the raw samples kept)
            assert p["ratio_tritonscale_spread"]["rounds"] == len(p["torch"]["samples_ms"]) > 1
            assert p["ratio_fold_spread"]["q20"] <= p["ratio_fold_spread"]["q80"]
    assert sweep["sizes"]["max_size"] == 4096 and sweep["layouts"]["200"] == "200 tensors"

    kernels = json.loads((tmp_path / "kernel_report.json").read_text())
    assert kernels and all(row["ok"] and row["spills"] == 0 for row in kernels)

    steps = json.loads((tmp_path / "train_step/train_step.json").read_text())
    assert steps["machine"]["device"] == "cpu" and steps["args"]["preset_name"] == "quick"
    compiled = ["tritonscale-compiled"] if has_torch(COMPILED_CLIP) else []  # refused before torch 2.12
    assert list(steps["variants"]) == ["no-scaling", "no-scaling+clip", "torch-fused", "torch-foreach",
                                       "tritonscale-fold", "tritonscale-foreach", "tritonscale-flat",
                                       *compiled]  # fmt: skip
    for name, result in steps["variants"].items():
        assert set(result["phases"]) == {"forward", "backward", "scaler", "step", "update", "zero_grad"}
        assert all(len(samples) == 3 for samples in steps["raw_ms"][name].values()), name  # 3 recorded steps
        assert result["step"]["median_ms"] > 0 and 0 <= result["scaler_share"] < 1
        if name != "no-scaling":
            assert result["vs_no_scaling_spread"]["rounds"] == 3
    record = json.loads((tmp_path / "run_all.json").read_text())
    assert record["plan"] is None and not record["failed"]  # --quick: tiny sizes, no budget
    assert list(record["stage_seconds"]) == ["experiments", "sweep", "kernel_report", "collectives", "train_step"]
    assert "$ python bench/sweep.py" in (tmp_path / "sweep.log").read_text()  # each log says what ran


def test_experiments_with_the_triton_kernels_follow_torch(tmp_path):
    # The real kernels (through the interpreter) in the experiment loop, fused optimizer and not.
    experiments = load("experiments")
    for optimizer in ("fused", "foreach"):
        argv = ["--backend", "triton", "--steps", "3", "--only", "mlp-fp16", "overflow", "--d-model", "32",
                "--optimizer", optimizer, "--out", str(tmp_path)]  # fmt: skip
        assert experiments.main(argv) == 0
        results = json.loads((tmp_path / "experiments.json").read_text())["results"]
        for r in results:
            assert r["same_scales"] and r["same_skipped_steps"]
            assert r["max_rel_loss_diff"] < 1e-3, (optimizer, r["experiment"], r["max_rel_loss_diff"])


def test_sweep_bytes_model():
    sweep = load("sweep")
    import torch

    n = 1000
    model = {v: sweep.bytes_model(v, "sgd", n, torch.float32) for v in sweep.VARIANTS}
    # torch: unscale_ rw + norm r + clip rw + SGD (grad r, momentum rw, param rw) = 10 passes of 4 bytes.
    assert model == {"torch": 40 * n, "tritonscale": 32 * n, "torch-fused": 48 * n, "fold": 36 * n, "copy": 8 * n}
    assert sweep.bytes_model("tritonscale", "adamw", n, torch.bfloat16) == (3 + 7) * 2 * n


def test_bench_clip_cpu_writes_json(tmp_path):
    out = tmp_path / "points.json"
    assert load("bench_clip_cpu").main(["--sizes", "4096", "--tensors", "3", "--repeats", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (point,) = data["points"]
    assert point["numel"] == 4096 and point["bytes_model"]["torch"] == 5 * 4096 * 4
    assert point["torch"]["median_ms"] > 0 and point["tritonscale"]["median_ms"] > 0


def test_fold_numerics_writes_every_step(tmp_path):
    """On torch's ops the unfolded run is torch's bit for bit (the claim the docs cite); the fold is
    only reported."""
    out = tmp_path / "fold.json"
    assert load("fold_numerics").main(["--steps", "2", "--backend", "torch", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["step"] for s in data["per_step"]] == [0, 1] and data["clip_active_steps"] == 2
    assert all(s["unfold"]["max_abs"] == 0 for s in data["per_step"])


def test_bars_prints_every_ratio(tmp_path, capsys):
    out = tmp_path / "bars.json"
    assert load("bars").main(["--quick", "--backend", "torch", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu"
    ratios = data["ratios"]
    # bar 1: ideal/ours and torch/ours for three layouts, and the reach of the two per-parameter ones;
    # bar 2: torch/ours with fused AdamW and with SGD, and the 3 knobs; bar 3: torch/ours;
    # bar 4: host time, 4 cases x 5 (4 phases and the total) x 2 (our two backends)
    assert [r["bar"] for r in ratios] == ["1"] * 8 + ["2"] * 5 + ["3"] + ["4"] * 40
    assert "SGD" in ratios[9]["what"] and "AdamW" in ratios[8]["what"]
    assert all(r["value"] > 0 and r["spread"]["rounds"] >= 2 for r in ratios)
    compared = [r for r in ratios[:8] if "its reach" not in r["what"]]
    assert len(compared) == 6 and all(max(r["max_rel_diff_vs_torch"].values()) < 1e-5 for r in compared)
    for reach in (r for r in ratios[:8] if "its reach" in r["what"]):  # ideal over ideal plus the reads
        ideal, summed = reach["numerator"]["samples_ms"], reach["denominator"]["samples_ms"]
        assert reach["ratio"] == "ideal/(ideal + reads)" and all(s > i for i, s in zip(ideal, summed))
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "cpu (" in lines[0]  # the machine line
    assert [line.split()[0] for line in lines if " = " in line] == [r["bar"] for r in ratios]  # one line per ratio


def test_bars_runs_the_bars_asked_for_on_the_threads_asked_for(tmp_path):
    out, threads = tmp_path / "bar2.json", torch.get_num_threads()
    assert load("bars").main(["--quick", "--bars", "2", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["bar"] for r in data["ratios"]} == {"2"} and data["machine"]["threads"] == 1
    assert torch.get_num_threads() == threads  # the caller's thread count is back


def test_host_time_reports_every_phase_with_its_launches(tmp_path, capsys):
    # conftest.py set TRITON_INTERPRET=1 before triton was imported: the script runs in-process.
    out = tmp_path / "host_time.json"
    module = load("host_time")
    assert module.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    ratios = data["ratios"]
    phases = ("scale", "clip", "step", "update", "total")
    assert [r["ratio"] for r in ratios[:10]] == [f"{v} {p}/torch {p}" for p in phases
                                                 for v in ("ours", "ours (torch backend)")]  # fmt: skip
    assert len(ratios) == 40 and all(r["value"] > 0 and r["target"] == "<= 1.0" for r in ratios)
    # The kernels were not run, but every launch was counted: the clip launches, the scale does not.
    for case, launches in data["triton_launches"].items():
        assert set(launches) == set(phases[:-1]) and launches["clip"] >= 1 and launches["scale"] == 0, case
    assert ratios[2]["triton_launches"] == data["triton_launches"]["1 x 1024 float32, defaults"]["clip"]
    printed = [line for line in capsys.readouterr().out.splitlines() if " = " in line]
    assert len(printed) == 40 and all("Triton launches" in line for line in printed)
    from tritonscale import host_reads

    assert host_reads.are_free(torch.device("cpu"))  # the switch is back as it was


def test_launch_table_prints_torch_beside_ours(capsys):
    # docs/performance.md's launch table: one markdown row per (optimizer, tensors, scaler).
    assert load("launch_table").main([]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header] == ["scaler", "optimizer", "tensors", "scale", "clip", "step", "update", "total"]
    assert len(body) == 12
    for row in body:
        cells = [c.strip() for c in row]
        phases = [int(c) for c in cells[3:7]]
        assert sum(phases) == int(cells[7]) and phases[0] == 1, cells  # scale: one multiply, both scalers
        if cells[0] == "torch":
            assert phases[3] == 1, cells  # torch's update is its one _amp_update_scale_


def test_cpu_norms_writes_every_candidate(tmp_path):
    out = tmp_path / "norms.json"
    assert load("cpu_norms").main(["--size", "65536", "--tensors", "4", "--repeats", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    names = ["vector_norm", "rows of 4096", "dot", "foreach", "mul_"]
    assert [(r["data"], r["norm"]) for r in results] == [(d, n) for d in ("normal", "subnormal squares") for n in names]
    assert all(r["median_ms"] > 0 for r in results)
    normal = {r["norm"]: r["error"] for r in results if r["data"] == "normal"}
    assert normal["rows of 4096"] < 1e-5 and normal["mul_"] is None  # a norm close to float64's


def test_ratio_spread_is_the_p20_p80_of_the_per_round_ratios():
    import statistics

    timing = load("timing")
    a = [1.0, 1.2, 0.9, 1.1, 1.3, 1.0, 0.95]
    b = [1.0, 1.0, 1.0, 1.0, 1.0, 1.25, 1.0]
    per_round = [x / y for x, y in zip(a, b)]  # by hand: round r's ratio is a[r] / b[r]
    q = statistics.quantiles(per_round, n=5, method="inclusive")
    spread = timing.ratio_spread(a, b)
    # the inclusive quantiles (timing.band interpolates as lo + (hi - lo) * f: an ulp from statistics')
    assert spread["q20"] == pytest.approx(q[0], rel=1e-12) and spread["q80"] == pytest.approx(q[3], rel=1e-12)
    assert spread["rounds"] == 7
    assert spread["ratio"] == statistics.median(per_round)
    assert spread["within_noise"] is (q[0] <= 1.0 <= q[3]) is True
    assert timing.format_ratio(spread).endswith(" within noise")

    faster = timing.ratio_spread([2.0, 2.1, 1.9, 2.2, 2.05], [1.0, 1.0, 1.05, 0.98, 1.0])
    assert faster["q20"] > 1.0 and faster["within_noise"] is False
    assert "within noise" not in timing.format_ratio(faster)
    few = [0.0215, 0.0020, 0.0410]  # three samples: the exclusive method put p20 at -2.6 ms
    assert min(few) <= timing.quantiles(few)["q20_ms"] / 1e3 <= timing.quantiles(few)["q80_ms"] / 1e3 <= max(few)
    single = timing.ratio_spread([2.0], [1.0])
    assert single["q20"] == single["q80"] == 2.0 and single["within_noise"] is None
    with pytest.raises(ValueError):
        timing.ratio_spread([1.0, 2.0], [1.0])


def machine_measurement(fp16_step_ms: float) -> dict:
    """A made-up measurement (budget.measure's shape): bfloat16 steps of 30 ms, float16 of ``fp16_step_ms``."""
    return {
        "matmul_time_vs_float32": {"float16": fp16_step_ms / 30.0, "bfloat16": 1.0},
        "lm_step_ms": {"float16@64": fp16_step_ms, "float16@32": fp16_step_ms / 3, "bfloat16@64": 30.0},
        "mlp_float16_step_ms": fp16_step_ms / 10,
        "sweep": {"round_overhead_ms": 5.0, "ms_per_mb": 0.025, "setup_ms_per_melement": 50.0},
        "train_step": {"forward_backward_ms": 50.0, "adamw_step_ms": 3.0},
        "seconds": 1.0,
    }


def test_budget_plan_sizes_the_float16_experiments_down_where_float16_is_slow():
    budget = load("budget")
    fast = budget.plan(machine_measurement(fp16_step_ms=30.0), budget_s=240)
    slow = budget.plan(machine_measurement(fp16_step_ms=900.0), budget_s=240)  # the 2-core machine
    assert fast["sizes"]["experiments"] == {"steps": 150, "fp16_d_model": 64} and not fast["over_budget"]
    assert fast["estimate_s"] <= 240 and slow["estimate_s"] <= 240 and not slow["over_budget"]
    e = slow["sizes"]["experiments"]
    assert e["fp16_d_model"] == 32 and budget.MIN_STEPS <= e["steps"] < 150
    assert slow["stage_estimate_s"]["experiments"] < budget.experiments_estimate_s(machine_measurement(900.0), 150, 64)
    hopeless = budget.plan(machine_measurement(fp16_step_ms=900.0), budget_s=10)
    assert hopeless["over_budget"] and hopeless["sizes"]["experiments"]["steps"] == budget.MIN_STEPS
    assert hopeless["sizes"]["sweep"] == {"max_size": 2**22, "repeats": 5}
    args = budget.stage_arguments(slow["sizes"])
    assert args["experiments"] == ["--steps", str(e["steps"]), "--fp16-d-model", "32"]


def test_progress_bar_prints_on_a_time_interval_in_a_log():
    import io

    progress = load("progress")
    stream = io.StringIO()
    bar = progress.ProgressBar({"a": 0.5, "b": 0.5}, stream=stream, interval_s=0.0, estimates_s={"a": 1e-9, "b": 10})
    bar.update("a", 0, 4)  # the estimate is long past: the bar guesses 90% of the stage
    bar.redraw(timer=True)
    bar.update("b", 1, 4)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "~ 45%" in lines[0] and "b 1/4" in lines[2]


BENCH_SCRIPTS = ("bars", "bench_clip_cpu", "collectives", "cpu_norms", "experiments", "gpu_check", "gpu_phases",
                 "host_time", "kernel_report", "launch_cost", "launch_table", "run_all", "sweep", "train_step", "walks")  # fmt: skip


@pytest.mark.parametrize("name", BENCH_SCRIPTS)
def test_help_shows_the_whole_first_paragraph(name, capsys):
    module = load(name)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    shown = "".join(capsys.readouterr().out.split())  # argparse rewraps, breaking lines after hyphens too
    assert "".join(module.__doc__.split("\n\n")[0].split()) in shown


def test_walks_follow_the_optimizer_from_the_call_into_the_package():
    # The walk is made of the calls that took the optimizer: the first is the scaler's own method,
    # a module is a room once, however often the walk stays in it.
    found = load("walks").walks()
    assert set(found) == {f"{o} {c}" for o in ("SGD", "AdamW(fused)") for c in ("clip_grad_norm_", "step")}
    for name, walk in found.items():
        assert walk["visits"][0].endswith("GradScaler." + name.split()[-1]) or "eager_call" in walk["visits"][0]
        assert walk["rooms"] <= walk["stays"] <= walk["calls"] == len(walk["visits"])


def test_bench_readme_commands_parse():
    # Every `python bench/<script>.py ...` line of bench/README.md names a script whose parser takes its flags.
    import shlex

    commands = [line.strip() for line in (BENCH / "README.md").read_text().splitlines()
                if line.strip().startswith("python bench/")]  # fmt: skip
    assert len(commands) >= 9
    for command in commands:
        words = shlex.split(command.split("  #")[0])
        script = Path(words[1])
        assert script.parent.name == "bench" and (BENCH / script.name).exists(), command
        module = load(script.stem)
        if "--help" not in words:
            module.parse_args(words[2:])
