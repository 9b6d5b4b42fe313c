"""Each benchmark / demo entry point runs once at a tiny size, so none of them rots.

Benchmarks are not tests: nothing here looks at a time.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_demo_runs_and_follows_torch(capsys):
    # Exit code 0 means the scale trajectory was identical to torch.amp.GradScaler's.
    assert load("train_demo").main(["--steps", "8", "--width", "16", "--growth-interval", "2"]) == 0
    out = capsys.readouterr().out
    assert "scale trajectory identical to torch: True" in out
    assert "yes" in out  # the high initial scale makes at least one step overflow


def test_bench_clip_cpu_writes_json(tmp_path):
    out = tmp_path / "points.json"
    assert load("bench_clip_cpu").main(["--sizes", "4096", "--tensors", "3", "--repeats", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (point,) = data["points"]
    assert point["numel"] == 4096 and point["bytes_model"]["torch"] == 5 * 4096 * 4
    assert point["torch"]["median_ms"] > 0 and point["tritonscale"]["median_ms"] > 0
