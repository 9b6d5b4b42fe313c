"""The host-side gradient layout (grads/flat_grads.py, flat_runs.py) imports no
triton: a step on the torch backend never runs a kernel, so its layout logic must not need one.
Read from the sources (the import statements each module runs, and the packages they enter), since
``import tritonscale`` itself loads the backends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tritonscale

PACKAGE = Path(tritonscale.__file__).parent


def _source(module: str) -> Path | None:
    """The file of a tritonscale module, or None for a module outside the package."""
    parts = module.split(".")
    if parts[0] != "tritonscale":
        return None
    path = PACKAGE.joinpath(*parts[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str, path: Path) -> set[str]:
    """Every module the file imports (relative ones made absolute), with the packages entered on the way."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found |= {name} | {f"{name}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    parents = {".".join(n.split(".")[:i]) for n in found for i in range(2, n.count(".") + 1)}
    return found | parents


def import_chain_to(start: str, target: str) -> list[str] | None:
    """A chain of imports from ``start`` to ``target`` (``tritonscale``'s own __init__ aside), or None."""
    chains, seen = {start: [start]}, {start}
    todo = [start]
    while todo:
        module = todo.pop()
        path = _source(module)
        if path is None or not path.is_file():
            continue
        for name in sorted(_imports(module, path)):
            if name == target or name.startswith(target + "."):
                return [*chains[module], name]
            if name.startswith("tritonscale.") and name not in seen:
                seen.add(name)
                chains[name] = [*chains[module], name]
                todo.append(name)
    return None


@pytest.mark.parametrize("module", ["flat_grads", "flat_runs"])
def test_the_gradient_layout_needs_no_triton(module):
    chain = import_chain_to(f"tritonscale.grads.{module}", "triton")
    assert chain is None, " -> ".join(chain)


def test_the_chain_finder_sees_triton_where_it_is_imported():
    assert import_chain_to("tritonscale.kernels.tensor_table", "triton") is not None
