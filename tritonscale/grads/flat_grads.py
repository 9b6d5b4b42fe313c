"""Flat gradient buffers: every gradient of a (device, dtype) group as a view of one buffer.

With flat buffers each pass is a single launch over one contiguous range, with no pointer table,
and Triton can use 16-byte vector loads: every view starts at a multiple of 16 elements and the
buffer's length is a multiple of 16, which is what lets the compiler prove alignment.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter, is_

import torch

from ..kernels.flat_runs import FLAT_SLOTS_ATTR, RUN_ATTR

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
        offset, slots = 0, []
        for p in members:
            view = buffer[offset : offset + p.numel()].view(p.shape)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            slots.append((offset, p.numel()))
            offset += _round_up(p.numel())
        setattr(buffer, FLAT_SLOTS_ATTR, tuple(slots))
        buffers.append(buffer)
    return buffers


# ------------------------------------------------- recognising a buffer again, per step
# Walking and validating thousands of gradients costs more Python per step than one norm and one
# multiply over their elements. An optimizer whose gradients were validated as exactly the views
# of one flatten_grads_ buffer, or as one run back to back in a bucket (DDP's
# gradient_as_bucket_view), is recognised on later steps by a proof that reads each gradient
# once more (OneRun.run): nothing learned earlier is trusted without it.


@dataclass(frozen=True)
class OneRun:
    """An optimizer's gradients, proved at some step to be exactly the memory of one run: the
    whole of a flatten_grads_ buffer (``span`` None) or ``span`` = (storage offset, elements) of
    the tensor whose storage holds a bucket. Kept per optimizer (weakly), until a proof fails."""

    grads: list[torch.Tensor]  # the gradient tensors then, in parameter order (held: see run())
    addresses: list[int]  # their data_ptr then
    holder: weakref.ref  # the buffer, or the bucket's base tensor
    start: int  # the holder's data_ptr then
    dtype: torch.dtype
    numel: int  # the holder's elements then
    span: tuple[int, int] | None

    def run(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The one tensor standing for ``grads`` (the optimizer's gradients now), or None if the
        proof fails. It holds when each is the very tensor proved then, still at its address, and
        the holder is alive with the same memory. Holding the proved tensors keeps their memory
        from being freed and handed out again, so an address cannot be reused under them; a
        gradient given new memory -- ``module.to``, ``p.grad.data = ...`` -- has another address,
        and a new gradient tensor (``p.grad = ...``, a re-flatten, a backward after
        ``zero_grad(set_to_none=True)``) is another object. What is not read again is a proved
        tensor's size and dtype: changing those at the same address takes rewriting its
        metadata in place over the same memory (``g.set_``, ``g.resize_``), which no optimizer,
        autograd or ``Module`` method does."""
        if len(grads) != len(self.grads) or not all(map(is_, grads, self.grads)):
            return None
        if list(map(_DATA_PTR, grads)) != self.addresses:
            return None
        holder = self.holder()
        if holder is None or holder.data_ptr() != self.start or holder.dtype != self.dtype:
            return None
        if holder.numel() != self.numel or not holder.is_contiguous():
            return None
        if self.span is None:
            return holder
        offset, numel = self.span
        if (offset + numel) * holder.element_size() > holder.untyped_storage().nbytes():
            return None
        run = holder.as_strided((numel,), (1,), offset)
        setattr(run, RUN_ATTR, True)
        return run


_known: weakref.WeakKeyDictionary[torch.optim.Optimizer, OneRun] = weakref.WeakKeyDictionary()
_GRAD = attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr


def _grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    """Every parameter's ``.grad`` (None where it has none), in parameter order."""
    grads: list[torch.Tensor | None] = []
    for group in optimizer.param_groups:
        grads.extend(map(_GRAD, group["params"]))
    return grads


def known_run(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The flatten_grads_ buffer or bucket run that the optimizer's gradients were proved to be
    at an earlier step, if the proof still holds now (``OneRun.run``); else None (and forgotten)."""
    known = _known.get(optimizer)
    if known is None:
        return None
    run = known.run(_grads_of(optimizer))
    if run is None:
        del _known[optimizer]
    return run


def remember_run(optimizer: torch.optim.Optimizer, run: torch.Tensor) -> None:
    """Remember that the optimizer's gradients, every one just validated, are exactly ``run``: a
    flatten_grads_ buffer, or a run cut from a bucket's storage (flat_runs)."""
    grads = _grads_of(optimizer)
    if any(g is None for g in grads):  # a parameter without a gradient is no part of a run
        return
    holder = run if getattr(run, FLAT_SLOTS_ATTR, None) is not None else grads[0]._base
    if holder is None or holder.untyped_storage().data_ptr() != run.untyped_storage().data_ptr():
        return
    span = None if holder is run else (run.storage_offset(), run.numel())
    addresses = list(map(_DATA_PTR, grads))
    holder_ref = weakref.ref(holder)
    _known[optimizer] = OneRun(grads, addresses, holder_ref, holder.data_ptr(), holder.dtype, holder.numel(), span)
