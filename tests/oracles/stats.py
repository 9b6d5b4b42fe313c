"""The oracle of logged statistics: each step's ``scaler.stats()`` read at once (a sync per step),
over a short run with skips of every kind (skip_truth's cases: overflow, hysteresis, norm spike).

Example::

    oracle = []
    run_case("hysteresis", lambda step, scaler: oracle.append((step, read_at_once(scaler))))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from integrations.skip_truth import GradInjector, injected_kind, make_optimizer, scaler_kwargs

import tritonscale

STEPS = 14  # a ring of 3 slots is reused four times over
POISONED = (2, 5, 6, 11)  # backward passes poisoned: a lone skip, two in a row, one late


def run_case(
    case: str, each_step: Callable[[int, tritonscale.GradScaler], None], steps: int = STEPS, backend: str = "auto"
) -> None:
    """``steps`` scaled training steps of skip_truth's ``case``; ``each_step(step, scaler)`` after each update()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = make_optimizer(case, model.parameters())
    scaler = tritonscale.GradScaler("cpu", backend=backend, **scaler_kwargs(case))
    GradInjector(model.weight, injected_kind(case), at=POISONED)
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        each_step(step, scaler)


def read_at_once(scaler) -> dict:
    """This step's stats() read now on the host: Python ints for integer tensors, floats otherwise."""
    return {name: value.item() for name, value in scaler.stats().items()}


def oracle_rows(case: str, steps: int = STEPS, backend: str = "auto") -> list[tuple[int, dict]]:
    """(step, stats read at once) after each update() of ``case``'s run."""
    rows = []
    run_case(case, lambda step, scaler: rows.append((step, read_at_once(scaler))), steps, backend)
    return rows


def exact(rows: list[tuple[int, dict]]) -> list[tuple[int, list[tuple[str, str]]]]:
    """Rows in a form that compares bit for bit: repr tells 1 from 1.0 and compares NaN norms."""
    return [(step, sorted((name, repr(value)) for name, value in values.items())) for step, values in rows]
