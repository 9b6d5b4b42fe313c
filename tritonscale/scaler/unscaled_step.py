"""A disabled scaler's clip and step (a bf16 run: no loss scale).

torch's disabled GradScaler passes step() through. Ours keeps one thing from the scaled path:
``clip_grad_norm_`` still checks for inf/NaN (in the same pass as the clip) and the ``step()``
right after it skips on that finding, which the step spends: no update() is needed to clear it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..grads.groups import Grads, collect_grads
from ..passes.clip_args import ClipRequest, kernels_compute
from ..passes.grad_passes import clip_grads
from ..passes.rank_checks import Agreement
from ..passes.step_protocols import step_unless


def clip_unscaled(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float,
    group_of: Callable[[Grads], Any],
    backend: str,
    agreement: Agreement,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain clipping (float16 gradients included) with the inf/NaN check; returns the total norm
    and the found_inf flag the next step() skips on. ``group_of``: the process group for the
    gradients; ``agreement``: what the ranks' rows must agree on (rank_checks.py)."""
    grads = collect_grads(
        optimizer, allow_fp16=True, kernels=kernels_compute(norm_type), split_replicas=True, takes_norm=True
    )
    request = ClipRequest(max_norm, norm_type)
    _, result = clip_grads(grads, None, request, backend=backend, group=group_of(grads), agreement=agreement)
    return result.norm, result.found_inf


def step_unscaled(
    optimizer: Any,
    inner: torch.optim.Optimizer,
    skip: torch.Tensor | None,
    read_skip: Callable[[torch.Tensor], bool],
    args: tuple,
    kwargs: dict,
) -> Any:
    """torch's plain step, unless ``skip`` (the clip's finding, if a clip ran) is set: on the device
    for an optimizer that takes ``found_inf``, else ``read_skip(skip)`` on the host."""
    if skip is None:
        return optimizer.step(*args, **kwargs)
    return step_unless(optimizer, inner, skip, read_skip, args, kwargs)
