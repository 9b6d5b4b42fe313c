"""Flat gradient buffers: every gradient of a (device, dtype) group as a view of one buffer.

With flat buffers each pass is a single launch over one contiguous range, with no pointer table,
and Triton can use 16-byte vector loads: every view starts at a multiple of 16 elements and the
buffer's length is a multiple of 16, which is what lets the compiler prove alignment. The gaps
between views (the padding) are no gradient's: a pass over the whole buffer zeroes them first
(``flat_runs.py``, ``zero_padding_``), so whatever the user writes there never counts.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_

import torch

from .flat_runs import FLAT_PADDING_ATTR, FLAT_SLOTS_ATTR, cut_run, is_whole, zero_padding_

ALIGN_ELEMENTS = 16


def _round_up(n: int) -> int:
    return -(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def flatten_grads_(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Give each parameter's ``.grad`` storage inside one flat buffer per (device, dtype).

    Existing gradient values are copied in; parameters without a gradient get zeros. Returns the
    buffers; writing one whole is fine (noise added to it, ``fill_``): only the views' elements are
    ever read as gradients. Autograd accumulates into the views in place, so keep them with
    ``optimizer.zero_grad(set_to_none=False)`` (``set_to_none=True`` drops the views and the next
    backward allocates ordinary gradients again, which still work, through the pointer table).

    Args:
        params: the parameters (an iterable, as ``model.parameters()``); repeated ones and those
            that do not require a gradient are left out.

    Returns:
        a list with one flat 1-D buffer per (device, dtype), each parameter's ``.grad`` a view into it.

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
        offset, slots, padding = 0, [], []
        for p in members:
            view = buffer[offset : offset + p.numel()].view(p.shape)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            slots.append((offset, p.numel()))
            padding.extend(range(offset + p.numel(), offset + _round_up(p.numel())))
            offset += _round_up(p.numel())
        setattr(buffer, FLAT_SLOTS_ATTR, tuple(slots))
        index = torch.tensor(padding, dtype=torch.int64, device=device) if padding else None
        setattr(buffer, FLAT_PADDING_ATTR, (total, index))
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
    whole of a flatten_grads_ buffer (``buffer``), or ``numel`` elements from the gradient
    ``grads[first]`` on (a bucket). Kept per optimizer (weakly), until a proof fails."""

    grads: list[torch.Tensor]  # the gradient tensors then, in parameter order (held: see run())
    addresses: list[int]  # their data_ptr then
    numels: list[int]  # their elements then
    dtype: torch.dtype  # theirs then (one), and the run's
    buffer: weakref.ref | None  # the flatten_grads_ buffer; None: a bucket run
    start: int  # the run's data_ptr then
    numel: int  # the run's elements
    first: int  # a bucket run: the index of the gradient it starts at

    def run(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The one tensor standing for ``grads`` (the optimizer's gradients now), or None if the
        proof fails. It holds when each gradient is the very tensor proved then, with the same
        address, elements and dtype, still contiguous -- so its elements are the same bytes read
        the same way, whatever ``g.set_``, ``g.as_strided_`` or ``g.data = ...`` did to its metadata
        -- and the run's memory is still there: the buffer alive where it was, as made (its padding
        then zeroed), or the bucket's storage still reaching past the run's end. The storage offset
        and the shape add nothing: the address and contiguity already fix the bytes, and a pass reads
        a gradient's elements in any shape. Holding the proved tensors keeps their memory from
        being freed and handed out again. A per-step cost of five reads per gradient, a fraction of
        the walk it saves (``collect_grads``)."""
        if len(grads) != len(self.grads) or not all(map(is_, grads, self.grads)):
            return None
        if list(map(_DATA_PTR, grads)) != self.addresses or list(map(_NUMEL, grads)) != self.numels:
            return None
        if not all(map(is_, map(_DTYPE, grads), repeat(self.dtype))) or not all(map(_IS_CONTIGUOUS, grads)):
            return None
        if self.buffer is None:
            return cut_run(grads[self.first], self.numel)
        buffer = self.buffer()
        if buffer is None or buffer.data_ptr() != self.start or buffer.dtype != self.dtype or not is_whole(buffer):
            return None
        return zero_padding_(buffer)


_known: weakref.WeakKeyDictionary[torch.optim.Optimizer, OneRun] = weakref.WeakKeyDictionary()
_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


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
    flatten_grads_ buffer, or a run cut from a bucket's storage (flat_runs). Only contiguous
    gradients of the run's dtype: what the proof reads again."""
    grads = _grads_of(optimizer)
    if any(g is None for g in grads):  # a parameter without a gradient is no part of a run
        return
    if not all(map(is_, map(_DTYPE, grads), repeat(run.dtype))) or not all(map(_IS_CONTIGUOUS, grads)):
        return
    addresses, numels = list(map(_DATA_PTR, grads)), list(map(_NUMEL, grads))
    if getattr(run, FLAT_SLOTS_ATTR, None) is not None:
        buffer, first = weakref.ref(run), -1
    else:
        starts = [i for i in range(len(grads)) if numels[i] and addresses[i] == run.data_ptr()]
        if not starts:
            return
        buffer, first = None, starts[0]
    _known[optimizer] = OneRun(grads, addresses, numels, run.dtype, buffer, run.data_ptr(), run.numel(), first)
