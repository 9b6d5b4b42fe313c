"""Rows for the loop around the scaler (tritonscale/loop/): SkipAwareLR after every iteration of the
clip row, against the same torch scheduler on the twin stepped only where the twin's step was
applied (Megatron-LM's rule). A tensor lr (fused AdamW: set on the device) and a float lr (SGD).
Handed out: each group's rate (kept, so a view of the group's lr would be caught) and the count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import lr_scheduler

import tritonscale

from .entry_points import EntryPoint, Observations, clip_oracle, clip_ours
from .twins import STEPS, Side


def warmup_then_steps(optimizer: torch.optim.Optimizer) -> lr_scheduler.SequentialLR:
    """A warm-up over the overflows (steps 2 and 3), then halving every two applied steps."""
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=4)
    return lr_scheduler.SequentialLR(optimizer, [warmup, lr_scheduler.StepLR(optimizer, 2, 0.5)], milestones=[4])


def skip_aware_setup(tensor_lr: bool) -> Callable[[Side], None]:
    def setup(side: Side) -> None:
        if tensor_lr:  # torch's fused AdamW takes a tensor lr; SkipAwareLR then writes it on the device
            for group in side.optimizer.param_groups:
                group["lr"] = torch.tensor(group["lr"])
        schedule = warmup_then_steps(side.optimizer)
        if side.ours:
            schedule = tritonscale.SkipAwareLR(schedule, side.scaler, total_steps=STEPS)
        side.objects["scheduler"] = schedule

    return setup


def skip_aware_ours(side: Side, step: int) -> Observations:
    seen = clip_ours(side, step)
    scheduler = side.objects["scheduler"]
    scheduler.step()
    rates = {f"lr{i}": lr for i, lr in enumerate(scheduler.get_last_lr())}
    return {**seen, "rates": rates, "applied_steps": scheduler.applied_steps}


def skip_aware_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle(side, step)
    if not side.found:
        side.objects["scheduler"].step()
    rates = {f"lr{i}": float(group["lr"]) for i, group in enumerate(side.optimizer.param_groups)}
    return {**expected, "rates": rates, "applied_steps": step + 1 - side.skipped_steps}


LOOP_ROWS = [
    EntryPoint("SkipAwareLR", "fused_adamw", skip_aware_ours, skip_aware_oracle, setup=skip_aware_setup(True)),
    EntryPoint(
        "SkipAwareLR_float_lr",
        "sgd",
        skip_aware_ours,
        skip_aware_oracle,
        setup=skip_aware_setup(False),
        grads_after=True,
    ),
]
