"""The README's torchrun command runs examples/train_multiprocess.py on 2 CPU ranks in every layout, and the
layouts that train the same model on the same data agree: DDP, FSDP2 and ZeRO-style partitions
report the same global gradient norm (each is the other's oracle)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_multiprocess.py"
LAYOUTS = ["ddp", "fsdp2", "zero", "tensor-parallel"]


def readme_command() -> list[str]:
    """The README's torchrun line, as a reader pastes it."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("torchrun ")]
    return line.split()


def run_example(layout: str) -> tuple[float, float]:
    """(scale, grad norm) that rank 0 prints after 3 steps of the README's command."""
    torchrun, *args = readme_command()
    args[args.index("--layout") + 1] = layout
    assert torchrun == "torchrun" and args[args.index("--nproc_per_node") + 1] == "2"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args, "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The example is on current torch API: it warns of nothing deprecated (torch.distributed.nn's
    # functional all_reduce did).
    deprecated = [line for line in done.stderr.splitlines() if "deprecated" in line.lower()]
    assert deprecated == [], deprecated
    found = re.search(rf"{layout}: 3 steps on 2 ranks, scale (\S+), grad norm (\S+)", done.stdout)
    assert found, done.stdout
    return float(found[1]), float(found[2])


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[float, float]]:
    return {layout: run_example(layout) for layout in LAYOUTS}


def test_every_layout_trains(results):
    for layout, (scale, norm) in results.items():
        assert scale == 2.0**16, f"{layout} skipped a step"
        assert 0.0 < norm < float("inf"), layout


def test_data_parallel_layouts_agree(results):
    ddp = results["ddp"][1]
    assert results["fsdp2"][1] == pytest.approx(ddp, rel=1e-5)
    assert results["zero"][1] == pytest.approx(ddp, rel=1e-5)
