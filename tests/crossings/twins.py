"""The two sides of a cell: ours (a tritonscale object) and its twin (torch.amp.GradScaler +
torch.nn.utils.clip_grad_norm_ on a copy of the model with plain gradients).

The model is a list of parameters with a loss that works for any shapes, so that a context may
resize or retype a parameter in place between steps; its data are drawn per step, so both sides
see the same gradients. The twin's bookkeeping (this iteration's overflow, skip counts) is what
torch does not keep itself and ``stats()`` reports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import tritonscale

#: (6, 5) is resized and (3, 4) retyped by the contexts; (40, 60) spans several blocks of every
#: launch configuration (the stopwatch column); no size is a multiple of 16 (flat buffers pad).
SHAPES = ((6, 5), (7,), (3, 4), (40, 60))
STEPS = 12  # > KEPT_AFTER: values handed out in the first steps are read again 10 steps later
KEPT_AFTER = 10
OVERFLOWS = {2: math.inf, 3: math.nan}  # two in a row: consecutive skips, then recovery
OVERFLOW_AT = (1, 0)  # the parameter and element they are written to (dense in every context)
GROWTH_INTERVAL = 2  # the scale grows and backs off within the run
#: Per step: clips, measures, clips harder, clips lightly, zeroes the gradients (max_norm 0: torch's
#: clip multiplies by 0 and the step goes ahead), clips. Six: every max_norm meets other norm types.
MAX_NORMS = (0.5, 1e3, 0.25, 2.0, 0.0, 1.0)
NORM_TYPES = (2.0, math.inf, 1.0, 2.0, 3.0)  # per step; 3.0 runs with torch ops
#: tritonscale's documented backoff floor (docs/differences-from-torch.md: "the scale never backs
#: off to 0"): torch's backoff goes below it, so the twin's scale is raised to it after update().
FLOOR = 2.0**-126


def step_args(step: int) -> tuple[float, float]:
    """(max_norm, norm_type) of a step's clip: both vary between calls."""
    return MAX_NORMS[step % len(MAX_NORMS)], NORM_TYPES[step % len(NORM_TYPES)]


class Model(torch.nn.Module):
    """Parameters and a per-step loss; with ``sparse`` the first one is an embedding table whose
    gradient is sparse (``F.embedding(..., sparse=True)``)."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.randn(s, generator=g) * 0.5 for s in SHAPES])
        self.sparse = sparse

    def loss(self, step: int) -> torch.Tensor:
        data = step_data(int(step), tuple((tuple(p.shape), p.dtype) for p in self.weights))
        total = torch.zeros(())
        for i, (p, x) in enumerate(zip(self.weights, data)):
            if i == 0 and self.sparse:
                rows = torch.tensor([1, 3, 1, step % p.shape[0]])  # a repeated row: uncoalesced
                used = torch.nn.functional.embedding(rows, p, sparse=True)
                total = total + ((used - x[:4]).float() ** 2).sum() / 2
            else:
                total = total + ((p - x).float() ** 2).sum() * (0.125 * (i + 1))
        return total


@functools.cache
def step_data(step: int, shapes: tuple) -> list[torch.Tensor]:
    """A step's data, per parameter shape and dtype (drawn once: every cell uses them)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in shapes]


class AmpScalingSGD(torch.optim.Optimizer):
    """An optimizer of one's own on torch's ``_step_supports_amp_scaling`` protocol: it divides by
    ``grad_scale`` and skips on ``found_inf`` itself, and takes sparse gradients (it is not fused)."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is not None and float(found_inf) != 0:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad if grad_scale is None else p.grad / grad_scale.to(p.grad.dtype)
                    p.add_(grad.to(p.dtype), alpha=-group["lr"])


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    # No momentum: torch 2.13's fused SGD leaves its momentum buffers uninitialised (torch.empty)
    # when its first step is skipped on found_inf, and the next step reads them.
    "fused_sgd": lambda params: torch.optim.SGD(params, lr=0.1, fused=True),
    # eps of the gradients' order: a wrongly scaled gradient changes the update (with 1e-8 it would not).
    "fused_adamw": lambda params: torch.optim.AdamW(params, lr=0.05, eps=0.1, fused=True),
    "own_amp_scaling": lambda params: AmpScalingSGD(params, lr=0.1),
}
FOLDING = ("fused_sgd", "fused_adamw", "own_amp_scaling")  # clip_grad_norm_ hands them scale / clip_coef
SPARSE_CAPABLE = ("sgd", "own_amp_scaling")


@dataclass
class Side:
    """One side of a cell. ``objects``: what a row or context builds around the scaler (a
    LossScaleOptimizer, an Updater, a manager, flat buffers); ``kept``: ours' handed-out values."""

    ours: bool
    model: Model
    optimizer: torch.optim.Optimizer
    scaler: Any
    cell: Any  # the Cell both sides belong to (contexts, backend)
    objects: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)
    found: bool = False  # the twin's: whether this iteration overflowed
    skipped_now: bool = False  # the twin's: whether this iteration's step was skipped (an overflow or a spike)
    rule: Any = None  # the twin's rule under a policy column (policies.TwinRule); None: torch's GradScaler
    skipped_steps: int = 0  # the twin's count of skipped steps, and of skips in a row
    consecutive_skips: int = 0

    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.weights)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The side's optimizer, and a second one where a row serves two on one scaler."""
        return [self.optimizer, *([self.objects["b"]] if "b" in self.objects else [])]

    def count(self, skipped: bool) -> None:
        self.skipped_steps += int(skipped)
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0


def make_scaler(ours: bool, scale_ctx: Any, backend: str, policy: Any = None) -> Any:
    """A side's scaler: ours with the scale context's arguments, or the policy column's (its rule
    and initial scale, with the context's ``enabled``); the twin's is torch's, whose scale a
    policy's rule then sets after every update."""
    kwargs = scale_ctx.kwargs()
    if ours:
        if policy is not None and not policy.default:
            kwargs = {**policy.kwargs(), "enabled": scale_ctx.enabled}
        return tritonscale.GradScaler("cpu", backend=backend, **kwargs)
    if policy is not None and not policy.default:
        kwargs["init_scale"] = policy.scale_rule().scale
    return torch.amp.GradScaler("cpu", **kwargs)


# ------------------------------------------------------------------ the twin's torch calls
def optimizer_stage(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> str:
    record = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))  # a disabled scaler keeps none
    return "READY" if record is None else record["stage"].name


def torch_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's unscale_/step of this iteration found inf/NaN (read before update())."""
    record = scaler._per_optimizer_states.get(id(optimizer))
    flags = record["found_inf_per_device"].values() if record else ()
    return bool(sum(float(flag) for flag in flags))


def torch_clip(side: Side, max_norm: float, norm_type: float, optimizer: Any = None) -> torch.Tensor:
    """torch's ``unscale_`` (enabled, not yet unscaled) + ``clip_grad_norm_`` of ``optimizer``'s
    parameters (default: the side's optimizer). torch's clip has no sparse kernel: a sparse
    gradient counts by its coalesced values (ours' documented rule)."""
    scaler, optimizer = side.scaler, optimizer or side.optimizer
    if scaler.is_enabled() and optimizer_stage(scaler, optimizer) != "UNSCALED":
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not any(p.grad.is_sparse for p in params):
        if side.rule is None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            unfit_fold_overflows(side, optimizer, norm, max_norm)
            return norm
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)  # torch's clip, in its two halves
        limit = side.rule.clip_limit(float(norm), max_norm)  # once: ZClip's averages take the norm
        unfit_fold_overflows(side, optimizer, norm, limit)
        if math.isfinite(float(norm)) or not side.rule.applies_overflow:
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
        # else: a rule whose overflowed steps go ahead applies the unscaled gradients, unclipped
        # (docs/differences-from-torch.md: "An overflowed clip_grad_norm_ leaves ...")
        return norm
    for p in params:
        p.grad = p.grad.coalesce() if p.grad.is_sparse else p.grad
    values = [p.grad.values() if p.grad.is_sparse else p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(values, norm_type)
    torch._foreach_mul_(values, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    unfit_fold_overflows(side, optimizer, norm, max_norm)
    return norm


def unfit_fold_overflows(side: Side, optimizer: Any, norm: torch.Tensor, max_norm: float) -> None:
    """docs/differences-from-torch.md, "A fold past float32's max": a fused optimizer's divisor
    ``scale / clip_coef`` that overflows float32 makes the step count as an overflow (skipped, the
    scale backed off), as nothing is read back. The twin's torch scaler is told of that overflow.
    Not for max_norm 0: its divisor scale / 0 = inf is the clip exactly (torch's step of zeros)."""
    fused = getattr(optimizer, "_step_supports_amp_scaling", False) or optimizer.defaults.get("fused")
    if not fused or not side.scaler.is_enabled() or not torch.isfinite(norm):
        return
    clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if clip_coef == 0 or torch.isfinite(side.scaler._scale / clip_coef).all():
        return
    for flag in side.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        flag.fill_(1.0)


def torch_step_update(
    side: Side, norm: torch.Tensor | None = None, new_scale: float | None = None, step: Callable[[], Any] | None = None
) -> bool:
    """torch's step (``step``: another way to step, e.g. ``optimizer.step`` directly) and update;
    returns whether the iteration overflowed. A disabled scaler: torch's plain step, skipped where
    the clip found inf/NaN (ours' documented behaviour for ``enabled=False``)."""
    scaler, optimizer = side.scaler, side.optimizer
    skipped = None
    if not scaler.is_enabled():
        found = norm is not None and not math.isfinite(float(norm))
        if not found:
            optimizer.step()
    elif side.rule is None:
        scaler.step(optimizer) if step is None else step()
        found = torch_found_inf(scaler, optimizer)
        scaler.update(new_scale)
        scaler._scale.clamp_(min=FLOOR)
    else:
        found, skipped = rule_step_update(side, [(optimizer, norm, step)], new_scale)[0]
    side.found = found
    side.skipped_now = found if skipped is None else skipped
    side.count(side.skipped_now)
    return side.skipped_now


def rule_step_update(side: Side, steps: list, new_scale: float | None) -> list[tuple[bool, bool]]:
    """The twin's iteration under a policy column's rule, for each ``(optimizer, norm, step)``:
    torch's ``unscale_`` (if the optimizer is not unscaled yet), the rule's decisions, each step
    unless skipped (``step``: another way to step it), then torch's scale set to the rule's.
    Returns each optimizer's (overflowed, skipped)."""
    scaler, rule = side.scaler, side.rule
    for optimizer, _, _ in steps:
        if optimizer_stage(scaler, optimizer) == "READY":
            scaler.unscale_(optimizer)
    found = [torch_found_inf(scaler, optimizer) for optimizer, _, _ in steps]
    spiked = [rule.spiked(None if norm is None else float(norm)) for _, norm, _ in steps]
    overflow_skips = rule.update(any(found), new_scale)
    outcome = []
    for (optimizer, norm, step), overflowed, spike in zip(steps, found, spiked):
        skipped = (overflowed and overflow_skips) or spike
        if not skipped:
            optimizer.step() if step is None else step()
            rule.stepped(None if norm is None else float(norm))
        outcome.append((overflowed, skipped))
    scaler.update(new_scale=rule.scale)
    return outcome


def torch_stats(side: Side, norm: torch.Tensor | None, found: bool) -> dict[str, Any]:
    """What ``stats()`` must report after this update, from the twin."""
    scaler = side.scaler
    tracker = {} if side.rule is not None else {"growth_tracker": scaler._get_growth_tracker()}  # a rule's own
    return {
        "scale": scaler.get_scale(),
        **tracker,
        "norm": norm if norm is not None else math.nan,
        "found_inf": found,
        "skipped": int(side.skipped_now),
        "skipped_steps": side.skipped_steps,
        "consecutive_skips": side.consecutive_skips,
    }
