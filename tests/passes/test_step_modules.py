"""What the passes of an eager, single-process step enter: no rank code without a process group, no
custom-op module (``custom_ops.py`` is for a traced step), and no backend choice made anew every
step. The clip's signature keeps one name per idea (``ClipRequest``)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from tritonscale import GradScaler
from tritonscale.passes import grad_passes

#: Modules the passes of an eager step with no process group must not call into.
NOT_ENTERED = ("passes/rank_combine.py", "passes/rank_validation.py", "passes/backends/custom_ops.py",
               "passes/backends/__init__.py", "passes/device_copies.py")  # fmt: skip
#: The passes' own modules whose calls are watched (``step_protocols.py`` is the controller's).
WATCHED = ("passes/grad_passes.py", "passes/backends/")


def _calls_out_of_the_passes(call) -> list[tuple[str, str]]:
    """(caller, callee) for every call from a WATCHED module into a NOT_ENTERED one during ``call()``."""
    seen: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if any(w in caller for w in WATCHED) and any(callee.endswith(n) for n in NOT_ENTERED):
            seen.append((caller, f"{callee}:{frame.f_code.co_name}"))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_an_eager_single_process_step_enters_no_rank_or_custom_op_code(backend, fused):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    ours = torch.optim.AdamW(params, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    for _ in range(2):  # the second iteration: what every step after the first costs
        scaler.scale(sum(p.square().sum() for p in params)).backward()
        seen = _calls_out_of_the_passes(lambda: (scaler.clip_grad_norm_(ours, 1.0), scaler.step(ours)))
        scaler.update()
        ours.zero_grad()
    assert seen == []


def test_a_backend_the_device_cannot_run_is_refused_every_time_and_never_kept():
    device = torch.device("meta")  # no Triton there
    for _ in range(2):
        with pytest.raises(RuntimeError, match="backend='triton' cannot run on meta"):
            grad_passes._backend("triton", device)
    assert ("triton", device) not in grad_passes._BACKENDS
    assert type(grad_passes._backend("auto", device)).__name__ == "TorchBackend"


def test_the_clip_takes_one_argument_object_and_one_name_per_idea():
    names = list(inspect.signature(grad_passes.clip_grads).parameters)
    assert len(names) <= 6, names
    assert not {"scale", "loss_scale"} <= set(names), names
    assert {"max_norm", "norm_type", "apply", "fold"}.isdisjoint(names), names
