"""Rows for the loop around the scaler (tritonscale/loop/): SkipAwareLR after every iteration of the
clip row, against the same torch scheduler on the twin stepped only where the twin's step was
applied (Megatron-LM's rule). A tensor lr (fused AdamW: set on the device) and a float lr (SGD).
Handed out: each group's rate (kept, so a view of the group's lr would be caught) and the count.
``SkipAwareLR_stepped_by_hand``: the wrapped scheduler stepped by hand once (the newcomer's loop),
``step()`` refused changing nothing, then the fix the refusal names: the run goes on at the twin's rates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import lr_scheduler

import tritonscale

from .entry_points import EntryPoint, Observations, clip_oracle, clip_ours
from .twins import STEPS, Side, torch_stats


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
    if not side.skipped_now:
        side.objects["scheduler"].step()
    rates = {f"lr{i}": float(group["lr"]) for i, group in enumerate(side.optimizer.param_groups)}
    return {**expected, "rates": rates, "applied_steps": step + 1 - side.skipped_steps}


HAND_STEP = 3  # an overflow step of the default contexts: the hand step's rate differs from the twin's


def hand_stepped_ours(side: Side, step: int) -> Observations:
    """At HAND_STEP the wrapped scheduler is stepped by hand before SkipAwareLR.step(): refused, with
    every rate and the state as the hand step left them; then step() again (the call removed)."""
    if step != HAND_STEP:
        return {**skip_aware_ours(side, step), "refused": False, "unchanged": True}
    seen = clip_ours(side, step)
    scheduler = side.objects["scheduler"]
    scheduler.scheduler.step()  # the call left in the loop
    before = ([lr.clone() if isinstance(lr, torch.Tensor) else lr for lr in scheduler.get_last_lr()],
              str(scheduler.state_dict()))  # fmt: skip
    try:
        scheduler.step()
        refused = False
    except RuntimeError as error:
        refused = "stepped by hand" in str(error)
    after = scheduler.get_last_lr(), str(scheduler.state_dict())
    unchanged = after[1] == before[1] and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(after[0], before[0], strict=True)
    )
    scheduler.step()  # the fix the refusal names
    rates = {f"lr{i}": lr for i, lr in enumerate(scheduler.get_last_lr())}
    counted = {"applied_steps": scheduler.applied_steps, "refused": refused, "unchanged": unchanged}
    return {**seen, "rates": rates, **counted}


def hand_stepped_oracle(side: Side, step: int) -> Observations:
    return {**skip_aware_oracle(side, step), "refused": step == HAND_STEP, "unchanged": True}


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
    EntryPoint(
        "SkipAwareLR_stepped_by_hand",
        "fused_adamw",
        hand_stepped_ours,
        hand_stepped_oracle,
        setup=skip_aware_setup(True),
        policies=lambda p: p.default,
        narrow=True,
    ),
]


# ------------------------------------------------------------------ logging without a sync
LOG_DELAY = 2


def logged(side: Side, step: int, rows: list) -> Observations:
    """What a StepLog handed out this step, by the step each row belongs to (norms as tensors, as
    the harness compares norms)."""
    return {f"log{s}": {k: torch.tensor(v) if k == "norm" else v for k, v in values.items()} for s, values in rows}


def step_log_setup(side: Side) -> None:
    side.objects["log"] = tritonscale.StepLog(delay=LOG_DELAY) if side.ours else []


def step_log_ours(side: Side, step: int) -> Observations:
    """``StepLog.record`` after every update; the rows ``ready()`` hands out (``flush()`` at the
    end) against the twin's stats of those steps."""
    seen = clip_ours(side, step)
    log = side.objects["log"]
    log.record(side.scaler, step)
    rows = log.ready() + (log.flush() if step == STEPS - 1 else [])
    return {**seen, **logged(side, step, rows)}


def step_log_oracle(side: Side, step: int) -> Observations:
    """The rows due: each step's stats once LOG_DELAY later records exist, every row left at the end."""
    expected = clip_oracle(side, step)
    history = side.objects["log"]
    history.append(torch_stats(side, expected["norm"], side.found))
    handed = side.objects.get("handed", 0)
    due = len(history) if step == STEPS - 1 else max(handed, len(history) - LOG_DELAY)
    side.objects["handed"] = due
    return {**expected, **{f"log{s}": history[s] for s in range(handed, due)}}


def applied_setup(side: Side) -> None:
    if side.ours:
        side.objects["applied"] = tritonscale.AppliedSteps()


def applied_ours(side: Side, step: int) -> Observations:
    seen = clip_ours(side, step)
    applied = side.objects["applied"]
    applied.record(side.scaler)
    return {**seen, "skipped": applied.skipped(), "count": applied.count}


def applied_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle(side, step)
    return {**expected, "skipped": side.skipped_now, "count": step + 1 - side.skipped_steps}


def history_setup(side: Side) -> None:
    side.objects["history"] = tritonscale.ScaleHistory() if side.ours else []


def history_ours(side: Side, step: int) -> Observations:
    """``ScaleHistory.record`` every step; its lists at the end against the twin's scales and skips."""
    seen = clip_ours(side, step)
    side.objects["history"].record(side.scaler)
    if step < STEPS - 1:
        return seen
    lists = side.objects["history"].to_lists()
    return {**seen, "scales": lists["scale"], "skips": [int(s) for s in lists["skipped"]]}


def history_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle(side, step)
    side.objects["history"].append((side.scaler.get_scale(), int(side.skipped_now)))
    if step < STEPS - 1:
        return expected
    scales, skips = zip(*side.objects["history"])
    return {**expected, "scales": list(scales), "skips": list(skips)}


LOOP_ROWS += [
    EntryPoint("StepLog", "fused_adamw", step_log_ours, step_log_oracle, setup=step_log_setup, disabled=False),
    EntryPoint("AppliedSteps", "sgd", applied_ours, applied_oracle, setup=applied_setup, grads_after=True),
    EntryPoint("ScaleHistory", "fused_adamw", history_ours, history_oracle, setup=history_setup, disabled=False),
]
