"""The controller reads top-down: each call visits the stage modules in order, each once.

The controller is the class (``scaler/grad_scaler.py``) and the per-optimizer objects of its
iterations (``scaler/optimizer_step.py``); a profiler records which other tritonscale modules they
call, in order (consecutive calls into one module are one visit). A module visited again means
the path went back to an earlier stage. Two returns are the design, and named:
``passes/step_protocols.py`` decides the optimizer's kind before the passes and hands it the step
(or, for a folded clip, guards its direct step) after them; a clip checks the norm history's
owner (``scaler/norm_history.py``) before anything changes and claims it after the pass.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import tritonscale
from tritonscale import GradScaler

#: The controller: the class and the per-optimizer objects of its iterations (calls between them
#: are its own).
CONTROLLER = ("scaler/grad_scaler.py", "scaler/optimizer_step.py")
#: The returns the design makes, per call (see the module docstring).
EXPECTED_RETURNS = {
    "unscale_": set(),
    "clip_grad_norm_": {"passes/step_protocols.py", "scaler/norm_history.py"},
    "step": {"passes/step_protocols.py"},
    "step alone": {"passes/step_protocols.py"},  # the pass step() runs itself sits between the two
    "update": set(),
}


#: Where the package's modules live: found from the imported package, not from folder names (a
#: clone is itself a folder named ``tritonscale``). A module is named by its path inside it, the
#: kernels included (``kernels/apply_pass.py``).
_PACKAGE = Path(tritonscale.__file__).resolve().parent


@functools.cache
def _module_of_file(filename: str) -> str | None:
    path = Path(filename).resolve()
    return path.relative_to(_PACKAGE).as_posix() if path.is_relative_to(_PACKAGE) else None


def _module(code) -> str | None:
    """The tritonscale module a code object belongs to, as a path inside the package, or None."""
    return _module_of_file(code.co_filename)


def controller_visits(call) -> list[str]:
    """The tritonscale modules the controller's own methods call during ``call()``, in order."""
    visits: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None or frame.f_code.co_name.startswith("<"):
            return
        caller, callee = _module(frame.f_back.f_code), _module(frame.f_code)
        if caller in CONTROLLER and callee is not None and callee not in CONTROLLER:
            if not visits or visits[-1] != callee:
                visits.append(callee)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return visits


def _iteration(optimizer_kind: str, until: str):
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    if optimizer_kind == "fused":
        optimizer = torch.optim.AdamW(params, fused=True)
    else:
        optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend="torch")
    scaler.scale(sum(p.sum() for p in params)).backward()
    calls = {
        "unscale_": lambda: scaler.unscale_(optimizer),
        "clip_grad_norm_": lambda: scaler.clip_grad_norm_(optimizer, max_norm=1.0),
        "step": lambda: scaler.step(optimizer),
        "update": scaler.update,
    }
    calls["step alone"] = calls["step"]
    order = {"unscale_": ["unscale_"], "step alone": ["step alone"]}.get(until, ["clip_grad_norm_", "step", "update"])
    for name in order[: order.index(until)]:
        calls[name]()
    return calls[until]


@pytest.mark.parametrize("optimizer_kind", ["fused", "plain"])
@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_", "step", "step alone", "update"])
def test_each_stage_module_is_visited_once(call, optimizer_kind):
    visits = controller_visits(_iteration(optimizer_kind, call))
    assert visits, "the profiler saw the controller call nothing"
    returns = {m for i, m in enumerate(visits) if m in visits[:i]}
    assert returns <= EXPECTED_RETURNS[call], f"{call} goes back to {returns - EXPECTED_RETURNS[call]}: {visits}"


#: A newcomer following one step() reads at most this many of the package's stage modules (the
#: kernels' folder and the leaf helpers aside: the launcher is where the kernel family begins).
MAX_STAGE_MODULES = 12
#: ... and every module whose Python runs, the kernels' launchers and tables and the leaves included.
MAX_MODULES = 19


def step_walk(call) -> list[str]:
    """Every tritonscale module whose Python runs during ``call()``, in first-visit order. Triton
    device code (a kernel body the interpreter runs on the CPU, and the helpers it calls) is not
    counted: on a GPU it is not Python."""

    def device_code(frame) -> bool:
        caller = frame.f_back
        while caller is not None and _module(caller.f_code) is None:
            if "/triton/" in Path(caller.f_code.co_filename).as_posix():
                return True
            caller = caller.f_back
        return False

    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            module = _module(frame.f_code)
            if module is not None and module not in seen and not device_code(frame):
                seen[module] = None

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(seen)


@pytest.mark.parametrize("optimizer_kind", ["fused", "plain"])
def test_one_step_reads_through_few_modules(optimizer_kind):
    """One step() of a second iteration on the Triton backend (the interpreter here), unscaling
    itself: the modules it runs, counted as docs/controller.md counts them."""
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    optimizer = torch.optim.AdamW(params, fused=True) if optimizer_kind == "fused" else torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend="triton")
    walks = []
    for _ in range(2):  # the second iteration: what every step after the first runs
        scaler.scale(sum(p.sum() for p in params)).backward()
        walks.append(step_walk(lambda: scaler.step(optimizer)))
        scaler.update()
        optimizer.zero_grad()
    walk = walks[-1]
    assert "kernels/apply_pass.py" in walk or "kernels/check_pass.py" in walk, f"no kernel launched: {walk}"
    stages = [m for m in walk if not m.startswith("kernels/") and "/" in m]
    assert len(stages) <= MAX_STAGE_MODULES, stages
    assert len(walk) <= MAX_MODULES, walk
