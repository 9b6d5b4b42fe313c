"""The Triton backend's check and apply as torch custom ops, for a compiled step.

Dynamo cannot trace a Triton launch made through raw addresses (``kernels/tensor_table.py``):
the tensors it traces are fakes, with no memory. Registered as ``torch.ops.tritonscale.check`` and
``torch.ops.tritonscale.apply_factor_``, the two passes are single nodes of the graph: Dynamo
stops at them, AOTAutograd sees what they read and write, Inductor schedules them as it would any
op, and at run time they launch the same kernels on the real gradients, laid out anew on every
call. On the CPU the interpreter runs them (``backend="aot_eager"`` or inductor).

The ops take the gradients as one flat list and each dtype group's length (a schema has no list
of lists). The eager step calls the backend directly; only a step being traced goes through here,
to the same layout and check (``triton_backend.layouts``, ``check_layouts``).
"""

from __future__ import annotations

import torch

from ...kernels import apply_factor_
from .triton_backend import check_layouts, layouts


def _groups(grads: list[torch.Tensor], sizes: list[int]) -> list[list[torch.Tensor]]:
    groups, start = [], 0
    for size in sizes:
        groups.append(grads[start : start + size])
        start += size
    return groups


@torch.library.custom_op("tritonscale::check", mutates_args=())
def check(
    grads: list[torch.Tensor], sizes: list[int], scale: torch.Tensor, norm_type: float, max_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read-only check pass + finalize over ``grads`` (``sizes``: each dtype group's length)."""
    return tuple(t.clone() for t in check_layouts(layouts(_groups(grads, sizes)), scale, norm_type, max_norm))


@check.register_fake
def _(grads, sizes, scale, norm_type, max_norm):
    return tuple(torch.empty((), dtype=torch.float32, device=scale.device) for _ in range(4))


@torch.library.custom_op("tritonscale::apply_factor_", mutates_args=("grads",))
def apply_factor(grads: list[torch.Tensor], sizes: list[int], factor: torch.Tensor) -> None:
    """g <- g * factor in place over ``grads``, one launch per dtype group."""
    for layout in layouts(_groups(grads, sizes)):
        apply_factor_(layout, factor)


@apply_factor.register_fake
def _(grads, sizes, factor):
    return None
