"""Gradients that are views of one buffer, read as few long runs instead of many small tensors.

Flat buffers (``tritonscale.flatten_grads_``, DDP's ``gradient_as_bucket_view=True`` buckets)
hold many gradients back to back in one storage. A pass over the views walks one tensor at a
time; over the buffer it is one tensor. ``flat_runs`` returns 1-D tensors covering the same
elements: maximal runs of gradients that sit back to back in memory inside one storage, and the
whole of a ``flatten_grads_`` buffer (padding included: it holds zeros) when the group fills
every one of its slots. Elements that belong to no gradient of the group (other parameters'
gradients in a shared bucket, a slot whose gradient moved away) are never covered, so the norm
stays exactly the group's.

**What proves a run, every call.** A run is memory: the bytes ``[start, start + numel * itemsize)``
of a storage that is alive. It stands for the group's gradients when (1) the gradients, all of
the run's dtype and dense (the caller validated both), occupy exactly those bytes between them,
back to back, and (2) the storage the run is cut from extends over all of them. Both are read
from the gradients as they are now -- their addresses and sizes, and the storage's extent -- never
from history: ``Tensor._base`` names a candidate buffer only, because it keeps pointing at the old
buffer after ``p.grad.data = ...`` or ``module.to(...)`` gave the gradient new memory. Live
allocations never overlap, so a gradient whose bytes lie inside a live storage *is* that memory,
whichever tensor object views it; an address the allocator reused for another dtype or another
offset changes an address or a size, or fails (2), and the layout is found anew.

Layouts are cached by what they are found from, (device, dtype, each gradient's address and size), and
the rest of the proof is checked again on every call: a flatten_grads_ buffer is still alive at
the address it had (held weakly), each run still inside the storage of its first gradient (one
read per run). The runs themselves are made anew each time (a few ``as_strided`` views).
"""

from __future__ import annotations

import weakref

import torch

from .bounded_cache import BoundedCache

#: Attribute set on a buffer made by tritonscale.flatten_grads_: its slots, as (element offset,
#: numel) pairs, one per gradient view it was made with.
FLAT_SLOTS_ATTR = "_tritonscale_flat_slots"
#: Attribute set on each run flat_runs makes (True): it spans several gradients.
RUN_ATTR = "_tritonscale_run"

#: (index of the gradient at the start of the run, elements in the run); elements -1: that
#: gradient as it is, not merged with another
Span = tuple[int, int]

_layouts: BoundedCache[_Layout] = BoundedCache(16)


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
    if not _whole(base):
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
    _layouts.put(key, layout)
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
            # same dtype and length: every slot is still one of them, the rest its zero padding.
            buffer = self.buffer()
            if buffer is None or (buffer.data_ptr(), buffer.dtype) != (self.start, self.dtype) or not _whole(buffer):
                return STALE
            return [buffer]
        if self.spans is None:
            return None
        runs = []
        for i, numel in self.spans:
            g = grads[i]
            if numel < 0:
                runs.append(g)
                continue
            if g.data_ptr() + numel * g.element_size() > _storage_end(g):
                return STALE
            run = g.as_strided((numel,), (1,), g.storage_offset())
            setattr(run, RUN_ATTR, True)
            runs.append(run)
        return runs


def _whole(buffer: torch.Tensor) -> bool:
    """The flatten_grads_ buffer still covers all of its slots: its storage was not swapped or shrunk."""
    slots = getattr(buffer, FLAT_SLOTS_ATTR, ())
    end = max((offset + numel for offset, numel in slots), default=0)
    return (
        buffer.is_contiguous() and buffer.numel() >= end and buffer.data_ptr() + buffer.nbytes <= _storage_end(buffer)
    )


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


def as_runs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat_runs(grads)``, or the gradients themselves (non-empty ones) when nothing merges.
    While Dynamo traces, always the gradients themselves: a traced tensor has no address, and a
    compiled graph runs again on whatever memory its inputs have then."""
    runs = None if torch.compiler.is_compiling() else flat_runs(grads)
    return runs if runs is not None else [g for g in grads if g.numel() > 0]
