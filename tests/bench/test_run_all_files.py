"""bench/run_all.py's closing list of results names only the files this run wrote: an output folder
used before (bench/results/cpu keeps bars/ and train_step_compiled/ from other runs) listed them all."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
run_all = pytest.importorskip("run_all")


def test_only_files_written_since_the_start_are_listed_the_others_counted(tmp_path):
    old = [tmp_path / "bars" / "bars-run1.json", tmp_path / "train_step_compiled.log"]
    new = [tmp_path / "sweep" / "sweep.png", tmp_path / "run_all.json"]
    for path in old + new + [tmp_path / "notes.txt"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    started = time.time()
    for paths, when in ((old, started - 3600), (new, started + 1)):
        for path in paths:
            os.utime(path, (when, when))
    assert run_all.files_written(tmp_path, started) == (sorted(new), len(old))
