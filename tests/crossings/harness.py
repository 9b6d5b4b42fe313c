"""Runs one cell: an entry point (row) under a gradient context, a scale and a backend (columns),
for STEPS iterations with overflows, against the twin after every iteration.

After every iteration: what the entry point handed out against the twin's (norms within
tests/oracles/tolerances.py, flags exact), the scale, growth tracker and state_dict exact (plus the skip
counters against the twin's count), parameters within PARAM_TOL, and gradients where the row says
they are comparable. At the end: every tensor ours handed out reads what it read at its step.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from oracles.scaler_twins import bits, same_bits
from oracles.tolerances import TORCH_BACKEND_NORM_RTOL

from .contexts import GradsContext, ScaleContext
from .entry_points import EntryPoint
from .gpu_paths import gpu_paths
from .policies import POLICY_NAMES, PolicyContext, TwinRule
from .twins import FOLDING, KEPT_AFTER, OPTIMIZERS, OVERFLOWS, SPARSE_CAPABLE, STEPS, Model, Side, make_scaler

#: Parameters after many steps, ours against the twin: the clip coefficient differs from torch's by
#: the norm's summation order (~1e-7), the fold divides by scale / clip_coef instead of two
#: multiplications (~1 ulp per gradient): a few float32 ulps per step. bfloat16 parameters (the
#: retyped context) round each step's result to 8 bits: test_grad_scaler_oracle's bf16 bound.
PARAM_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2.0**-7, "atol": 1e-3}}
#: The gpu_paths column's crossing (gpu_paths_apply): the rows under every gradient context and
#: scale, those under accumulation, under every policy column, and under the spike rules.
GPU_PATHS_EVERY_CONTEXT = ("clip_grad_norm_", "clip_grad_norm_fold_adamw", "update")
GPU_PATHS_ACCUMULATED = ("two_optimizers", "update(new_scale)", "SkipAwareLR", "StepLog")
GPU_PATHS_EVERY_POLICY = (
    "clip_grad_norm_fold_adamw",
    "two_optimizers",
    "update(new_scale)",
    "state_dict_round_trip",
    "load_checkpoint",
)
GPU_PATHS_SPIKE_ROWS = ("SkipAwareLR", "StepLog")
#: Gradients after the clip: the same, plus the parameters' differences seen through the loss (the
#: gradient of c * (p - x)**2 / 2 is c * (p - x): where p ~ x a 1e-7 change of p is a large relative one).
GRAD_TOL = PARAM_TOL


@dataclass
class Cell:
    row: EntryPoint
    grads: GradsContext
    scale: ScaleContext
    backend: str
    policy: PolicyContext = POLICY_NAMES["default"]
    layout: list = field(default_factory=list)  # the flat context's (offset, numel) per gradient
    buffer_size: int = 0
    twin_rule: TwinRule | None = None  # the twin's rule, where a row of ours needs the peer's state

    @property
    def id(self) -> str:
        policy = "" if self.policy.default else f"-{self.policy.name}"
        return f"{self.row.name}-{self.grads.name}-{self.scale.name}-{self.backend}{policy}"

    def scaler_backend(self) -> str:
        return "triton" if self.backend.startswith("triton") or self.backend == "gpu_paths" else self.backend


def applies(
    row: EntryPoint, grads: GradsContext, scale: ScaleContext, backend: str, policy: PolicyContext | None = None
) -> bool:
    """Whether a cell exists. The Triton backend runs the rows whose passes differ there, over
    every gradient context at the ordinary scale and every scale on plain gradients (each kernel
    launch costs ~25 ms in the interpreter: the whole product would be minutes); the stopwatch
    column runs the clip on plain and flat gradients. A policy other than the default runs every
    row it applies to on plain gradients (and the clip on the other layouts) at the ordinary scale
    with the torch backend (the clip on Triton too), and the clip on a disabled scaler. The
    gpu_paths column runs its choice of the torch column's cells (``gpu_paths_apply``)."""
    policy = policy or POLICY_NAMES["default"]
    if not row.applies_to(policy):
        return False
    if backend == "gpu_paths":
        if not gpu_paths_apply(row, grads, scale, policy):
            return False
        backend = "torch"  # of its choice, the cells the torch column has
    if not policy.default and not policies_apply(row, grads, scale, backend, policy):
        return False
    if row.narrow and (grads.name not in ("plain", "flat", "accumulated") or scale.name in ("tiny", "near_max")):
        return False
    if row.name in grads.skips_rows or (grads.name == "accumulated" and scale.name not in ("ordinary", "disabled")):
        return False
    if grads.sparse and row.optimizer not in SPARSE_CAPABLE:
        return False  # torch's fused optimizers take dense gradients only
    if not scale.enabled and not row.disabled:
        return False  # a disabled scaler's unscale_/step are torch's plain step: nothing of ours runs
    if scale.init_scale < row.min_scale:
        return False  # the scale managers' constructors require a scale >= 1 (as their originals)
    if scale.numpy and grads.name != "plain":
        return False  # numpy arguments meet the constructors only
    if backend == "torch":
        return True
    if backend == "triton":
        plain_or_ordinary = grads.name == "plain" or scale.name == "ordinary"
        return row.triton and plain_or_ordinary and scale.name not in ("numpy_scalars", "disabled")
    return row.name == "clip_grad_norm_" and grads.name in ("plain", "flat") and scale.name == "ordinary"


def policies_apply(row: EntryPoint, grads: GradsContext, scale: ScaleContext, backend: str, policy) -> bool:
    """The cells of a policy column (see ``applies``)."""
    clip = row.name == "clip_grad_norm_"
    if not scale.enabled:  # a disabled scaler accepts a preset and ignores it; it refuses the norm rules
        return clip and grads.name == "plain" and backend == "torch" and policy.spike is None
    if scale.name != "ordinary" or backend == "triton_retimed":
        return False
    if backend == "triton":
        return clip and grads.name == "plain"
    return grads.name == "plain" or (clip and grads.name in ("flat", "accumulated"))


def gpu_paths_apply(row: EntryPoint, grads: GradsContext, scale: ScaleContext, policy: PolicyContext) -> bool:
    """The cells of the gpu_paths column (gpu_paths.py), within those the torch column has. Each
    costs ~0.7 s in the interpreter, so the column is a chosen crossing: every row on plain
    gradients at the ordinary scale; the clips and ``update`` under every gradient context and
    every scale; accumulation with the rows it meets; every policy column with the rows that
    differ under a rule. ``CROSSINGS_GPU_PATHS=all`` runs every cell of the torch column instead."""
    if os.environ.get("CROSSINGS_GPU_PATHS") == "all":
        return True
    central = grads.name == "plain" and scale.name == "ordinary"
    if not policy.default:
        return central and (row.name in GPU_PATHS_EVERY_POLICY or row.name.startswith("from_") or (
            row.name in GPU_PATHS_SPIKE_ROWS and policy.spike is not None))  # fmt: skip
    if row.name in GPU_PATHS_EVERY_CONTEXT:
        return grads.name == "plain" or scale.name == "ordinary"
    if grads.name == "accumulated":
        return row.name in GPU_PATHS_ACCUMULATED and scale.name == "ordinary"
    return central


def build_side(cell: Cell, ours: bool) -> Side:
    model = Model(sparse=cell.grads.sparse)
    optimizer = OPTIMIZERS[cell.row.optimizer](model.parameters())
    side = Side(ours, model, optimizer, make_scaler(ours, cell.scale, cell.scaler_backend(), cell.policy), cell)
    if not ours and not cell.policy.default and cell.scale.enabled:
        side.rule = cell.twin_rule = TwinRule(cell.policy)
    cell.grads.setup(side)
    if cell.row.setup is not None:
        cell.row.setup(side)
    return side


def run_cell(cell: Cell) -> list:
    """Run the cell; returns what ours handed out, as (step, name, bits, value), for the stopwatch column."""
    with gpu_paths() if cell.backend == "gpu_paths" else contextlib.nullcontext():
        return run_steps(cell)


def run_steps(cell: Cell) -> list:
    ours, twin = build_side(cell, True), build_side(cell, False)
    for step in range(STEPS):
        try:
            seen = cell.row.ours(ours, step)
            expected = cell.row.oracle(twin, step)
            keep(ours, step, seen)
            check_step(cell, ours, twin, seen, expected, step)
        except BaseException as error:
            error.add_note(f"crossing {cell.id}, step {step} (overflows at {sorted(OVERFLOWS)})")
            raise
    check_kept(ours)
    return [(step, name, saved, value.clone()) for step, name, value, saved in ours.kept]


# -------------------------------------------------------------------------- per-step checks
def check_step(cell: Cell, ours: Side, twin: Side, seen: dict, expected: dict, step: int) -> None:
    rtol = max(TORCH_BACKEND_NORM_RTOL[p.dtype] for p in ours.params())
    for name, value in expected.items():
        compare(name, seen.get(name, "<not handed out>"), value, rtol, not twin.scaler.is_enabled())
    scales = ours.scaler.get_scale(), twin.scaler.get_scale()
    assert scales[0] == scales[1], f"scale differs from the twin's: ours {scales[0]!r}, the twin's {scales[1]!r}"
    if twin.rule is None:  # torch's rule: its tracker and state_dict are the oracle's
        trackers = ours.scaler._get_growth_tracker(), twin.scaler._get_growth_tracker()
        assert trackers[0] == trackers[1], f"growth tracker differs: ours {trackers[0]}, torch's {trackers[1]}"
        compare_state_dicts(ours.scaler.state_dict(), twin.scaler.state_dict(), twin)
    else:  # another rule: its scale (above) and the skips the twin counted
        compare_state_dicts(ours.scaler.state_dict(), {"scale": twin.scaler.get_scale()}, twin)
    for i, (p, q) in enumerate(zip(ours.params(), twin.params())):
        assert_close(f"parameter {i}", p.detach(), q.detach(), PARAM_TOL)
    folds = cell.row.optimizer in FOLDING and ours.scaler.is_enabled()
    if cell.row.grads_after and not folds and not twin.found:  # an overflowed clip leaves them as they came
        for i, (p, q) in enumerate(zip(ours.params(), twin.params())):
            assert_close(f"gradient {i}", *(g.to_dense() if g.is_sparse else g for g in (p.grad, q.grad)), GRAD_TOL)


def assert_close(what: str, ours: torch.Tensor, theirs: torch.Tensor, tolerances: dict) -> None:
    """torch.testing.assert_close, its message only where it fails (it costs ~0.1 ms a call)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{what}: {ours.dtype}{tuple(ours.shape)}"
    tolerance = tolerances[theirs.dtype]
    if not torch.allclose(ours, theirs, **tolerance, equal_nan=True):
        torch.testing.assert_close(ours, theirs, **tolerance, equal_nan=True, msg=lambda m: f"{what}: {m}")


def compare(name: str, ours: Any, theirs: Any, rtol: float, disabled: bool) -> None:
    """One handed-out value against the twin's: norms within ``rtol`` (non-finite: the same
    kind), flags as truth values, stats() key by key, everything else equal."""
    if isinstance(theirs, dict):
        compare_stats(ours, theirs, rtol, disabled)
    elif name in ("norm", "last_norm", "loss") or name.startswith("norm_"):
        assert_same_norm(name, ours, theirs, rtol)
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{name}: ours handed out {ours!r}"
        assert_close(name, ours, theirs, GRAD_TOL)
    elif isinstance(theirs, bool):
        assert ours is not None and bool(ours) == theirs, f"{name}: ours {ours!r}, torch's {theirs}"
    else:
        assert ours == theirs, f"{name}: ours {ours!r}, torch's {theirs!r}"


def assert_same_norm(name: str, ours: Any, theirs: Any, rtol: float) -> None:
    assert isinstance(ours, torch.Tensor), f"{name}: ours handed out {ours!r}"
    a, b = float(ours), float(theirs)
    if math.isfinite(b):
        assert a == pytest.approx(b, rel=rtol, abs=0.0), f"{name}: ours {a!r}, torch's {b!r}"
    else:
        assert (math.isnan(a) and math.isnan(b)) or a == b, f"{name}: ours {a!r}, torch's {b!r}"


def compare_stats(ours: Any, theirs: dict, rtol: float, disabled: bool) -> None:
    """stats() against the twin's. A disabled scaler may refuse, with an error that says why (not
    the enabled scaler's "did not use scaler.scale"), or report what it keeps: its keys are
    compared."""
    if isinstance(ours, Exception):
        message = str(ours)
        assert disabled and "enabled=False" in message and "did not use scaler.scale" not in message, (
            f"stats() raised {ours!r}"
        )
        return
    for key, value in theirs.items():
        if key not in ours and disabled:
            continue
        if key == "norm":
            assert_same_norm("stats()['norm']", ours.get(key), value, rtol)
        elif key == "found_inf":
            assert bool(ours[key] != 0) == value, f"stats()['found_inf']: ours {ours[key]!r}, torch's {value}"
        else:
            assert float(ours[key]) == value, f"stats()[{key!r}]: ours {ours[key]!r}, torch's {value!r}"


def compare_state_dicts(ours: dict, theirs: dict, twin: Side) -> None:
    """torch's keys exact; ours' skip counters, where it keeps them, against the twin's count."""
    for key, value in theirs.items():
        assert ours.get(key) == value, f"state_dict()[{key!r}]: ours {ours.get(key)!r}, torch's {value!r}"
    counters = ours.get("counters")
    if counters:
        want = {"skipped_steps": twin.skipped_steps, "consecutive_skips": twin.consecutive_skips}
        got = {key: counters.get(key) for key in want}
        assert got == want, f"state_dict()['counters']: ours {got}, the twin's count {want}"


# ------------------------------------------------------------------------ results kept
def keep(side: Side, step: int, seen: dict, prefix: str = "") -> None:
    """Remember every tensor ours handed out, with its bits at the step it was handed out."""
    for name, value in seen.items():
        if isinstance(value, torch.Tensor):
            side.kept.append((step, prefix + name, value, bits(value)))
        elif isinstance(value, dict):
            keep(side, step, value, f"{prefix}{name}.")


def check_kept(side: Side) -> None:
    """Read again at the end of the run (>= KEPT_AFTER steps later for the first steps' values)."""
    assert STEPS > KEPT_AFTER
    for step, name, value, saved in side.kept:
        assert same_bits(bits(value), saved), (
            f"{name} handed out at step {step} reads {value!r} at step {STEPS - 1}, "
            f"{STEPS - 1 - step} steps later (it read {saved[1].view(value.dtype)!r} then)"
        )
