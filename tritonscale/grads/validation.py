"""The rules a gradient must meet before anything runs, and their errors: torch's float16 refusal,
the layouts torch ops take, and how errors name a parameter.

``collect_grads`` (groups.py) runs them over every gradient of a step before any pass writes,
so a bad gradient raises with nothing modified. The rule that no two gradients share memory is
groups.py's (``first_overlap``), the one step of these that runs on every step.
"""

from __future__ import annotations

import torch

from ..kernels.supported import is_dense

#: torch's error for float16 gradients an in-place unscale would write into, and what works instead.
FP16_REFUSED = (
    "Attempting to unscale FP16 gradients. Unscaled values written back into float16 gradients "
    "underflow and overflow; with float16 parameters use an optimizer made with fused=True "
    "(torch.optim.AdamW, Adam, SGD, Adagrad), whose step divides by the scale itself "
    "(clip_grad_norm_ then folds into it), or keep float32 parameters and run the forward "
    "under torch.autocast"
)


def where(g_index: int, p_index: int) -> str:
    """How errors name a parameter: its place in ``optimizer.param_groups``.

    Example::

        where(0, 3)  # "param_groups[0]['params'][3]"
    """
    return f"param_groups[{g_index}]['params'][{p_index}]"


def check_for_torch_ops(optimizer: torch.optim.Optimizer, grad: torch.Tensor, name: str, allow_sparse: bool) -> bool:
    """Raise, naming the parameter (``name``), for a gradient the kernels do not take that torch ops
    cannot take either; True when it is dense (it joins the overlap check).

    Example::

        check_for_torch_ops(opt, torch.zeros(3, 1).expand(3, 4), where(0, 0), True)  # ValueError: share memory
    """
    if not grad.is_floating_point():
        raise TypeError(f"{name} has a non-floating gradient of dtype {grad.dtype}")
    if grad.layout is torch.sparse_coo:
        if not allow_sparse:
            raise TypeError(
                f"{name} has a sparse gradient, and {type(optimizer).__name__} steps fused, which takes dense "
                "gradients only"
            )
        return False
    if grad.layout is torch.strided and overlaps_itself(grad):
        # An in-place pass over it would write one element several times (torch's unscale_
        # fails there too, halfway through); refused before anything runs.
        raise ValueError(
            f"{name} has a gradient whose elements share memory (shape {tuple(grad.shape)}, stride "
            f"{grad.stride()}, e.g. an expanded view): it cannot be unscaled in place"
        )
    if grad.layout is not torch.strided:
        raise TypeError(f"{name} has a {grad.layout} gradient; supported: strided, sparse_coo")
    return is_dense(grad)


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (a stride-0 or interleaved view). Sorted by
    stride, each dimension must step past everything the smaller ones span; conservative."""
    reach = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < reach:
            return True
        reach = stride * size
    return False


def where_is(optimizer: torch.optim.Optimizer, grad: torch.Tensor, besides: str | None = None) -> str:
    """The parameter whose .grad is ``grad`` (one tensor may serve several: not ``besides``)."""
    for g_index, group in enumerate(optimizer.param_groups):
        for p_index, param in enumerate(group["params"]):
            if param.grad is grad and where(g_index, p_index) != besides:
                return where(g_index, p_index)
    return "an unknown parameter"
