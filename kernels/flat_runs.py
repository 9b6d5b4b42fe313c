"""Gradients that are views of one buffer, read as few long runs instead of many small tensors.

Flat buffers (``tritonscale.flatten_grads_``, DDP's ``gradient_as_bucket_view=True`` buckets)
hold many gradients back to back in one storage. A pass over the views walks one tensor at a time
(2000 x 4K views: ~10.8 ms for a norm and a multiply on the 2-core development machine); over
the buffer it is one tensor (~2.4 ms). ``flat_runs`` returns 1-D tensors covering the same
elements: maximal runs of views that sit back to back in one storage, and the whole of a
``flatten_grads_`` buffer (padding included: it holds zeros) when the group holds all of its
views. Elements of the storage that belong to no gradient of the group (other parameters'
gradients in a shared bucket) are never covered, so the norm stays exactly the group's.

Layouts are cached by (addresses, sizes); the runs themselves are made anew on each call (a few
``as_strided`` views), so the cache holds no reference to gradient memory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

#: Attribute set on a buffer made by tritonscale.flatten_grads_: the number of gradient views in it.
FLAT_VIEWS_ATTR = "_tritonscale_flat_views"
#: Attribute set on each run flat_runs makes (True): it spans several gradients.
RUN_ATTR = "_tritonscale_run"

#: (index of a gradient whose storage holds the run, storage offset, elements); elements -1: that
#: gradient as it is (a non-contiguous one, never merged)
Span = tuple[int, int, int]

_spans: OrderedDict[tuple, list[Span] | None] = OrderedDict()
_CACHE_SIZE = 16


def flat_buffer(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``flatten_grads_`` buffer that the group's gradients -- all of its views -- are views
    of, or None."""
    base = grads[0]._base
    if base is not None and getattr(base, FLAT_VIEWS_ATTR, None) == len(grads):
        if all(g._base is base for g in grads):
            return base
    return None


def flat_runs(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """1-D tensors covering exactly the elements of ``grads`` (dense, non-overlapping, one dtype),
    or None when no two of them are back to back (nothing to gain: use the tensors themselves)."""
    if grads[0]._base is None and grads[-1]._base is None:
        # Gradients autograd allocated are not views: skip the layout key (~0.4 ms for 2000
        # tensors each step). Only a speed-up is lost if a mixed list is misjudged, never a value.
        return None
    key = tuple((g.data_ptr(), g.numel()) for g in grads)
    if key in _spans:
        _spans.move_to_end(key)
        spans = _spans[key]
    else:
        spans = _find_spans(grads)
        _spans[key] = spans
        if len(_spans) > _CACHE_SIZE:
            _spans.popitem(last=False)
    if spans is None:
        return None
    runs = []
    for i, offset, numel in spans:
        if numel < 0:
            runs.append(grads[i])
        else:
            run = grads[i].as_strided((numel,), (1,), offset)
            setattr(run, RUN_ATTR, True)
            runs.append(run)
    return runs


def spans_several(t: torch.Tensor) -> bool:
    """True for a run made by flat_runs or a flatten_grads_ buffer: one tensor standing for many
    gradients (a norm over it must be as accurate as over each of them)."""
    return getattr(t, RUN_ATTR, False) or getattr(t, FLAT_VIEWS_ATTR, None) is not None


def _find_spans(grads: list[torch.Tensor]) -> list[Span] | None:
    base = flat_buffer(grads)
    if base is not None:
        return [(0, base.storage_offset(), base.numel())]
    spans: list[Span] = []
    merged = False
    order = sorted(
        (i for i, g in enumerate(grads) if g.numel() > 0),
        key=lambda i: (grads[i].untyped_storage().data_ptr(), grads[i].data_ptr()),
    )
    end_of_last = None  # (storage address, element offset just past the last span)
    for i in order:
        g = grads[i]
        storage, offset = g.untyped_storage().data_ptr(), g.storage_offset()
        if g.is_contiguous() and end_of_last == (storage, offset):
            owner, start, numel = spans[-1]
            spans[-1] = (owner, start, numel + g.numel())
            merged = True
        else:
            spans.append((i, offset, g.numel()) if g.is_contiguous() else (i, -1, -1))
        end_of_last = (storage, offset + g.numel()) if g.is_contiguous() else None
    return spans if merged else None


def as_runs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat_runs(grads)``, or the gradients themselves (non-empty ones) when nothing merges."""
    runs = flat_runs(grads)
    return runs if runs is not None else [g for g in grads if g.numel() > 0]
