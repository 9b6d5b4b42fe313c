"""Coverage by construction: every public feature of tritonscale is a row or a column of the
crossing harness, found by enumerating the public surface, not by a list kept beside it.

* ``GradScaler``'s public methods and properties, and every name of ``tritonscale.__all__`` a
  loop calls (classes, functions, presets, importers): each must be *called* by some row of the
  single-process harness, seen by running each row once (default policy, plain gradients, the
  ordinary scale) with every public callable wrapped. Names that only a multi-process or a
  compiled cell reaches, and the exception types, name the cell that does; the test checks that
  cell exists.
* Every knob of ``LossScalePolicy`` belongs to exactly one family, and every family is set away
  from its default by some policy column (as our scaler resolves the column's arguments).
* Every row that clips, steps or updates, and every policy column, has a cell on the paths a GPU
  takes (the ``gpu_paths`` column).
* Every preset of ``tritonscale.presets`` is a policy column; every ``from_*`` importer has a row
  that imports the peer's own checkpoint; every integration module has its test module, which
  trains through the framework against the framework's run with torch's scaler.

A new public name, method, knob, preset, importer or integration fails here, named, until it has
its row or column (docs/testing.md says how to add one).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pkgutil
from pathlib import Path

import pytest

import tritonscale
import tritonscale.integrations
from tritonscale import GradScaler, LossScalePolicy, presets

from .contexts import GRADS, SCALES
from .harness import Cell, applies, run_cell
from .policies import POLICIES, POLICY_NAMES
from .rank_scenarios import SCENARIOS
from .rows import ROWS
from .state_rows import IMPORTERS
from .test_cells import CELLS

TESTS = Path(__file__).resolve().parents[1]

#: Public names no single-process row calls, each with where it is crossed: a rank scenario
#: (``("rank", name)``) or a test module and test (``(path, test name)``); the test checks it exists.
ELSEWHERE = {
    "mark_replicated": ("grads/test_sharding.py", "test_"),  # tensor-parallel layouts, two gloo ranks
    "rank_agreement": ("rank", "updater_bf16_replica"),  # the Updater's all-reduce calls it
    "process_group": ("rank", "control"),
    # The load_checkpoint row (state_rows.py) writes its file with DeepSpeed's classes; without DeepSpeed:
    "load_checkpoint": ("peer_apis/test_safe_checkpoint.py", "test_a_zero_checkpoint_loads_without_deepspeed"),
    "place_state": ("scaler/test_scaler_iteration_api.py", "test_place_state_makes_the_state_where_asked_once"),
    "backend_for": ("scaler/test_grad_scaler_api.py", "test_backend_for_names_the_backend_that_runs"),
    # A CUDA graph's capture and replays need a GPU (tests/test_gpu.py); on the CPU its calls run with
    # torch.cuda's graph and streams stood in for: warm-ups, capture, replays, the refusals at
    # construction and after each way of moving what the graph reads (the same file's MOVES, KINDS).
    "CapturedStep": (
        "loop/test_captured_step.py",
        "test_the_captured_step_warms_up_captures_replays_and_refuses_moved_grads",
    ),
}
#: The scaler's calls whose paths differ on a GPU: a row that makes one needs a gpu_paths cell.
STEPPING = ("clip_grad_norm_", "unscale_", "step", "update")
#: Types a row meets by isinstance or as an error, not by calling them.
TYPES = {
    "OptState": "read-outs (optimizer_stage)",
    "PeerPreset": "the policy columns (presets.* return one)",
    "RankMismatchError": "every perturbed rank scenario",
    "ScalerConfigError": "two_optimizers under a norm-history policy",
    "UpdateResult": "Updater (what update() returns)",
    "UpdaterError": "Updater (its errors' base class)",
    "DataFeedExhausted": "Updater (the data feed runs out after the last step)",
}
#: The knob families of LossScalePolicy: each knob in exactly one.
FAMILIES = {
    "growth and backoff": ("growth_factor", "backoff_factor", "growth_interval"),
    "fixed scale": ("dynamic", "skip_on_overflow"),
    "hysteresis": ("hysteresis", "consecutive_hysteresis", "hysteresis_refill_on_backoff"),
    "floors and ceilings": ("min_scale", "max_scale", "on_min_scale"),
    "skip limit": ("max_consecutive_skips",),
    "norm threshold": ("skip_norm_above",),
    "norm average": ("skip_norm_factor", "norm_average_decay", "norm_warmup_steps"),
    "growth delay": ("growth_delay",),
    "overflow tolerance": ("overflow_tolerance", "raise_at_scale"),
    "z-score skip": ("skip_norm_sigma", "skip_norm_window", "skip_norm_min_steps"),
    "ZClip": (
        "clip_norm_z",
        "clip_norm_alpha",
        "clip_norm_warmup_steps",
        "clip_norm_mode",
        "clip_norm_option",
        "clip_norm_factor",
        "clip_norm_eps",
        "clip_norm_skip_update_on_spike",
    ),  # fmt: skip
}


def public_scaler_members() -> list[str]:
    return sorted(name for name in dir(GradScaler) if not name.startswith("_"))


def called_by_rows() -> dict[str, set[str]]:
    """Run each row once with every public callable of GradScaler and of ``tritonscale`` wrapped;
    return, per name, the rows that called it."""
    seen: dict[str, set[str]] = {}
    current = [""]
    patches = []

    def wrap(owner, name, label):
        original = inspect.getattr_static(owner, name)
        if isinstance(original, property):

            def getter(self, _get=original.fget, _label=label):
                seen.setdefault(_label, set()).add(current[0])
                return _get(self)

            replacement = property(getter, original.fset)
        elif inspect.isclass(original):
            replacement = original  # classes: their __init__ is wrapped below
        elif callable(original):

            @functools.wraps(original)
            def replacement(*args, _f=original, _label=label, **kwargs):
                seen.setdefault(_label, set()).add(current[0])
                return _f(*args, **kwargs)
        else:
            return
        patches.append((owner, name, original))
        setattr(owner, name, replacement)

    for name in public_scaler_members():
        wrap(GradScaler, name, name)
    for name in tritonscale.__all__:
        value = getattr(tritonscale, name)
        if inspect.isclass(value) and not issubclass(value, BaseException):
            wrap(value, "__init__", name)
        elif inspect.isfunction(value):
            for module in {tritonscale, inspect.getmodule(value)}:
                if getattr(module, name, None) is value:
                    wrap(module, name, name)
    try:
        for row in ROWS:
            current[0] = row.name
            for policy in POLICIES:
                cells = [
                    Cell(row, grads, scale, "torch", policy)
                    for grads in GRADS
                    for scale in SCALES
                    if scale.name == "ordinary" and applies(row, grads, scale, "torch", policy)
                ]
                if cells:  # the row once, and the clip row under every gradient context
                    for cell in cells if row.name == "clip_grad_norm_" else cells[:1]:
                        run_cell(cell)
                    break
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
    return seen


@pytest.fixture(scope="module")
def calls() -> dict[str, set[str]]:
    return called_by_rows()


def test_every_scaler_method_is_called_by_a_row(calls):
    missing = [m for m in public_scaler_members() if m not in calls and m not in ELSEWHERE]
    assert not missing, f"GradScaler members no crossing row calls: {missing}; add a row (tests/crossings/)"


def test_every_public_name_is_a_row_or_a_column(calls):
    missing = [
        name
        for name in tritonscale.__all__
        if name not in calls and name not in ELSEWHERE and name not in TYPES and name != "presets"
    ]
    assert not missing, f"public names no crossing row calls: {missing}; add a row or a column (tests/crossings/)"


def test_names_reached_elsewhere_name_a_cell_that_exists():
    for name, (where, cell) in ELSEWHERE.items():
        if where == "rank":
            assert cell in SCENARIOS, f"{name}: no rank scenario {cell!r}"
        else:
            source = (TESTS / where).read_text()
            assert f"def {cell}" in source and name in source, f"{name}: {where} has no {cell!r} using it"


def test_every_row_that_clips_steps_or_updates_has_a_gpu_paths_cell(calls):
    """The GPU paths (gpu_paths.py) differ from the CPU's wherever the scaler clips, steps or
    updates: such a row needs its cell in that column, as a new one will."""
    stepping = set().union(*(calls.get(name, set()) for name in STEPPING))
    covered = {cell.row.name for cell in CELLS if cell.backend == "gpu_paths"}
    missing = sorted(stepping - covered)
    assert stepping and not missing, f"rows with no gpu_paths cell: {missing}; see harness.gpu_paths_apply"


def test_every_policy_column_has_a_gpu_paths_cell():
    covered = {cell.policy.name for cell in CELLS if cell.backend == "gpu_paths"}
    missing = [policy.name for policy in POLICIES if policy.name not in covered]
    assert not missing, f"policy columns with no gpu_paths cell: {missing}; see harness.gpu_paths_apply"


def test_every_preset_is_a_policy_column():
    columns = {policy.preset for policy in POLICIES}
    missing = [name for name in presets.PRESETS if name not in columns]
    assert not missing, f"presets with no policy column: {missing}; add one to tests/crossings/policies.py"


def test_every_importer_has_a_row():
    importers = [name for name in tritonscale.__all__ if name.startswith("from_")]
    rows = {row.name for row in ROWS}
    missing = [name for name in importers if name not in rows or name.removeprefix("from_") not in IMPORTERS]
    assert not missing, f"importers with no row: {missing}; add one to tests/crossings/state_rows.py"


def test_every_knob_is_in_one_family():
    knobs = [f.name for f in dataclasses.fields(LossScalePolicy)]
    placed = [knob for family in FAMILIES.values() for knob in family]
    assert sorted(placed) == sorted(knobs), (
        f"knobs in no family: {sorted(set(knobs) - set(placed))}; in two or unknown: "
        f"{sorted(k for k in set(placed) if placed.count(k) > 1 or k not in knobs)}"
    )


def test_every_knob_family_is_set_by_a_policy_column():
    default = LossScalePolicy().knobs()
    resolved = [GradScaler("cpu", **policy.kwargs()).get_policy().knobs() for policy in POLICIES]
    unset = [
        family
        for family, knobs in FAMILIES.items()
        if not any(policy[knob] != default[knob] for policy in resolved for knob in knobs)
    ]
    assert not unset, f"knob families no policy column sets: {unset}; add a column to tests/crossings/policies.py"


def test_every_integration_has_its_test_module():
    modules = [m.name for m in pkgutil.iter_modules(tritonscale.integrations.__path__)]
    missing = [m for m in modules if not (TESTS / "integrations" / f"test_{m}.py").exists()]
    assert not missing, f"integrations with no test module in tests/integrations/: {missing}"


def test_the_default_column_is_torch_itself():
    assert POLICY_NAMES["default"].default and all(not p.default for p in POLICIES[1:])
