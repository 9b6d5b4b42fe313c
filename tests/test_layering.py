"""The imports follow the step: stages below the controller never import it or what sits on it.

``grads/``, ``passes/`` and ``policy/`` are the stages the controller (``scaler/``) runs; the
shapes and the integrations sit on the controller. A stage importing ``scaler/``, ``shapes/`` or
``integrations/`` at run time would make the flow circular (annotations under ``TYPE_CHECKING``
are not imports at run time). The kernels know nothing of the package around them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tritonscale

PACKAGE = Path(tritonscale.__file__).parent
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
STAGES = ["grads", "passes", "policy"]
ABOVE_THE_STAGES = {"scaler", "shapes", "integrations"}


def runtime_imports(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute module) of every import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module))
            if not node.module:  # from . import x: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_does_not_import_the_controller_or_what_sits_on_it(stage):
    offending = []
    for path in sorted((PACKAGE / stage).rglob("*.py")):
        package = ["tritonscale", *path.relative_to(PACKAGE).parent.parts]
        for line, module in runtime_imports(path, package):
            parts = module.split(".")
            if parts[0] == "tritonscale" and len(parts) > 1 and parts[1] in ABOVE_THE_STAGES:
                offending.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not offending, offending


def test_the_kernels_import_nothing_of_the_package():
    offending = []
    for path in sorted(KERNELS.glob("*.py")):
        for line, module in runtime_imports(path, ["tritonscale", "kernels"]):
            if module.startswith("tritonscale") and not module.startswith("tritonscale.kernels"):
                offending.append(f"kernels/{path.name}:{line} imports {module}")
    assert not offending, offending
