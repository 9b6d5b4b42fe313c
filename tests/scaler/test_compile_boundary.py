"""compile_boundary.py: the scaler's calls run eagerly inside a compiled caller, and cost no Dynamo
import (nor a Dynamo frame switch) while nothing compiles."""

from __future__ import annotations

import subprocess
import sys

import torch

from tritonscale.scaler.step_protocols import guard_direct_step
from tritonscale.scaler.compile_boundary import runs_eagerly


def test_importing_and_making_a_scaler_imports_no_dynamo():
    """``import tritonscale``, a scaler and its first scale() never import torch._dynamo: Dynamo
    costs about a second to import and is needed only to compile. (torch.optim.Optimizer's
    constructor imports it itself, so a step is not part of this.)"""
    code = (
        "import sys, torch, tritonscale\n"
        "s = tritonscale.GradScaler('cpu', backend='torch')\n"
        "s.scale(torch.ones(4).sum()); s.get_scale(); s.state_dict()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_fold_guard_carries_torchs_constant_mark():
    """guard_direct_step is marked as torch.compiler.assume_constant_result marks a function,
    without the import that decorator costs."""

    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    torch_marks = {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")}
    assert torch_marks, "torch's decorator sets no mark this test knows"
    assert {k: vars(guard_direct_step).get(k) for k in torch_marks} == torch_marks


def test_a_marked_call_runs_eagerly_inside_a_compiled_caller():
    """Inside a compiled function the call graph-breaks and runs eagerly (its body and what it
    calls are not traced: a host read there would fail a fullgraph trace), and outside it is the
    plain call."""
    seen = []

    @runs_eagerly
    def eager(x):
        seen.append(torch.compiler.is_compiling())
        return x + float(x.sum().item())  # a host read: fine eagerly

    def caller(x):
        return eager(x * 2) + 1

    x = torch.ones(3)
    expected = caller(x)
    compiled = torch.compile(caller, backend="aot_eager")
    assert torch.equal(compiled(x), expected)
    assert seen == [False, False]
