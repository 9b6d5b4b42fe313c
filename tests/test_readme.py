"""The README stays honest: its Python examples run, and CI runs its test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_python_examples_run():
    blocks = code_blocks("python")
    assert blocks, "the README must show the training-loop example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)
    # The example's loop really ran a scaled, clipped step. (It is seeded: unseeded, about 3% of
    # draws overflow float16 at scale 2**16, the step is skipped and the scale backs off.)
    assert namespace["grad_norm"].dtype == torch.float32
    assert namespace["scaler"].get_scale() == 2.0**16


def test_ci_runs_the_readme_test_command():
    commands = [line.strip() for block in code_blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, "exactly two set-up-included commands: main job and tests"
    main_job, tests = commands
    assert "bench/run_all.py" in main_job and tests.endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci]
