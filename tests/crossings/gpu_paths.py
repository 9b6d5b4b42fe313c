"""The ``gpu_paths`` backend column: a cell run on the paths a GPU takes, on the CPU.

The policy rule, the clip's finalize, ``stats()`` and ``SkipAwareLR.step`` are one program on every
device (the ``triton`` cells run their kernels too). A few reads stay where a read on the CPU waits
for nothing (``host_reads.are_free``): a rank mismatch raised at once, the torch backend's norm
fallback. This column runs a GPU's paths for those too, and checks no other read happens:
``host_reads.are_free`` answers False (as the ``forbid_host_reads`` fixture does) and the scaler's
backend is ``"triton"`` (the kernels through the interpreter). The oracle is the CPU cell's,
unchanged: the GPU paths must give the same answers.

Inside the step (``STEP_METHODS``: the scaler's calls of an iteration and the loop pieces' records)
every Tensor -> host read raises, naming itself and where it was read, except the reads the docs
name (``DOCUMENTED_READS``) and StepLog's of its host ring, which are no reads of a device value
(``host_reads.HostRingReads``). The harness's own read-outs around the step (``get_scale()``,
``last_step_skipped()``, the comparisons) are not the step and stay free.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.host_reads import SYNCING, HostRingReads

import tritonscale
from tritonscale import host_reads

#: The calls that make up a step on the GPU paths: none may read a device value on the host.
STEP_METHODS = (
    (tritonscale.GradScaler, ("scale", "unscale_", "clip_grad_norm_", "step", "update", "stats")),
    (tritonscale.SkipAwareLR, ("step",)),
    (tritonscale.StepLog, ("record",)),
    (tritonscale.AppliedSteps, ("record",)),
    (tritonscale.ScaleHistory, ("record",)),
    (tritonscale.LossScaleOptimizer, ("step",)),
)

ROOT = Path(__file__).resolve().parents[2]


def _needs_host_check(frame) -> bool:
    policy = frame.f_locals.get("policy")
    return policy is not None and policy.needs_host_check()


#: (file under the repository, function) -> (why the read is allowed, a condition on the reading frame).
DOCUMENTED_READS = {
    # docs/architecture.md, "The fold": other optimizers cost one host read of the skip flag in step.
    ("tritonscale/flags.py", "read_flag"): ("a plain optimizer's one skip read", lambda frame: True),
    # The same read where the rank checks may hold a mismatch, and a disabled scaler's plain step.
    ("tritonscale/passes/rank_validation.py", "read_skip"): ("a plain optimizer's one skip read", lambda frame: True),
    # docs/architecture.md, the rule "On a GPU": the opt-in checks that must stop a run add one read.
    ("tritonscale/policy/runner.py", "_kernel_update_"): ("an opt-in host check's one read", _needs_host_check),
    ("tritonscale/policy/runner.py", "_host_check"): ("an opt-in host check's one read", _needs_host_check),
    # docs/training-loop.md: a float learning rate can only be set from the host (one read a step).
    ("tritonscale/loop/lr_schedules.py", "_write_lrs"): ("SkipAwareLR's one read for a float lr", lambda frame: True),
    # An optimizer of one's own on torch's amp protocol reads found_inf itself (the user's code).
    ("tests/crossings/twins.py", "step"): ("AmpScalingSGD's own found_inf read", lambda frame: True),
}


class StepGuard:
    """While armed (inside a STEP_METHODS call, at any depth), each Tensor method of SYNCING raises
    AssertionError naming itself and its caller, unless the caller is a DOCUMENTED_READS site or the
    tensor is host memory (``HostRingReads``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.depth = 0
        self.host_memory = HostRingReads(monkeypatch.setattr)
        for name in SYNCING:
            monkeypatch.setattr(torch.Tensor, name, self._guarded(name, getattr(torch.Tensor, name)))
        for owner, names in STEP_METHODS:
            for name in names:
                monkeypatch.setattr(owner, name, self._arming(getattr(owner, name)))

    def _guarded(self, name: str, original):
        def guard(tensor, *args, **kwargs):
            if self.depth and not self.host_memory.allows(tensor):
                self.check(name, sys._getframe(1))
            return original(tensor, *args, **kwargs)

        return guard

    def _arming(self, method):
        @functools.wraps(method)
        def armed(*args, **kwargs):
            self.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1

        return armed

    @staticmethod
    def check(name: str, frame) -> None:
        where = Path(frame.f_code.co_filename).resolve()
        site = (where.relative_to(ROOT).as_posix() if where.is_relative_to(ROOT) else str(where), frame.f_code.co_name)
        allowed = DOCUMENTED_READS.get(site)
        if allowed is None or not allowed[1](frame):
            raise AssertionError(
                f"host read Tensor.{name} inside the step on the GPU paths, at {site[0]}:{frame.f_lineno} "
                f"({site[1]}); the documented ones: {sorted({reason for reason, _ in DOCUMENTED_READS.values()})}"
            )


@contextlib.contextmanager
def gpu_paths() -> Iterator[StepGuard]:
    """The GPU paths on the CPU, with the step's host-read guard, for the length of a cell."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(host_reads, "are_free", lambda device: False)
        yield StepGuard(monkeypatch)
