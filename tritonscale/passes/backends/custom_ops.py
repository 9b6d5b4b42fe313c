"""Every custom op of tritonscale, in one place: what a compiled step runs as single graph nodes.

* ``torch.ops.tritonscale.check`` and ``torch.ops.tritonscale.apply_factor_``: the Triton
  backend's check and apply. Dynamo cannot trace a Triton launch made through raw addresses
  (``kernels/tensor_table.py``): the tensors it traces are fakes, with no memory. As ops, the two
  passes are single nodes of the graph: Dynamo stops at them, AOTAutograd sees what they read and
  write, Inductor schedules them as it would any op, and at run time they launch the same kernels
  on the real gradients, laid out anew on every call. On the CPU the interpreter runs them
  (``backend="aot_eager"`` or inductor). They take the gradients as one flat list and each dtype
  group's length (a schema has no list of lists). The eager step calls the backend directly; only
  a step being traced goes through here, to the same layout and check
  (``triton_backend.layouts``, ``check_layouts``).
* ``torch.ops.tritonscale.check_disjoint``: a traced step's overlap check of the gradients' memory
  (``collect_grads`` cannot read addresses while tracing), run in the graph on the real gradients
  before anything that depends on the passes' results (``disjoint_at_run_time``).
"""

from __future__ import annotations

import torch

from ...grads.groups import Grads, first_overlap, shared_memory_error
from .triton_backend import apply_factor_, check_layouts, layouts


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


def disjoint_at_run_time(grads: Grads, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` (tensors the in-place passes depend on), passed through the overlap check of the
    gradients' memory when it could not run at collection (a traced step, ``Grads.unchecked``): the
    check then runs in the graph, at run time, before anything that depends on ``values``.

    Example::

        found_inf, factor = disjoint_at_run_time(grads, [found_inf, factor])
    """
    if grads.unchecked is None or len(grads.unchecked[0]) < 2:
        return values
    tensors, names = grads.unchecked
    return torch.ops.tritonscale.check_disjoint(tensors, "\n".join(names), values)


@torch.library.custom_op("tritonscale::check_disjoint", mutates_args=())
def check_disjoint(grads: list[torch.Tensor], names: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """A compiled step's overlap check, at run time on the real gradients (``names``: their
    parameters, one per line): raises as ``collect_grads`` does, else returns ``values`` (copies:
    an op's outputs may not alias its inputs)."""
    pair = first_overlap(tuple(g.data_ptr() for g in grads), tuple(g.nbytes for g in grads))
    if pair is not None:
        where = names.split("\n")
        raise shared_memory_error(where[pair[0]], where[pair[1]])
    return [v.clone() for v in values]


@check_disjoint.register_fake
def _(grads, names, values):
    return [torch.empty_like(v) for v in values]
