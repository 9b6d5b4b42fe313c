"""GradScaler is one explicit class: its state is the fields its ``__init__`` sets.

Read from the source (``ast``): every ``self.<name>`` a GradScaler method in ``grad_scaler.py``
uses is a field set in ``__init__`` or a member defined in that file, so a reader never meets an
attribute defined elsewhere. The two layers mixed in (torch's private names, checkpoints) read only
the fields and methods they declare at their top, and each declared name is one of GradScaler's.
And at run time no step adds a field that ``__init__`` did not set.
"""

from __future__ import annotations

import ast
import inspect
import typing

import pytest
import torch

from tritonscale import GradScaler
from tritonscale.scaler.scaler_state import ScalerStateIO
from tritonscale.scaler.torch_private_api import TorchPrivateAPI


def _class_node(cls: type) -> ast.ClassDef:
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__)


def _members(node: ast.ClassDef) -> set[str]:
    """Names the class body defines: methods, properties, class attributes."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and item.value is not None and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return names


def _declared(node: ast.ClassDef) -> set[str]:
    """Bare annotations in the class body: the host fields a layer says it reads."""
    return {
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and item.value is None and isinstance(item.target, ast.Name)
    }


def _self_uses(node: ast.ClassDef) -> dict[str, int]:
    """Every ``self.<name>`` in the class's methods, with a line it is on."""
    uses = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            if not sub.attr.startswith("__"):  # Python's own (self.__dict__)
                uses.setdefault(sub.attr, sub.lineno)
    return uses


def _init_fields(node: ast.ClassDef) -> set[str]:
    init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
    fields = set()
    for sub in ast.walk(init):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    fields.add(t.attr)
    return fields


SCALER = _class_node(GradScaler)
FIELDS = _init_fields(SCALER)


def test_the_controller_uses_only_its_own_fields_and_methods():
    own = FIELDS | _members(SCALER)
    foreign = {name: line for name, line in _self_uses(SCALER).items() if name not in own}
    assert not foreign, f"grad_scaler.py uses attributes it does not define (name: line): {foreign}"


@pytest.mark.parametrize("layer", [TorchPrivateAPI, ScalerStateIO], ids=lambda c: c.__name__)
def test_each_layer_reads_only_what_it_declares(layer):
    node = _class_node(layer)
    declared, own = _declared(node), _members(node)
    undeclared = {name: line for name, line in _self_uses(node).items() if name not in declared | own}
    assert not undeclared, f"{layer.__name__} reads GradScaler members it does not declare: {undeclared}"
    # ... and what it declares is GradScaler's: a field of __init__ or a method of grad_scaler.py.
    assert declared <= FIELDS | _members(SCALER), declared - FIELDS - _members(SCALER)
    hints = typing.get_type_hints(layer, globalns=vars(inspect.getmodule(layer)))
    assert declared <= set(hints)  # declarations, not values


def test_no_step_adds_a_field_init_did_not_set():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(params, fused=True)
    scaler = GradScaler("cpu")
    assert set(vars(scaler)) == FIELDS
    for overflow in (False, True, False):
        scaler.scale(sum(p.sum() for p in params)).backward()
        if overflow:
            params[0].grad[0, 0] = float("inf")
        scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    scaler.load_state_dict(scaler.state_dict())
    scaler.abandon_iteration(optimizer, scaler.snapshot())
    scaler.stats(), scaler.get_scale(), scaler.last_step_skipped()
    assert set(vars(scaler)) == FIELDS
