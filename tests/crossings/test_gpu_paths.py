"""The gpu_paths column does what it claims: its cells run the kernels a GPU runs (the update as
the one policy launch, the clip's finalize, SkipAwareLR.step and stats() as one launch each), and
its guard refuses a host read inside the step that the docs do not name."""

from __future__ import annotations

from collections import Counter

import pytest

import tritonscale.loop.lr_schedules
import tritonscale.passes.backends.triton_backend
import tritonscale.policy.runner
import tritonscale.scaler.diagnostics

from .contexts import GRADS, SCALES
from .harness import Cell, run_cell
from .rows import ROWS
from .twins import STEPS, step_args

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")

#: The GPU paths' launchers, by the module whose name the library calls them through.
LAUNCHERS = {
    "update": (tritonscale.policy.runner, "update_policy_state_"),
    "finalize": (tritonscale.passes.backends.triton_backend, "finalize"),
    "advance_lr": (tritonscale.loop.lr_schedules, "advance_lr"),
    "gather_stats": (tritonscale.scaler.diagnostics, "gather_stats"),
}


def gpu_cell(row: str) -> Cell:
    (entry,) = [r for r in ROWS if r.name == row]
    return Cell(entry, GRADS[0], next(s for s in SCALES if s.name == "ordinary"), "gpu_paths")


def counted(monkeypatch) -> Counter:
    calls = Counter()
    for name, (module, attribute) in LAUNCHERS.items():
        original = getattr(module, attribute)

        def launcher(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attribute, launcher)
    return calls


def test_a_gpu_paths_cell_runs_the_kernels_a_gpu_runs(monkeypatch):
    calls = counted(monkeypatch)
    run_cell(gpu_cell("SkipAwareLR"))
    run_cell(gpu_cell("StepLog"))
    # Two cells of STEPS iterations: each update one policy launch, each clip a finalize (but for
    # norm_type 3.0, which runs in torch ops); the SkipAwareLR cell's schedule one launch a step,
    # the StepLog cell's stats() one launch a record.
    kernel_norms = sum(step_args(step)[1] != 3.0 for step in range(STEPS))
    assert calls["update"] == 2 * STEPS and calls["finalize"] == 2 * kernel_norms
    assert calls["advance_lr"] == STEPS and calls["gather_stats"] >= STEPS


def test_a_torch_cell_runs_none_of_them(monkeypatch):
    calls = counted(monkeypatch)
    cell = gpu_cell("SkipAwareLR")
    cell.backend = "torch"
    run_cell(cell)
    assert not calls, f"the CPU cell took the GPU paths: {dict(calls)}"


def test_the_guard_refuses_an_undocumented_host_read_inside_the_step(monkeypatch):
    update = tritonscale.policy.runner.update_policy_state_

    def reads_the_flag(*args, **kwargs):
        result = update(*args, **kwargs)
        result.found_inf.item()  # what a regression on the GPU path would do
        return result

    monkeypatch.setattr(tritonscale.policy.runner, "update_policy_state_", reads_the_flag)
    with pytest.raises(
        AssertionError, match=r"host read Tensor.item inside the step on the GPU paths, at tests/crossings"
    ):
        run_cell(gpu_cell("clip_grad_norm_fold_adamw"))
