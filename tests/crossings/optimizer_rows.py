"""Rows about the optimizers a scaler serves and what it tells about them: two optimizers on one
scaler, every read-out of an iteration, torch's setters mid-run, and an iteration abandoned and
run again. Each against the twin (torch's scaler, or the policy column's rule).
"""

from __future__ import annotations

import pytest
import torch
from oracles.scaler_twins import Snapshot

from tritonscale import ScalerConfigError

from .entry_points import EntryPoint, Observations, backward, clip_oracle, clip_ours
from .twins import (
    FLOOR,
    FOLDING,
    OPTIMIZERS,
    Side,
    optimizer_stage,
    rule_step_update,
    step_args,
    torch_clip,
    torch_found_inf,
    torch_step_update,
)

SPLIT = 2  # optimizer A holds the first two parameters, B (fused AdamW: it folds) the others


# ------------------------------------------------------------------------ two optimizers
def two_optimizers_setup(side: Side) -> None:
    """A: the row's optimizer over the first parameters (the overflow is written to one of them),
    B: a fused AdamW over the rest; one scaler serves both."""
    params = side.params()
    side.optimizer = OPTIMIZERS[side.cell.row.optimizer](params[:SPLIT])
    side.objects["b"] = OPTIMIZERS["fused_adamw"](params[SPLIT:])


def both(side: Side) -> tuple:
    return side.optimizer, side.objects["b"]


def two_optimizers_ours(side: Side, step: int) -> Observations:
    """Clip A, clip B, step both, one update. Under a rule that keeps one optimizer's norm
    history, B's clip must be refused with nothing changed (issue 39 item 1): B is then unscaled
    instead, so the run goes on."""
    a, b = both(side)
    backward(side, step)
    scaler, max_norm = side.scaler, step_args(step)[0]
    seen = {"norm_a": scaler.clip_grad_norm_(a, max_norm)}
    if side.cell.policy.norm_history and scaler.is_enabled():
        before = Snapshot.take(side.params(), [a, b], scaler)
        with pytest.raises(ScalerConfigError, match="optimizer"):
            scaler.clip_grad_norm_(b, max_norm)
        Snapshot.take(side.params(), [a, b], scaler).assert_same(before)
        scaler.unscale_(b)
    else:
        seen["norm_b"] = scaler.clip_grad_norm_(b, max_norm)
    scaler.step(a)
    scaler.step(b)
    scaler.update()
    return seen


def two_optimizers_oracle(side: Side, step: int) -> Observations:
    a, b = both(side)
    backward(side, step)
    scaler, max_norm = side.scaler, step_args(step)[0]
    expected = {"norm_a": torch_clip(side, max_norm, 2.0, a)}
    if side.cell.policy.norm_history and scaler.is_enabled():
        scaler.unscale_(b)
    else:
        expected["norm_b"] = torch_clip(side, max_norm, 2.0, b)
    if not scaler.is_enabled():  # ours skips an optimizer whose own clip found inf/NaN
        outcome = [(not torch.isfinite(n).item(), None) for n in (expected["norm_a"], expected.get("norm_b"))]
        for optimizer, (found, _) in zip((a, b), outcome):
            if not found:
                optimizer.step()
    elif side.rule is None:
        outcome = [(torch_found_inf(scaler, o), None) for o in (a, b)]
        scaler.step(a)
        scaler.step(b)
        scaler.update()
        scaler._scale.clamp_(min=FLOOR)  # ours' documented floor
    else:
        outcome = rule_step_update(side, [(a, expected["norm_a"], None), (b, expected.get("norm_b"), None)], None)
    side.found = any(found for found, _ in outcome)
    side.skipped_now = any(found if skipped is None else skipped for found, skipped in outcome)
    side.count(side.skipped_now)
    return expected


# ---------------------------------------------------------------------------- read-outs
def readouts_ours(side: Side, step: int) -> Observations:
    """Every read-out of an iteration, where a torch user reads it: the stage and what the clip
    folded (before the step), the settings and the scale (after the update)."""
    backward(side, step)
    scaler, optimizer = side.scaler, side.optimizer
    norm = scaler.clip_grad_norm_(optimizer, *step_args(step))
    stage = scaler.optimizer_stage(optimizer)
    seen = {"norm": norm, "stage": None if stage is None else stage.name, "folds": scaler.folds_clip_into(optimizer)}
    folded = scaler.folded_grad_scale(optimizer)
    if folded is not None:  # the README's recipe: p.grad / folded are the values the step applies
        seen.update({f"applied{i}": p.grad / folded for i, p in enumerate(side.params())})
    scaler.step(optimizer)
    scaler.update()
    seen.update(settings(scaler), backend=scaler.backend, process_group=scaler.process_group)
    seen.update(fold_into_optimizer=scaler.fold_into_optimizer, policy_interval=scaler.get_policy().growth_interval)
    return seen


def readouts_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle_with_stage(side, step)
    answers = settings(side.scaler)
    # torch's factors are not a rule's, and a disabled torch scaler has none (AttributeError; ours
    # answers its constructor's): the scale and whether it is enabled only.
    if side.rule is not None or not side.scaler.is_enabled():
        answers = {name: answers[name] for name in ("get_scale", "is_enabled")}
    policy = side.cell.policy.kwargs().get("policy")  # the column's rule, or the scale context's interval
    interval = getattr(getattr(policy, "policy", policy), "growth_interval", side.cell.scale.growth_interval())
    return {**expected, **answers, "backend": side.cell.scaler_backend(), "process_group": None,
            "fold_into_optimizer": True, "policy_interval": interval}  # fmt: skip


def clip_oracle_with_stage(side: Side, step: int) -> Observations:
    backward(side, step)
    scaler, optimizer = side.scaler, side.optimizer
    norm = torch_clip(side, *step_args(step))
    enabled = scaler.is_enabled()
    expected = {"norm": norm, "stage": optimizer_stage(scaler, optimizer)}
    folds = enabled and side.cell.row.optimizer in FOLDING
    expected["folds"] = folds
    if folds and not torch_found_inf(scaler, optimizer):
        expected.update({f"applied{i}": p.grad.clone() for i, p in enumerate(side.params())})
    torch_step_update(side, norm)
    return expected


def settings(scaler) -> dict:
    """The settings torch's scaler also answers (with its meaning, or its error: a disabled torch
    scaler has no factors), and whether it is enabled."""
    answers = {}
    for name in ("get_scale", "is_enabled", "get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        try:
            answers[name] = getattr(scaler, name)()
        except Exception as error:  # noqa: BLE001 - compared with torch's error by its type
            answers[name] = type(error).__name__
    return answers


# ------------------------------------------------------------------------ torch's setters
SET_AT = 4


def setters_ours(side: Side, step: int) -> Observations:
    """torch's setters mid-run (a schedule of the scaler's own knobs), on both sides alike."""
    set_knobs(side.scaler, step)
    return clip_ours(side, step)


def setters_oracle(side: Side, step: int) -> Observations:
    set_knobs(side.scaler, step)
    return clip_oracle(side, step)


def set_knobs(scaler, step: int) -> None:
    if step == SET_AT:
        scaler.set_growth_factor(4.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(3)


# ------------------------------------------------------------------------ an abandoned iteration
ABANDON_AT = (1, 6)  # before an overflow, and after the round-trip step


def abandon_ours(side: Side, step: int) -> Observations:
    """At ABANDON_AT: a snapshot, the iteration run to its update, then abandoned (the snapshot
    put back and the parameters restored by the loop, as a framework that retries does), and run
    again; the twin runs it once."""
    if step in ABANDON_AT:
        snapshot, params = side.scaler.snapshot(), [p.detach().clone() for p in side.params()]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in side.optimizer.state.items()}
        clip_ours(side, step)
        side.scaler.abandon_iteration(side.optimizer, snapshot)
        with torch.no_grad():
            for p, saved in zip(side.params(), params):
                p.copy_(saved)
        for key, values in state.items():
            side.optimizer.state[key].update(values)
    return clip_ours(side, step)


OPTIMIZER_ROWS = [
    EntryPoint(
        "two_optimizers", "sgd", two_optimizers_ours, two_optimizers_oracle, setup=two_optimizers_setup, narrow=True
    ),
    EntryPoint("read-outs", "fused_adamw", readouts_ours, readouts_oracle, narrow=True),
    EntryPoint("read-outs_sgd", "sgd", readouts_ours, readouts_oracle, grads_after=True, narrow=True),
    EntryPoint(
        "torch_setters", "sgd", setters_ours, setters_oracle, disabled=False, policies=lambda p: p.default, narrow=True
    ),
    EntryPoint("abandon_iteration", "sgd", abandon_ours, clip_oracle, disabled=False, grads_after=True, narrow=True),
]
