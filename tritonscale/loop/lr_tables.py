"""Which torch schedulers ``SkipAwareLR`` wraps, and the table of their learning rates.

A wrapped schedule's learning rate after ``n`` applied steps is whatever torch's own scheduler
gives after ``n`` calls of ``step()``. Rather than a second copy of each rule in closed form
(which differs from torch's recursive arithmetic in the last bits: ``lr * gamma`` applied ``n``
times is not ``lr * gamma ** n``, a tensor learning rate is updated in float32, and SequentialLR
restarts a scheduler at each milestone through its closed form), the table is made by stepping
a twin of the scheduler ``total_steps`` times on the host, once, at construction: the twin is a
shallow copy pointed at a copy of the optimizer's param groups without their parameters, so the
real scheduler and optimizer are untouched. The device then only indexes the table.

Only schedules that are a pure function of the step count can be tabled: ReduceLROnPlateau
(reads a metric), CyclicLR, ChainedScheduler, CosineAnnealingWarmRestarts and unknown subclasses
are refused, with the one-host-read recipe. Example::

    lrs = record_lrs(torch.optim.lr_scheduler.StepLR(opt, step_size=2), total_steps=10)
    lrs[3][0]  # the first group's learning rate after 3 applied steps
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.optim import lr_scheduler as sched

# The torch schedulers whose rate is a pure function of the step count (exact classes, not subclasses).
SUPPORTED = (
    sched.LambdaLR,
    sched.MultiplicativeLR,
    sched.StepLR,
    sched.MultiStepLR,
    sched.ConstantLR,
    sched.LinearLR,
    sched.ExponentialLR,
    sched.PolynomialLR,
    sched.CosineAnnealingLR,
    sched.SequentialLR,
    sched.OneCycleLR,
)
RECIPE = "if not scaler.last_step_skipped(): scheduler.step()"


def supported_names() -> str:
    return ", ".join(cls.__name__ for cls in SUPPORTED)


def check_schedulable(scheduler: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Raise TypeError/ValueError if ``scheduler`` (or a scheduler inside a SequentialLR) cannot be tabled."""
    if type(scheduler) not in SUPPORTED:
        raise TypeError(
            f"SkipAwareLR cannot wrap {type(scheduler).__name__}: it wraps torch's {supported_names()} "
            f"(exact classes; with cycle_momentum=False for OneCycleLR). For any other scheduler, step "
            f"it on applied steps with one host read per step: `{RECIPE}`"
        )
    if optimizer is not None and scheduler.optimizer is not optimizer:
        raise ValueError("SkipAwareLR: every scheduler inside a SequentialLR must drive the same optimizer")
    if isinstance(scheduler, sched.OneCycleLR) and scheduler.cycle_momentum:
        raise ValueError(
            "SkipAwareLR wraps OneCycleLR only with cycle_momentum=False: the cycled momentum/betas are "
            "Python numbers the optimizer reads on the host. Build it with cycle_momentum=False, or step "
            f"it with one host read per step: `{RECIPE}`"
        )
    for inner in getattr(scheduler, "_schedulers", ()):
        check_schedulable(inner, scheduler.optimizer)


def check_total_steps(scheduler: Any, total_steps: int | None) -> int:
    """The number of steps to table: ``total_steps``, or OneCycleLR's own when it is None."""
    limit = scheduler.total_steps if isinstance(scheduler, sched.OneCycleLR) else None
    if total_steps is None and limit is None:
        raise ValueError(
            f"SkipAwareLR needs total_steps= for a {type(scheduler).__name__}: the number of times you will "
            "call its step() (e.g. your loop's number of optimizer steps); its rates are tabled that far"
        )
    total_steps = limit if total_steps is None else total_steps
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"SkipAwareLR: total_steps must be a positive int, got {total_steps!r}")
    if limit is not None and total_steps > limit:
        raise ValueError(f"SkipAwareLR: total_steps={total_steps} is past this OneCycleLR's total_steps={limit}")
    return total_steps


class _ParamGroupsOnly:
    """The optimizer as a scheduler's ``step()`` sees it: a copy of its param groups' hyperparameters
    (tensor ones copied to the CPU), no parameters, and the marks torch's step-order warning reads."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.defaults = dict(optimizer.defaults)
        self.param_groups = [
            {key: _host_copy(value) for key, value in group.items() if key != "params"} | {"params": []}
            for group in optimizer.param_groups
        ]
        self._opt_called = True

    def step(self) -> None:  # never called; present so torch's scheduler does not warn
        pass

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _host_copy(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _twin(scheduler: Any, optimizer: _ParamGroupsOnly) -> Any:
    """A shallow copy of ``scheduler`` (and of those inside a SequentialLR) that drives ``optimizer``:
    stepping it reassigns the copy's counters and leaves the original's alone."""
    twin = copy.copy(scheduler)
    twin.optimizer = optimizer
    if isinstance(scheduler, sched.SequentialLR):
        twin._schedulers = [_twin(inner, optimizer) for inner in scheduler._schedulers]
    return twin


def record_lrs(scheduler: Any, total_steps: int) -> list[list[float | torch.Tensor]]:
    """Each param group's learning rate after 0..total_steps steps of ``scheduler``, as torch computes
    it (a float, or a CPU tensor of the group's lr dtype), the real scheduler and optimizer untouched."""
    groups = _ParamGroupsOnly(scheduler.optimizer)
    twin = _twin(scheduler, groups)
    rows = [_snapshot(groups)]
    for _ in range(total_steps):
        twin.step()
        rows.append(_snapshot(groups))
    return rows


def _snapshot(groups: _ParamGroupsOnly) -> list[float | torch.Tensor]:
    return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups.param_groups]
