"""What a CUDA graph needs of the whole scaled step, proved on the CPU along the paths a GPU takes.

A CUDA graph records the kernels of one step and replays them: the replay runs no Python, so the
step must (1) read nothing on the host, (2) issue the same ops on every step, whatever the device
values are (a Python branch on a skip or a growth would be frozen at capture), and (3) keep the
state it carries from step to step at fixed addresses, updated in place. The step here is the
whole iteration: forward, scale, backward, clip_grad_norm_ folded into fused AdamW, step, update,
over normal steps, an overflow (skip and backoff) and growth, and SkipAwareLR.step after it (a tensor
lr, its counts on the device). The replay itself needs a GPU:
tests/test_gpu.py.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tritonscale import GradScaler, SkipAwareLR

STEPS = 8
OVERFLOW = 4


class OpRecorder(TorchDispatchMode):
    """Records each aten op the step dispatches, with its tensor arguments' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        signature = [
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
        ]
        self.ops.append((str(func), tuple(signature)))
        return func(*args, **kwargs)


def test_the_whole_step_is_fit_for_a_cuda_graph(forbid_host_reads):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)  # a tensor lr: on the device
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend="torch", compile_policy=False)
    schedule = SkipAwareLR(torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5), scaler, total_steps=STEPS + 1)
    x, y = torch.randn(16, 8), torch.randn(16, 4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(optimizer, 0.5)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()  # the learning rate of applied steps, counted on the device

    step()  # the first step makes the lazy state: the scale tensor, the optimizer's moments
    state = {"scale": scaler._scale, "growth tracker": scaler._growth_tracker, "lr": optimizer.param_groups[0]["lr"],
             "applied steps": schedule._count, "schedule calls": schedule._calls}  # fmt: skip
    addresses = {name: t.data_ptr() for name, t in state.items()}
    per_step, scales = [], []
    for i in range(STEPS):
        x[0, 0] = math.inf if i == OVERFLOW else 1.0  # the input a graph would read, written in place
        recorder = OpRecorder()
        with forbid_host_reads.armed(), recorder:
            step()
        per_step.append(recorder.ops)
        scales.append(scaler.get_scale())
    # The device values moved: a skip with a backoff, and growth.
    assert scales[OVERFLOW] < scales[OVERFLOW - 1] and max(scales) > scales[0]
    assert scaler.stats()["skipped_steps"].item() == 1
    assert not any("_local_scalar_dense" in op for op, _ in per_step[0])
    for i, ops in enumerate(per_step[1:], start=1):
        assert ops == per_step[0], f"step {i} issued other ops than step 0"
    # The carried state is the same memory, updated in place.
    assert {name: t.data_ptr() for name, t in state.items()} == addresses
    assert scaler._scale is state["scale"] and scaler._growth_tracker is state["growth tracker"]
    assert schedule.state_dict()["calls"] == STEPS + 1  # every call counted on the device
