"""The rows: each public entry point as one iteration on our side and the same iteration on the
twin (torch's scaler and clip). Each function runs a whole iteration, from the contexts' hooks and
``zero_grad`` to ``update``, and returns what the entry point handed out, by name, next to what
the twin says it must be (tensors, bools, floats, lists; see harness.compare).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from oracles.scaler_twins import Snapshot

import tritonscale
from tritonscale import DynamicLossScaleManager, LossScaleOptimizer, LossScalePolicy, Updater

from .contexts import inject_overflow
from .policies import spike_hook
from .twins import (
    FLOOR,
    OVERFLOWS,
    STEPS,
    Side,
    make_scaler,
    step_args,
    torch_clip,
    torch_found_inf,
    torch_stats,
    torch_step_update,
)

MAX_NORM = 0.5  # the API shapes that take max_norm once (LossScaleOptimizer, Updater)
ROUND_TRIP = 5  # the iteration before which the state_dict round trip and the copy happen
Observations = dict[str, Any]


@dataclass(frozen=True)
class EntryPoint:
    """A row. ``ours``/``oracle``: one iteration on each side; ``setup``: what the row builds
    around the scaler (both sides, after the gradient context). ``grads_after``: the gradients
    after the iteration must equal the twin's (unscaled, clipped; not where the twin found an
    overflow, as ours then leaves them as they came, nor where the clip folds into the optimizer). ``disabled``:
    the row applies to ``enabled=False``; ``min_scale``: to initial scales at least this;
    ``triton``: it runs on the Triton backend too (its passes differ there)."""

    name: str
    optimizer: str
    ours: Callable[[Side, int], Observations]
    oracle: Callable[[Side, int], Observations]
    setup: Callable[[Side], None] | None = None
    grads_after: bool = False
    disabled: bool = True
    min_scale: float = 0.0
    triton: bool = False
    #: Which policy columns the row runs under (None: every one). Rows that build a scaler of their
    #: own (the API shapes) run under the default only; an importer row under its peer's preset.
    policies: Callable[[Any], bool] | None = None
    #: The row runs on the central columns only (plain, flat and accumulated gradients; the
    #: ordinary and floor scales, disabled): what it adds is its own crossing with the policy column.
    narrow: bool = False

    def applies_to(self, policy: Any) -> bool:
        return (
            policy.default
            if self.policies is None and self.builds_scaler
            else (self.policies is None or self.policies(policy))
        )

    @property
    def builds_scaler(self) -> bool:
        return self.name == "LossScaleOptimizer" or self.name.endswith("LossScaleManager")


# ------------------------------------------------------------------------- an iteration's parts
def after_backward(side: Side, step: int) -> None:
    side.cell.grads.after_backward(side, step)
    inject_overflow(side, step)
    spike_hook(side, step)


def backward(side: Side, step: int, scaled_backward: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
    """The contexts' hooks, ``zero_grad``, the scaled backward, the noise and the overflow."""
    side.cell.grads.before_zero_grad(side, step)
    for optimizer in side.optimizers():
        optimizer.zero_grad(set_to_none=side.cell.grads.set_to_none(side))
    loss = side.model.loss(step)
    if scaled_backward is None:
        scaled_backward = lambda micro_loss: side.scaler.scale(micro_loss).backward()
    scaled_backward(loss)
    side.cell.grads.accumulate(side, step, scaled_backward)
    after_backward(side, step)
    return loss.detach()


def clip_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    side.scaler.step(side.optimizer)
    side.scaler.update()
    return {"norm": norm}


def clip_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    norm = torch_clip(side, *step_args(step))
    torch_step_update(side, norm)
    return {"norm": norm}


def unscale_step_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    side.scaler.unscale_(side.optimizer)
    side.scaler.step(side.optimizer)
    side.scaler.update()
    return {}


def unscale_step_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    side.scaler.unscale_(side.optimizer)
    torch_step_update(side)
    return {}


def step_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    side.scaler.step(side.optimizer)
    side.scaler.update()
    return {}


def step_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    torch_step_update(side)
    return {}


# ------------------------------------------------------------------- what update() hands out
def update_ours(side: Side, step: int) -> Observations:
    seen = clip_ours(side, step)
    scaler = side.scaler
    seen.update(last_skip_flag=scaler.last_skip_flag(), last_step_skipped=scaler.last_step_skipped())
    return {**seen, "last_norm": scaler.last_norm()} if scaler.is_enabled() else seen


def update_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle(side, step)
    expected.update(last_skip_flag=side.skipped_now, last_step_skipped=side.skipped_now)
    return {**expected, "last_norm": expected["norm"]} if side.scaler.is_enabled() else expected


def new_scale(side: Side, step: int) -> float:
    """update(new_scale=...)'s value at a step: twice, half or the same as now, within range."""
    return min(max(side.scaler.get_scale() * (2.0, 0.5, 1.0)[step % 3], FLOOR), 2.0**127)


def new_scale_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    side.scaler.step(side.optimizer)
    side.scaler.update(new_scale=new_scale(side, step))
    return {"norm": norm, "stats": side.scaler.stats()}


def new_scale_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    norm = torch_clip(side, *step_args(step))
    torch_step_update(side, norm, new_scale=new_scale(side, step))
    return {"norm": norm, "stats": torch_stats(side, norm, side.found)}


def stats_ours(side: Side, step: int) -> Observations:
    seen = clip_ours(side, step)
    try:
        seen["stats"] = side.scaler.stats()
    except Exception as error:  # noqa: BLE001 - a disabled scaler may refuse, clearly (harness checks)
        seen["stats"] = error
    return seen


def stats_oracle(side: Side, step: int) -> Observations:
    expected = clip_oracle(side, step)
    return {**expected, "stats": torch_stats(side, expected["norm"], side.found)}


def found_inf_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    side.scaler.unscale_(side.optimizer)
    flag, overflowed = side.scaler.found_inf_for(side.optimizer), side.scaler.overflowed(side.optimizer)
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    side.scaler.step(side.optimizer)
    side.scaler.update()
    return {"found_inf": flag, "overflowed": overflowed, "norm": norm}


def found_inf_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    side.scaler.unscale_(side.optimizer)
    found = torch_found_inf(side.scaler, side.optimizer)
    norm = torch_clip(side, *step_args(step))
    torch_step_update(side, norm)
    return {"found_inf": found, "overflowed": found, "norm": norm}


# ------------------------------------------------------------------------ state and API shapes
def round_trip(side: Side) -> None:
    """state_dict() into a new scaler built with the same arguments, between two iterations."""
    saved = side.scaler.state_dict()
    side.scaler = make_scaler(side.ours, side.cell.scale, side.cell.scaler_backend(), side.cell.policy)
    side.scaler.load_state_dict(saved)


def round_trip_ours(side: Side, step: int) -> Observations:
    if step == ROUND_TRIP:
        round_trip(side)
    return clip_ours(side, step)


def round_trip_oracle(side: Side, step: int) -> Observations:
    if step == ROUND_TRIP:
        round_trip(side)
    return clip_oracle(side, step)


def loss_scale_optimizer_setup(side: Side) -> None:
    """Ours: a LossScaleOptimizer built from the scale context's arguments, with an LR schedule;
    the twin: torch's scaler and the same schedule on the plain optimizer."""
    scale_ctx = side.cell.scale
    target = side.optimizer
    if side.ours:
        if scale_ctx.enabled:
            policy = LossScalePolicy(growth_interval=scale_ctx.growth_interval())
            kwargs = {"init_scale": scale_ctx.scale(), "backend": side.cell.scaler_backend()}
            target = LossScaleOptimizer(side.optimizer, policy, max_norm=MAX_NORM, **kwargs)
        else:
            target = LossScaleOptimizer(side.optimizer, max_norm=MAX_NORM, scaler=side.scaler)
        side.scaler = target.scaler
    side.objects.update(lso=target, scheduler=torch.optim.lr_scheduler.StepLR(target, step_size=3, gamma=0.5))


def copy_mid_run(side: Side, step: int) -> None:
    """A deepcopy of model, optimizer (+ scaler) and scheduler mid-run, continued in place of the
    original (plain gradients only: a copy of a flat buffer is another layout, a column of its own)."""
    if step != ROUND_TRIP or side.cell.grads.name != "plain":
        return
    parts = copy.deepcopy((side.model, side.objects["lso"], side.scaler, side.objects["scheduler"]))
    side.model, side.objects["lso"], side.scaler, side.objects["scheduler"] = parts
    side.optimizer = side.objects["lso"].optimizer if side.ours else side.objects["lso"]


def loss_scale_optimizer_ours(side: Side, step: int) -> Observations:
    copy_mid_run(side, step)
    lso = side.objects["lso"]
    backward(side, step, lso.scaled_backward)
    norm = lso.step()
    side.objects["scheduler"].step()
    return {"norm": norm, "step_applied": lso.step_applied, "loss_scale": lso.loss_scale}


def loss_scale_optimizer_oracle(side: Side, step: int) -> Observations:
    copy_mid_run(side, step)
    backward(side, step)
    norm = torch_clip(side, MAX_NORM, 2.0)
    found = torch_step_update(side, norm)
    side.objects["scheduler"].step()
    return {"norm": norm, "step_applied": not found, "loss_scale": side.scaler.get_scale()}


def updater_setup(side: Side) -> None:
    if side.ours:
        side.objects["updater"] = Updater(
            side.model.loss,
            side.optimizer,
            iter(range(STEPS)),
            scaler=side.scaler,
            max_norm=MAX_NORM,
            set_to_none=side.cell.grads.set_to_none(side),
            backward_callback_on_finish=lambda iteration: after_backward(side, iteration),
        )


def updater_ours(side: Side, step: int) -> Observations:
    side.cell.grads.before_zero_grad(side, step)
    result = side.objects["updater"].update()
    return {"loss": result.loss, "norm": result.norm, "skipped": result.skipped}


def updater_oracle(side: Side, step: int) -> Observations:
    loss = backward(side, step)
    norm = torch_clip(side, MAX_NORM, 2.0)
    return {"loss": loss, "norm": norm, "skipped": torch_step_update(side, norm)}


def manager_setup(side: Side) -> None:
    """Ours: MindSpore's DynamicLossScaleManager (factor 2, window W), its grad_scaler driving the
    loop. Above its floor of 1 its rule is torch's with growth_interval=W: the twin's."""
    if side.ours:
        scale_ctx = side.cell.scale
        manager = DynamicLossScaleManager(
            init_loss_scale=scale_ctx.scale(),
            scale_factor=2,
            scale_window=scale_ctx.growth_interval(),
            backend=side.cell.scaler_backend(),
        )
        side.objects["manager"], side.scaler = manager, manager.grad_scaler


def manager_ours(side: Side, step: int) -> Observations:
    return {**clip_ours(side, step), "loss_scale": side.objects["manager"].get_loss_scale()}


def manager_oracle(side: Side, step: int) -> Observations:
    return {**clip_oracle(side, step), "loss_scale": side.scaler.get_scale()}


# ------------------------------------------------------------------------------ traps and tools
def direct_step_ours(side: Side, step: int) -> Observations:
    """A loop that calls ``optimizer.step()`` itself after the clip (torch's recipe allows it
    after unscale_). Ours must step as torch does, or refuse clearly (naming
    ``scaler.step(optimizer)``) with nothing changed; the loop then steps through the scaler.
    Overflow steps go through ``scaler.step`` on both sides (torch's direct step applies inf)."""
    backward(side, step)
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    if step in OVERFLOWS:
        side.scaler.step(side.optimizer)
    else:
        before = Snapshot.take(side.params(), [side.optimizer], side.scaler)
        try:
            side.optimizer.step()
        except Exception as error:  # noqa: BLE001 - a refusal must be clear and change nothing
            assert "scaler.step(" in str(error), f"optimizer.step() refused without naming scaler.step: {error}"
            Snapshot.take(side.params(), [side.optimizer], side.scaler).assert_same(before)
            side.scaler.step(side.optimizer)
    side.scaler.update()
    return {"norm": norm}


def direct_step_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    norm = torch_clip(side, *step_args(step))
    # An overflow (injected, or the scaled backward's own near float32's max) goes through
    # scaler.step on both sides: torch's direct step would apply the inf/NaN.
    overflowed = step in OVERFLOWS or (side.scaler.is_enabled() and torch_found_inf(side.scaler, side.optimizer))
    torch_step_update(side, norm, step=None if overflowed else side.optimizer.step)
    return {"norm": norm}


#: torch's unscale_ refusal, which ours' clip after a direct step without update() must begin with.
UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."


def direct_steps_ours(side: Side, step: int) -> Observations:
    """A loop that clips and calls ``optimizer.step()`` itself, with neither ``scaler.step`` nor
    ``update()`` (the issue's new user): from its second iteration the clip must refuse as torch's
    ``unscale_`` does, naming the fix, with nothing changed. The loop then takes the fix: update()
    ends the stale iteration, and this one clips and steps through the scaler. Even iterations step
    directly (but an overflow, which goes through scaler.step on both sides: torch's direct step
    would apply the inf/NaN); odd ones after a direct step are refused first. Enabled scalers only
    (a disabled one unscales nothing: torch's unscale_ refuses nothing there either)."""
    backward(side, step)
    if side.objects.pop("stale", False):
        before = Snapshot.take(side.params(), [side.optimizer], side.scaler)
        try:
            side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
        except RuntimeError as error:
            message = str(error)
            assert message.startswith(UNSCALED_TWICE), f"not torch's refusal: {message}"
            assert "scaler.step(optimizer)" in message and "scaler.update()" in message, message
        else:
            raise AssertionError("a clip after a direct optimizer.step() with no update() went ahead")
        Snapshot.take(side.params(), [side.optimizer], side.scaler).assert_same(before)
        side.scaler.update()
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    if step % 2 == 0 and not (step in OVERFLOWS or side.scaler.overflowed(side.optimizer)):
        side.optimizer.step()
        side.objects["stale"] = True
    else:
        side.scaler.step(side.optimizer)
        side.scaler.update()
    return {"norm": norm}


def direct_steps_oracle(side: Side, step: int) -> Observations:
    """torch's run of the same loop, unscale_ + clip each iteration: its unscale_ after a direct
    step raises; update() then ends the stale iteration."""
    backward(side, step)
    if side.objects.pop("stale", False):
        try:
            side.scaler.unscale_(side.optimizer)
        except RuntimeError as error:
            assert str(error) == UNSCALED_TWICE, str(error)
        else:
            raise AssertionError("torch's unscale_ after a direct step went ahead")
        side.found = torch_found_inf(side.scaler, side.optimizer)  # the stale iteration's, applied anyway
        side.count(False)
        side.scaler.update()
        side.scaler._scale.clamp_(min=FLOOR)
    norm = torch_clip(side, *step_args(step))
    # An overflow (injected, or the scaled backward's own near float32's max) goes through scaler.step.
    if step % 2 == 0 and not (step in OVERFLOWS or torch_found_inf(side.scaler, side.optimizer)):
        side.optimizer.step()
        side.objects["stale"], side.found = True, False
    else:
        torch_step_update(side, norm)
    return {"norm": norm}


def nonfinite_names_of(model: torch.nn.Module) -> list[str]:
    """The twin's answer: parameters whose gradient (its stored values, if sparse) holds inf/NaN."""
    names = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            values = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            if not bool(values.isfinite().all()):
                names.append(name)
    return names


def nonfinite_ours(side: Side, step: int) -> Observations:
    backward(side, step)
    names = tritonscale.nonfinite_grads(side.model)
    norm = side.scaler.clip_grad_norm_(side.optimizer, *step_args(step))
    side.scaler.step(side.optimizer)
    side.scaler.update()
    return {"nonfinite": names, "norm": norm}


def nonfinite_oracle(side: Side, step: int) -> Observations:
    backward(side, step)
    names = nonfinite_names_of(side.model)
    norm = torch_clip(side, *step_args(step))
    torch_step_update(side, norm)
    return {"nonfinite": names, "norm": norm}


ENTRY_POINTS = [
    EntryPoint("clip_grad_norm_", "sgd", clip_ours, clip_oracle, grads_after=True, triton=True),
    EntryPoint("clip_grad_norm_fold_adamw", "fused_adamw", clip_ours, clip_oracle, triton=True),
    EntryPoint("clip_grad_norm_fold_sgd", "fused_sgd", clip_ours, clip_oracle),
    EntryPoint("clip_grad_norm_fold_own_optimizer", "own_amp_scaling", clip_ours, clip_oracle),
    EntryPoint(
        "unscale_+step", "sgd", unscale_step_ours, unscale_step_oracle, grads_after=True, disabled=False, triton=True
    ),
    EntryPoint("step", "sgd", step_ours, step_oracle, grads_after=True, disabled=False),
    EntryPoint("step_fused", "fused_adamw", step_ours, step_oracle, disabled=False),
    EntryPoint("update", "sgd", update_ours, update_oracle, grads_after=True),
    EntryPoint(
        "update(new_scale)",
        "fused_adamw",
        new_scale_ours,
        new_scale_oracle,
        disabled=False,
        policies=lambda policy: policy.torch_scale_rule,
    ),
    EntryPoint("stats()", "fused_adamw", stats_ours, stats_oracle),
    EntryPoint("found_inf_for+overflowed", "sgd", found_inf_ours, found_inf_oracle, grads_after=True, disabled=False),
    EntryPoint("state_dict_round_trip", "fused_adamw", round_trip_ours, round_trip_oracle),
    EntryPoint(
        "LossScaleOptimizer",
        "sgd",
        loss_scale_optimizer_ours,
        loss_scale_optimizer_oracle,
        setup=loss_scale_optimizer_setup,
        grads_after=True,
    ),
    EntryPoint("Updater", "fused_adamw", updater_ours, updater_oracle, setup=updater_setup),
    EntryPoint(
        "DynamicLossScaleManager",
        "sgd",
        manager_ours,
        manager_oracle,
        setup=manager_setup,
        grads_after=True,
        disabled=False,
        min_scale=1.0,
    ),
    EntryPoint("clip+optimizer.step()", "fused_sgd", direct_step_ours, direct_step_oracle),
    EntryPoint(
        "clip+optimizer.step()_without_update",
        "sgd",
        direct_steps_ours,
        direct_steps_oracle,
        grads_after=True,
        disabled=False,
        policies=lambda policy: policy.default,
    ),
    EntryPoint("nonfinite_grads", "sgd", nonfinite_ours, nonfinite_oracle, grads_after=True),
]
