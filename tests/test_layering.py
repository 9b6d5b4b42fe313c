"""The imports follow the step: each stage imports only the stages before it, and the leaves.

The stages, in the order a step runs them: ``kernels`` (the Triton passes) < ``grads`` (which
gradients, in which layout) < ``policy`` (the rule and its state) < ``passes`` (check, finalize,
combine across ranks, apply or fold) < ``scaler`` (the controller) < ``loop`` (the loop around it:
skip-aware schedules, logging) < ``peer_apis`` (other frameworks' APIs over the controller)
and ``integrations``. Leaf
modules at the package's top (``flags.py``, ``process_groups.py``, ``host_reads.py``,
``errors.py``, ``torch_compat.py``) import no stage, and every stage but the kernels may import them (the kernels know
nothing of the package around them). Every import counts: at module level, inside a function,
and under ``if TYPE_CHECKING:`` (a reader follows those too). ``tritonscale/__init__.py`` gathers the public
names from every stage and is the one exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tritonscale

PACKAGE = Path(tritonscale.__file__).parent
ORDER = {"kernels": 0, "grads": 1, "policy": 2, "passes": 3, "scaler": 4, "loop": 5}
ORDER |= {"peer_apis": 6, "integrations": 6}
LEAVES = {"flags", "process_groups", "host_reads", "errors", "torch_compat"}


def imports(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            if not node.module:  # from . import x: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def stage_of(module: str) -> str | None:
    """The stage (or "leaf") of a tritonscale module; None outside the package."""
    parts = module.split(".")
    if parts[0] != "tritonscale" or len(parts) < 2:
        return None
    if parts[1] in ORDER:
        return parts[1]
    if parts[1] in LEAVES:
        return "leaf"
    raise AssertionError(f"{module} is in no stage: add it to a stage folder, or to LEAVES if it imports none")


def sources() -> list[tuple[Path, str, list[str]]]:
    """(file, its stage, its package as a list) for every module but the package's __init__."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative == Path("__init__.py"):
            continue
        package = ["tritonscale", *relative.parent.parts]
        found.append((path, stage_of(".".join(["tritonscale", *relative.with_suffix("").parts])), package))
    return found


def offending_imports(files: list[tuple[Path, str, list[str]]]) -> list[str]:
    offending = []
    for path, stage, package in files:
        for line, module in imports(path, package):
            target = stage_of(module)
            if target is None or target == "leaf" and stage not in ("leaf", "kernels"):
                continue
            if stage == "leaf" or ORDER[target] > ORDER[stage]:
                offending.append(f"{path.name}:{line} ({stage}) imports {module} ({target})")
    return offending


def test_each_stage_imports_only_earlier_stages_and_the_leaves():
    assert not offending_imports(sources())


def test_the_rule_catches_an_import_of_a_later_stage(tmp_path):
    """The check itself: a grads module importing the passes (as grads/sharding.py once did), a
    policy module importing the controller under TYPE_CHECKING (as policy/runner.py did) and a leaf
    importing a stage are each reported."""
    cases = {
        "grads": "from ..passes.rank_combine import check_process_group\n",
        "policy": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..scaler.scaler_args import X\n",
        "leaf": "def f():\n    from .grads import groups\n",
    }
    files = []
    for stage, text in cases.items():
        path = tmp_path / f"{stage}.py"
        path.write_text(text)
        files.append((path, stage, ["tritonscale"] if stage == "leaf" else ["tritonscale", stage]))
    assert len(offending_imports(files)) == 3


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_a_leaf_imports_nothing_of_the_package(leaf):
    path = PACKAGE / f"{leaf}.py"
    assert [m for _, m in imports(path, ["tritonscale"]) if m.startswith("tritonscale")] == []


@pytest.mark.parametrize("stage", ["grads", "policy"])
def test_no_module_repeats_its_folder(stage):
    """``policy/runner.py``, not ``policy/policy_runner.py``: the folder already says it (issue 40)."""
    prefixes = (f"{stage}_", f"{stage.removesuffix('s')}_")
    repeating = [
        f"{stage}/{path.name}"
        for path in sorted((PACKAGE / stage).glob("*.py"))
        if path.stem.startswith(prefixes)
    ]
    assert repeating == []
