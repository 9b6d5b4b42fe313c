"""Only the controller's own files touch a GradScaler's private members.

Adapters (the Updater, the scale managers, the integrations) use the scaler's public API; torch's
private names (``_scale``, ``_per_optimizer_states``, ...) are a compatibility layer for code
outside this package. The check parses every module under ``tritonscale/`` and reports each
``X._name`` (and ``getattr(X, "_name")``, ``setattr``, ``hasattr``, ``delattr``) where ``_name`` is
a private member of a GradScaler (of ours or of torch's) and ``X`` is a scaler: an expression
whose last name says so (``scaler``, ``self.scaler``, ``self._grad_scaler``), or ``self`` in a
subclass of GradScaler.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import tritonscale
from tritonscale import GradScaler

PACKAGE = Path(tritonscale.__file__).parent
#: The controller: one class, in one file (the per-optimizer records are values it writes).
CONTROLLER_FILES = {"scaler/grad_scaler.py"}
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def scaler_private_names() -> set[str]:
    """Every private member a GradScaler has: class attributes (mixins included) and an
    instance's fields, ours and torch.amp.GradScaler's."""
    names: set[str] = set()
    for cls in (GradScaler, torch.amp.GradScaler):
        for klass in cls.__mro__:
            if klass is not object:
                names |= set(vars(klass))
    names |= set(vars(GradScaler("cpu"))) | set(vars(torch.amp.GradScaler("cpu")))
    return {n for n in names if _private(n)}


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Finder(ast.NodeVisitor):
    def __init__(self, private: set[str]) -> None:
        self.private = private
        self.found: list[tuple[int, str]] = []
        self._in_scaler_class: list[bool] = [False]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        subclass = any((_last_name(b) or "").endswith("GradScaler") for b in node.bases)
        self._in_scaler_class.append(subclass)
        self.generic_visit(node)
        self._in_scaler_class.pop()

    def _is_scaler(self, node: ast.expr) -> bool:
        name = _last_name(node)
        if name == "self" and isinstance(node, ast.Name):
            return self._in_scaler_class[-1]
        return name is not None and "scaler" in name.lower()

    def _report(self, node: ast.AST, receiver: ast.expr, name: str) -> None:
        if name in self.private and self._is_scaler(receiver):
            self.found.append((node.lineno, f"{ast.unparse(receiver)}.{name}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._report(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._report(node, node.args[0], name.value)
        self.generic_visit(node)


def private_scaler_accesses(source: str, private: set[str]) -> list[tuple[int, str]]:
    finder = _Finder(private)
    finder.visit(ast.parse(source))
    return finder.found


def test_the_finder_sees_each_way_of_reaching_a_scalers_private_members():
    private = scaler_private_names()
    assert {
        "_scale",
        "_per_optimizer_states",
        "_policy",
        "_last_found_inf",
        "_lazy_init_scale_growth_tracker",
    } <= private
    source = """
class Adapter:
    def run(self, scaler):
        scaler._per_optimizer_states.pop(1)
        self.scaler._last_found_inf = None
        getattr(self._grad_scaler, "_policy")
        self._scale = 1  # the adapter's own field, not the scaler's
        optimizer._step_supports_amp_scaling  # not a scaler

class Limited(GradScaler):
    def update(self):
        return self._counters, self._own_field
"""
    found = [text for _, text in private_scaler_accesses(source, private)]
    assert found == [
        "scaler._per_optimizer_states",
        "self.scaler._last_found_inf",
        "self._grad_scaler._policy",
        "self._counters",
    ]


def test_no_module_outside_the_controller_touches_a_scalers_private_members():
    private = scaler_private_names()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in CONTROLLER_FILES:
            continue
        for line, text in private_scaler_accesses(path.read_text(), private):
            offenders.append(f"tritonscale/{relative}:{line}: {text}")
    assert offenders == [], "use GradScaler's public API instead:\n" + "\n".join(offenders)
