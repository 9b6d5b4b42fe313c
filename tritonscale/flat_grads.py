"""Flat gradient buffers: every gradient of a (device, dtype) group as a view of one buffer.

With flat buffers each pass is a single launch over one contiguous range, with no pointer table,
and Triton can use 16-byte vector loads: every view starts at a multiple of 16 elements and the
buffer's length is a multiple of 16, which is what lets the compiler prove alignment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from .kernels.tensor_table import FLAT_VIEWS_ATTR

ALIGN_ELEMENTS = 16


def _round_up(n: int) -> int:
    return -(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def flatten_grads_(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Give each parameter's ``.grad`` storage inside one flat buffer per (device, dtype).

    Existing gradient values are copied in; parameters without a gradient get zeros. Returns the
    buffers. Autograd accumulates into the views in place, so keep them with
    ``optimizer.zero_grad(set_to_none=False)`` (``set_to_none=True`` drops the views and the next
    backward allocates ordinary gradients again, which still work, through the pointer table).

    Example::

        model = torch.nn.Linear(64, 64)
        buffers = tritonscale.flatten_grads_(model.parameters())
        # ... backward(); scaler.clip_grad_norm_(...) now makes one launch per pass ...
        optimizer.zero_grad(set_to_none=False)
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
    seen: set[int] = set()
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        dtype = p.grad.dtype if p.grad is not None else p.dtype
        groups[(p.device, dtype)].append(p)
    buffers = []
    for (device, dtype), members in groups.items():
        total = sum(_round_up(p.numel()) for p in members)
        buffer = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for p in members:
            view = buffer[offset : offset + p.numel()].view(p.shape)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            offset += _round_up(p.numel())
        setattr(buffer, FLAT_VIEWS_ATTR, len(members))
        buffers.append(buffer)
    return buffers
