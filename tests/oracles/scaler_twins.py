"""Shared set-up for the misuse matrix and the call-sequence tests: twin tiny models, the torch
oracle of ``clip_grad_norm_`` and bitwise snapshots of everything a rejected call must not touch."""

from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

import tritonscale

SHAPES = ((3,), (2, 2), (2, 2))  # a few elements each: every pass is a handful of tiny launches


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in SHAPES]


def scaled_backward(params, scaler, inject: float | None = None, where: int = 0) -> None:
    """``scaler.scale(loss).backward()`` for a loss whose gradients depend on the parameters
    (so diverging parameters show up in later gradients); ``inject`` overwrites one element."""
    loss = sum(((i + 1) * p.float() ** 2).sum() / 4 for i, p in enumerate(params))
    scaler.scale(loss).backward()
    if inject is not None:
        with torch.no_grad():
            params[where].grad.view(-1)[0] = inject


def is_torch_scaler(scaler) -> bool:
    return isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, tritonscale.GradScaler)


def torch_clip(scaler: torch.amp.GradScaler, optimizer, max_norm, norm_type=2.0) -> torch.Tensor:
    """The oracle of ours ``scaler.clip_grad_norm_(optimizer, ...)``: torch's ``unscale_`` (unless
    this iteration already unscaled; ours then only clips too) + ``torch.nn.utils.clip_grad_norm_``."""
    record = scaler._per_optimizer_states.get(id(optimizer))
    if scaler.is_enabled() and (record is None or record["stage"].name != "UNSCALED"):
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


def clip(scaler, optimizer, max_norm, norm_type=2.0):
    """Ours ``clip_grad_norm_``, or its torch oracle when ``scaler`` is torch's."""
    if is_torch_scaler(scaler):
        return torch_clip(scaler, optimizer, max_norm, norm_type)
    return scaler.clip_grad_norm_(optimizer, max_norm, norm_type)


def bits(t: torch.Tensor | None) -> Any:
    """A bit-exact copy of ``t`` that compares with ``torch.equal`` (NaN payloads and -0.0 included)."""
    if t is None:
        return None
    t = t.detach()
    if t.layout is not torch.strided:
        return ("sparse", bits(t._indices()), bits(t._values()), tuple(t.shape))
    meta = (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    return meta, t.clone().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)  # NaN == NaN here


def _tensor_tree_bits(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return bits(value)
    if isinstance(value, dict):
        return {k: _tensor_tree_bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensor_tree_bits(v) for v in value)
    return copy.deepcopy(value)


@dataclass
class Snapshot:
    """Everything a rejected call must leave as it was, bit for bit."""

    params: list
    grads: list
    grad_objects: list  # the .grad tensors themselves: a rejected call must not replace them either
    optimizer_state: Any
    optimizer_attributes: dict
    scaler_state: Any
    stages: dict

    @classmethod
    def take(cls, params, optimizers, scaler) -> Snapshot:
        # .get, never [...]: the record dict is a defaultdict, and reading must not create an entry.
        records = {id(o): scaler._per_optimizer_states.get(id(o)) for o in optimizers}
        return cls(
            params=[bits(p) for p in params],
            grads=[bits(p.grad) for p in params],
            grad_objects=[p.grad for p in params],
            optimizer_state=[_tensor_tree_bits(o.state_dict()) for o in optimizers],
            optimizer_attributes=[{a: hasattr(o, a) for a in ("grad_scale", "found_inf")} for o in optimizers],
            scaler_state=_tensor_tree_bits(scaler.state_dict()),
            # No record yet reads as a fresh one: torch's misuse checks create the entry too.
            stages={
                k: ("READY", {}) if r is None else (r["stage"].name, _tensor_tree_bits(dict(r["found_inf_per_device"])))
                for k, r in records.items()
            },
        )

    def assert_same(self, other: Snapshot) -> None:
        for i, (a, b) in enumerate(zip(self.params, other.params)):
            assert same_bits(a, b), f"parameter {i} changed"
        for i, (a, b) in enumerate(zip(self.grads, other.grads)):
            assert same_bits(a, b), f"gradient {i} changed"
        assert all(a is b for a, b in zip(self.grad_objects, other.grad_objects)), "a .grad was replaced"
        assert same_bits(self.optimizer_state, other.optimizer_state), "optimizer state changed"
        assert self.optimizer_attributes == other.optimizer_attributes, "grad_scale/found_inf left on the optimizer"
        assert same_bits(self.scaler_state, other.scaler_state), "scaler state_dict changed"
        assert same_bits(self.stages, other.stages), "per-optimizer stage or found_inf changed"


def through_torch_save(obj: Any) -> Any:
    """``obj`` saved with torch.save and loaded back (whole objects: ``weights_only=False``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


#: The ways a user copies a whole object (an optimizer, a wrapper, a model with its optimizer),
#: each as a function of the object.
COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": through_torch_save,
}
