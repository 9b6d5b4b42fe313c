"""bench/gpu_check.py, the one GPU check, on a CPU: it refuses without a GPU, naming why; a stage
that fails, hangs or finds the budget spent is recorded and the others still run; the dry run
writes the summary and each stage's results; every stage's command parses with its script's
options (a renamed option would otherwise surface only on the GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers by name
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_refuses_without_a_gpu_naming_why(tmp_path, capsys):
    out = tmp_path / "results"
    assert gpu_check.main(["--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert "needs a CUDA or ROCm GPU" in said and "--dry-run" in said
    if torch.version.cuda is None and torch.version.hip is None:
        assert f"torch {torch.__version__} is a CPU-only build" in said
    else:
        assert "torch.cuda.is_available() is False" in said
    assert not out.exists()  # nothing written


def test_a_failing_a_hanging_and_a_late_stage_leave_the_others_results(tmp_path):
    py = sys.executable
    stages = [
        gpu_check.Stage("fails", [py, "-c", "raise SystemExit(3)"], 30),
        gpu_check.Stage("hangs", [py, "-c", "print('started', flush=True); import time; time.sleep(60)"], 2),
        gpu_check.Stage("writes", [py, "-c", f"open({str(tmp_path / 'w.txt')!r}, 'w').write('x')"], 30, {}, ["w.txt"]),
    ]
    records = gpu_check.run_stages(stages, tmp_path, budget=60)
    assert [r["status"] for r in records] == ["failed", "timed out", "passed"]
    assert records[0]["returncode"] == 3 and records[1]["returncode"] is None
    assert 2 <= records[1]["seconds"] < 30  # stopped at its own timeout, not the budget's
    log = (tmp_path / "hangs.log").read_text()
    assert "started" in log and "stopped after 2 s" in log
    assert records[2]["files"] == ["w.txt"]
    # A budget already spent: the stage is not started, and says so.
    late = gpu_check.run_stages(stages[2:], tmp_path, budget=0.5)
    assert late[0]["status"] == "not run" and "budget" in late[0]["note"]
    assert "not run" in gpu_check.summary_table(records + late)


def test_dry_run_writes_the_summary_and_each_stages_results(tmp_path):
    # Two stages of the dry run (the others are bench scripts test_bench_smoke.py runs at their tiny sizes).
    out = tmp_path / "gc"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--stages", "gpu_tier", "phases_bound_off"]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    assert [s["name"] for s in summary["stages"]] == ["gpu_tier", "phases_bound_off"]
    builds = summary["builds"]
    assert builds["torch"] == torch.__version__ and builds["commit"] and builds["python"]
    tier = summary["stages"][0]
    assert tier["env"] == {"TRITON_INTERPRET": "0"} and tier["tests"]["tests"] >= 8
    assert tier["tests"]["skipped"] == tier["tests"]["tests"]  # no GPU: the tier is collected and skipped
    phases = json.loads((out / "phases_bound_off.json").read_text())
    assert phases["machine"]["bound_launch"] == "off"  # the stage's TRITONSCALE_BOUND_LAUNCH=0 reached it
    for case in phases["cases"].values():
        assert set(case) == {"torch", "ours"}
        for variant in case.values():
            assert set(variant) == {"scale", "clip", "step", "update", "lr"}
            assert all(p["median_us"] > 0 and p["launches"] is None for p in variant.values())  # CPU: no device
    assert "phases_bound_off" in (out / "gpu_check.txt").read_text()


def test_every_stage_command_parses_with_its_scripts_options(tmp_path):
    import importlib

    for dry_run in (False, True):
        stages = gpu_check.stages(tmp_path, 450, dry_run)
        assert [s.name for s in stages] == list(gpu_check.SHARES)
        assert sum(s.timeout_s for s in stages) <= 450
        for stage in stages:
            if stage.argv[1] == "-m":  # pytest
                assert stage.argv[2:5] == ["pytest", "-m", "gpu"]
                continue
            script = Path(stage.argv[1])
            importlib.import_module(script.stem).parse_args(stage.argv[2:])
            assert ("cpu" if dry_run else "cuda") in stage.argv


def test_device_names_become_folder_names():
    assert gpu_check.slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.slug("AMD Instinct MI300X") == "amd-instinct-mi300x"
