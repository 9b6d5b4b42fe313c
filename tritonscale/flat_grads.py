"""Flat gradient buffers: every gradient of a (device, dtype) group as a view of one buffer.

With flat buffers each pass is a single launch over one contiguous range, with no pointer table,
and Triton can use 16-byte vector loads: every view starts at a multiple of 16 elements and the
buffer's length is a multiple of 16, which is what lets the compiler prove alignment.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Iterable

import torch

from .kernels.flat_runs import FLAT_VIEWS_ATTR, RUN_ATTR

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


# ------------------------------------------------- recognising a buffer again, per step
# Walking and validating 2000 gradients costs ~3 ms of Python per step, more than one norm and one
# multiply over their 8M elements (~2 ms on the 2-core development machine). An optimizer whose
# gradients are exactly the views of one flatten_grads_ buffer, at the addresses seen when they
# were validated, is recognised from those addresses alone (~0.3 ms for 2000); so are views that
# sit back to back in one bucket (DDP's gradient_as_bucket_view).
_KNOWN: OrderedDict[tuple[int, ...], tuple[weakref.ref, tuple[int, int] | None]] = OrderedDict()
_KNOWN_SIZE = 16


def grad_addresses(optimizer: torch.optim.Optimizer) -> tuple[int, ...] | None:
    """The data pointers of the optimizer's gradients in parameter order; None if a parameter has
    no gradient. (Only plain gradients validated as views of one buffer are ever remembered, so
    the addresses of anything else find nothing.)"""
    try:
        return tuple([p.grad.data_ptr() for group in optimizer.param_groups for p in group["params"]]) or None
    except (AttributeError, RuntimeError):  # a parameter without a gradient; a tensor without storage
        return None


def any_known() -> bool:
    """Whether any buffer is remembered: until then collect_grads does not read addresses at all."""
    return bool(_KNOWN)


def known_buffer(addresses: tuple[int, ...]) -> torch.Tensor | None:
    """The one tensor covering the gradients whose views had exactly these addresses when last
    validated: a flatten_grads_ buffer, or the run they form back to back in a bucket."""
    entry = _KNOWN.get(addresses)
    buffer = entry[0]() if entry is not None else None
    if buffer is None:
        return None
    _KNOWN.move_to_end(addresses)
    span = entry[1]
    if span is None:
        return buffer
    run = buffer.as_strided((span[1],), (1,), span[0])
    setattr(run, RUN_ATTR, True)
    return run


def remember_buffer(addresses: tuple[int, ...], buffer: torch.Tensor, span: tuple[int, int] | None = None) -> None:
    """Remember (weakly) that gradients at ``addresses`` were validated as all the views of
    ``buffer`` (a flatten_grads_ buffer), or, with ``span`` (storage offset, elements), as one run
    back to back inside it (a bucket)."""
    _KNOWN[addresses] = (weakref.ref(buffer), span)
    if len(_KNOWN) > _KNOWN_SIZE:
        _KNOWN.popitem(last=False)
