"""Gradients that are views of one buffer, read as few long runs instead of many small tensors.

Flat buffers (``tritonscale.flatten_grads_``, DDP's ``gradient_as_bucket_view=True`` buckets)
hold many gradients back to back in one storage. A pass over the views walks one tensor at a
time; over the buffer it is one tensor. ``flat_runs`` returns 1-D tensors covering the same
elements: maximal runs of gradients that sit back to back in memory inside one storage, and the
whole of a ``flatten_grads_`` buffer when the group fills every one of its slots. Elements that
belong to no gradient of the group (other parameters' gradients in a shared bucket, a slot whose
gradient moved away) are never covered, so the norm stays exactly the group's.

**The padding of a flatten_grads_ buffer.** Its views start at multiples of 16 elements; the gaps
between them belong to no gradient, yet a run over the whole buffer reads them. The user owns the
buffer and may write it whole (noise added to it, ``buf.fill_(nan)`` then
``zero_grad(set_to_none=False)``, which zeroes only the views), so the padding is zeroed every time
the whole buffer is handed out as a run (``zero_padding_``): one ``index_fill_`` over at most 15
elements per gradient, through an index ``flatten_grads_`` made once on the buffer's device (no
host read; nothing at all when every size is a multiple of 16). Cheaper than the alternatives:
runs that skip the padding are one per gradient, the walk over thousands of small tensors
(a pointer table on Triton, a foreach on torch) that the buffer exists to avoid; a buffer
without gaps loses each view's 16-element alignment (vector loads through a table, the aligned
path of fused optimizers), and its tail would still be padding.

**What proves a run, every call.** A run is memory: the bytes ``[start, start + numel * itemsize)``
of a storage that is alive. It stands for the group's gradients when (1) the gradients, all of
the run's dtype and dense (the caller validated both), occupy exactly those bytes between them,
back to back (a flatten_grads_ buffer: exactly its slots, the rest its padding), and (2) the
storage the run is cut from extends over all of them. Both are read from the gradients as they
are now -- their addresses and sizes, and the storage's extent -- never from history:
``Tensor._base`` names a candidate buffer only, because it keeps pointing at the old buffer after
``p.grad.data = ...`` or ``module.to(...)`` gave the gradient new memory. Live allocations never
overlap, so a gradient whose bytes lie inside a live storage *is* that memory, whichever tensor
object views it; an address the allocator reused for another dtype or another offset changes an
address or a size, or fails (2), and the layout is found anew.

Layouts are cached by what they are found from, (device, dtype, each gradient's address and size),
the 16 last used, and the rest of the proof is checked again on every call: a flatten_grads_
buffer is still alive at the address it had (held weakly), with the length it was made with, each
run still inside the storage of its first gradient (one read per run). The runs themselves are
made anew each time (a few ``as_strided`` views).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

#: Attribute set on a buffer made by tritonscale.flatten_grads_: its slots, as (element offset,
#: numel) pairs, one per gradient view it was made with.
FLAT_SLOTS_ATTR = "_tritonscale_flat_slots"
#: Attribute set on a buffer made by tritonscale.flatten_grads_: (its length when made, an int64
#: index on its device of the elements no slot holds, or None when there is no padding).
FLAT_PADDING_ATTR = "_tritonscale_flat_padding"
#: Attribute set on each run flat_runs makes (True): it spans several gradients.
RUN_ATTR = "_tritonscale_run"

#: (index of the gradient at the start of the run, elements in the run); elements -1: that
#: gradient as it is, not merged with another
Span = tuple[int, int]

#: The layouts last used, by memory key, least recent first; at most _LAYOUTS_KEPT. An OrderedDict,
#: not ``functools.lru_cache``: a layout is found from the gradients, not from its key, and an entry
#: whose proof failed is replaced. One for every thread's scaler: the lock keeps another thread's
#: eviction out of a store's dictionary calls (a lookup is one call).
_layouts: OrderedDict[tuple, _Layout] = OrderedDict()
_layouts_lock = threading.Lock()
_LAYOUTS_KEPT = 16


def memory_key(grads: list[torch.Tensor]) -> tuple:
    """What a layout of dense same-dtype gradients is, as memory: the device, the dtype and each
    gradient's (address, elements). Equal keys mean the same bytes, read as the same values."""
    return (grads[0].device, grads[0].dtype, tuple([(g.data_ptr(), g.numel()) for g in grads]))


def _storage_end(t: torch.Tensor) -> int:
    """The address just past the storage ``t`` views."""
    storage = t.untyped_storage()
    return storage.data_ptr() + storage.nbytes()


def flat_buffer(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``flatten_grads_`` buffer whose every slot holds one of ``grads`` (dense, one dtype),
    proved from the gradients' memory now, or None. The buffer is the candidate their ``_base``
    names; it counts only if the non-empty gradients fill its non-empty slots exactly, one each."""
    base = grads[0]._base
    slots = getattr(base, FLAT_SLOTS_ATTR, None)
    if slots is None or (base.dtype, base.device) != (grads[0].dtype, grads[0].device):
        return None
    if not is_whole(base):
        return None
    start, size = base.data_ptr(), base.element_size()
    wanted = sorted((start + offset * size, numel) for offset, numel in slots if numel)
    found = sorted((g.data_ptr(), g.numel()) for g in grads if g.numel())
    return base if found == wanted else None


def flat_runs(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """1-D tensors covering exactly the elements of ``grads`` (dense, non-overlapping, one dtype),
    or None when no two of them are back to back (nothing to gain: use the tensors themselves)."""
    if grads[0]._base is None and grads[-1]._base is None:
        # Gradients autograd allocated are not views: skip the layout key. Only a speed-up is
        # lost if a mixed list is misjudged, never a value.
        return None
    key = memory_key(grads)
    layout = _layouts.get(key)
    runs = layout.runs(grads) if layout is not None else STALE
    if runs is STALE:  # never seen, or its proof no longer holds: found anew from the memory now
        layout = _Layout.find(grads)
        runs = layout.runs(grads)
    with _layouts_lock:  # the most recent entry now; the least recent dropped past _LAYOUTS_KEPT
        _layouts[key] = layout
        _layouts.move_to_end(key)
        if len(_layouts) > _LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    return runs


#: What _Layout.runs returns when what it was found from no longer holds.
STALE = object()


class _Layout:
    """How one group's gradients merge into runs: the whole of a flatten_grads_ buffer (held
    weakly, with the address it had), or spans of the gradients themselves."""

    def __init__(self, buffer: torch.Tensor | None = None, spans: list[Span] | None = None) -> None:
        self.buffer = weakref.ref(buffer) if buffer is not None else None
        self.start, self.dtype = (buffer.data_ptr(), buffer.dtype) if buffer is not None else (0, None)
        self.spans = spans

    @classmethod
    def find(cls, grads: list[torch.Tensor]) -> _Layout:
        buffer = flat_buffer(grads)
        return cls(buffer=buffer) if buffer is not None else cls(spans=_find_spans(grads))

    def runs(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None | object:
        """The runs for ``grads``, whose memory key is the one this layout was found for; STALE
        when the memory around them changed: the buffer is gone or moved, or a run would leave
        the storage of its first gradient."""
        if self.buffer is not None:
            # Same gradient addresses and sizes, and the buffer still alive where it was, with the
            # same dtype and length: every slot is still one of them, the rest its padding (zeroed).
            buffer = self.buffer()
            if buffer is None or (buffer.data_ptr(), buffer.dtype) != (self.start, self.dtype):
                return STALE
            if not is_whole(buffer):
                return STALE
            return [zero_padding_(buffer)]
        if self.spans is None:
            return None
        runs = []
        for i, numel in self.spans:
            run = grads[i] if numel < 0 else cut_run(grads[i], numel)
            if run is None:
                return STALE
            runs.append(run)
        return runs


def cut_run(first: torch.Tensor, numel: int) -> torch.Tensor | None:
    """``numel`` elements of ``first``'s dtype from ``first``'s address on, as one 1-D run (marked
    with RUN_ATTR), or None when the storage of ``first`` ends before them."""
    if first.data_ptr() + numel * first.element_size() > _storage_end(first):
        return None
    run = first.as_strided((numel,), (1,), first.storage_offset())
    setattr(run, RUN_ATTR, True)
    return run


def is_whole(buffer: torch.Tensor) -> bool:
    """The flatten_grads_ buffer is as it was made: contiguous, its length then (so its slots and its
    padding index fit it, and nothing past them is read), inside its storage (not swapped or shrunk)."""
    made, _ = getattr(buffer, FLAT_PADDING_ATTR, (None, None))
    return (
        buffer.is_contiguous() and buffer.numel() == made and buffer.data_ptr() + buffer.nbytes <= _storage_end(buffer)
    )


def zero_padding_(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` (a whole flatten_grads_ buffer, ``is_whole``) with its padding set to zero, in one
    device op and no host read, so that a pass over the whole buffer reads only its gradients'
    values whatever was written over it: nothing else is the norm, an inf/NaN, or scaled.

    Example::

        (buffer,) = tritonscale.flatten_grads_(params)  # sizes 5 and 17: 11 + 15 padding elements
        buffer.fill_(float("nan"))
        optimizer.zero_grad(set_to_none=False)  # the views are zero, the padding still NaN
        zero_padding_(buffer)  # the padding is zero too
    """
    _, padding = getattr(buffer, FLAT_PADDING_ATTR)
    if padding is not None:
        buffer.index_fill_(0, padding, 0)
    return buffer


def spans_several(t: torch.Tensor) -> bool:
    """True for a run made by flat_runs or a flatten_grads_ buffer: one tensor standing for many
    gradients (a norm over it must be as accurate as over each of them)."""
    return getattr(t, RUN_ATTR, False) or getattr(t, FLAT_SLOTS_ATTR, None) is not None


def _find_spans(grads: list[torch.Tensor]) -> list[Span] | None:
    """Group the gradients into runs: sorted by address, each contiguous gradient that starts where
    the run before it ends, inside the storage of the run's first gradient, joins it."""
    spans: list[Span] = []
    merged = False
    order = sorted((i for i, g in enumerate(grads) if g.numel() > 0), key=lambda i: grads[i].data_ptr())
    end = limit = None  # address just past the open run; end of the storage it is cut from
    for i in order:
        g = grads[i]
        start, nbytes = g.data_ptr(), g.numel() * g.element_size()
        if g.is_contiguous() and start == end and start + nbytes <= limit:
            owner, numel = spans[-1]
            spans[-1] = (owner, numel + g.numel())
            merged = True
            end = start + nbytes
        elif g.is_contiguous():
            spans.append((i, g.numel()))
            end, limit = start + nbytes, _storage_end(g)
        else:
            spans.append((i, -1))
            end = limit = None
    return spans if merged else None


def one_run(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor covering exactly the elements of ``grads`` (dense, non-overlapping, one dtype):
    their ``flatten_grads_`` buffer or a single run back to back in a bucket, else None. The Triton
    launch takes it as one FLAT range (``kernels/tensor_table.describe_grads(..., run=...)``).

    Example::

        (buffer,) = tritonscale.flatten_grads_(params)
        assert one_run([p.grad for p in params]) is buffer
    """
    nonempty = [g for g in grads if g.numel()]
    runs = flat_runs(nonempty) if nonempty else None
    return runs[0] if runs is not None and len(runs) == 1 else None


def as_runs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat_runs(grads)``, or the gradients themselves (non-empty ones) when nothing merges.
    While Dynamo traces, always the gradients themselves: a traced tensor has no address, and a
    compiled graph runs again on whatever memory its inputs have then."""
    runs = None if torch.compiler.is_compiling() else flat_runs(grads)
    return runs if runs is not None else [g for g in grads if g.numel() > 0]
