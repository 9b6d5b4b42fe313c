"""Multi-tensor addressing: one launch covers any number of same-dtype gradient tensors.

A group (one device, one dtype) reaches a kernel in one of two layouts:

* FLAT: one contiguous buffer, passed as a typed pointer plus its element count. Triton specialises
  both for divisibility by 16 when they are, which is what turns the loads into 16-byte vectors
  (``ld.global.v4``); ``tritonscale.flatten_grads_`` pads and aligns buffers for exactly that.
* TABLE: any list of dense tensors, described by two small int64 tables that live on the device:

      tensors [T, 2]: (address, numel) of each tensor
      chunks  [C, 2]: (tensor index, first element) for every CHUNK elements of every tensor

  Persistent programs walk the chunk rows grid-stride, so the launch count is one per pass no
  matter how many tensors there are, and the per-program partials have a fixed count.

Which gradients form one run (a ``flatten_grads_`` buffer, a DDP bucket) is host-side layout
logic, the caller's (``tritonscale/grads/flat_runs.py``): it hands the run in (``run=``), and a
group without one goes FLAT only when it is a single contiguous tensor.

The tables are cached as pure functions of their keys, so a hit is the table these gradients need,
whatever happened to the memory in between: the chunks table by (device, sizes), the tensors table
by (device, addresses, sizes). Gradients that persist between steps (``zero_grad(set_to_none=False)``)
cost no table work after the first step; gradients re-allocated every step (``set_to_none=True``,
torch's default) rebuild only the tensors table, on the host in one conversion, and reach the device
by an asynchronous copy from pinned memory (the host never waits for it). The keys hold no stream: a
stream that did not queue a table's copy waits for that copy's event before its kernels read it
(``ready_tables``), so tables built during a warm-up on a side stream serve a CUDA graph's capture.
"""

from __future__ import annotations

import array
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .launch_config import CHUNK, program_cap
from .supported import is_supported_grad, raise_unsupported_grad

__all__ = ["GradLayout", "describe_grads", "validate_group"]


@dataclass(frozen=True)
class GradLayout:
    """How one (device, dtype) group of gradients is presented to the kernels."""

    first: torch.Tensor  # FLAT: the whole buffer; TABLE: any member (gives the element type)
    flat: bool
    num_items: int  # FLAT: elements; TABLE: chunk rows
    tensors: torch.Tensor  # int64 [T, 2] (TABLE) or a 1-element placeholder (FLAT)
    chunks: torch.Tensor  # int64 [C, 2] (TABLE) or a 1-element placeholder (FLAT)
    programs: int  # persistent programs a pass launches for this group
    numel: int  # gradient elements covered
    aligned: bool = False  # TABLE: every address is 16-byte aligned and every numel a multiple of 16

    @property
    def device(self) -> torch.device:
        return self.first.device


def validate_group(grads: list[torch.Tensor]) -> None:
    """Raise a clear error for gradients the kernels cannot update in place (nothing is touched)."""
    device, dtype = grads[0].device, grads[0].dtype
    for i, g in enumerate(grads):
        if not is_supported_grad(g):
            raise_unsupported_grad(g, f"gradient {i}")
        if g.device != device:
            raise ValueError(f"gradients on mixed devices in one group: {device} and {g.device} (gradient {i})")
        if g.dtype != dtype:
            raise ValueError(f"gradients of mixed dtypes in one group: {dtype} and {g.dtype} (gradient {i})")


def _flat_base(nonempty: list[torch.Tensor], run: torch.Tensor | None) -> torch.Tensor | None:
    """The buffer to take as FLAT: ``run`` (the caller's one tensor covering the group's elements
    exactly: a flatten_grads_ buffer, padded to a multiple of 16 elements so loads vectorise, or a
    bucket run), or the group's one contiguous tensor."""
    if run is not None:
        return run
    if len(nonempty) == 1 and nonempty[0].is_contiguous():
        return nonempty[0]
    return None


_placeholders: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """An int64 table argument for FLAT launches, which never read it."""
    if device not in _placeholders:
        _placeholders[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return _placeholders[device]


def _tables_for(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    addresses = tuple([g.data_ptr() for g in grads])
    numels = tuple([g.numel() for g in grads])
    return ready_tables(grads[0].device, addresses, numels)


def ready_tables(
    device: torch.device, addresses: tuple[int, ...], numels: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``_tables`` for these gradients, ready to be read by the kernels of the current stream.

    A table's copy is asynchronous on the stream that built it, so only that stream's kernels are
    ordered after it. The tables are keyed by what they describe (addresses, sizes), not by the
    stream: a stream that did not build them waits for their copies' events before reading them
    (one ``wait_event`` each, no host wait). That is what lets a table built during warm-up on a
    side stream serve the capture stream of ``torch.cuda.graph(g)``. Inside a capture no wait is
    made: waiting on an event recorded outside the capture is invalid in a CUDA graph, and none is
    needed, since ``torch.cuda.graph`` synchronizes the device before the capture begins (a raw
    ``CUDAGraph.capture_begin`` needs ``torch.cuda.synchronize()`` before it, as that does)."""
    tensors, chunks, aligned, uploads = _tables(device, addresses, numels)
    _order_after(uploads, device)
    return tensors, chunks, aligned


@dataclass(frozen=True)
class Upload:
    """A table's asynchronous copy: the stream it was queued on (its handle) and an event after it."""

    stream: int
    done: Any  # torch.cuda.Event, recorded on ``stream`` right after the copy


def _order_after(uploads: tuple[Upload | None, ...], device: torch.device) -> None:
    """Make the current stream's later kernels wait for the copies in ``uploads`` it did not queue."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return  # the CPU copies nothing; a capture began after a device synchronize (see ready_tables)
    stream = torch.cuda.current_stream(device)
    for upload in uploads:
        if upload is not None and upload.stream != stream.cuda_stream:
            stream.wait_event(upload.done)


@functools.lru_cache(maxsize=16)
def _tables(
    device: torch.device, addresses: tuple[int, ...], numels: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, bool, tuple[Upload | None, Upload | None]]:
    """The (tensors, chunks) tables and the alignment of the gradients at ``addresses`` with
    ``numels`` elements each, and the tables' copies (``ready_tables`` orders a reader after
    them): a pure function of its arguments, so a cached entry is always the right one. Only the
    tensors table holds addresses; the chunks table comes from the sizes alone (``_chunk_table``),
    so gradients re-allocated at new addresses every step (``zero_grad(set_to_none=True)``,
    torch's default) rebuild only the [T, 2] tensors table."""
    chunks, sizes_aligned, chunks_upload = _chunk_table(device, numels)
    tensors = torch.stack([_int64(addresses), _int64(numels)], dim=1)
    # Alignment the compiler cannot see through a loaded address; the kernels assert it with
    # tl.multiple_of so that table launches get 16-byte vector loads too.
    aligned = sizes_aligned and functools.reduce(operator.or_, addresses) % 16 == 0
    tensors, tensors_upload = _to_device(tensors, device)
    return tensors, chunks, aligned, (tensors_upload, chunks_upload)


@functools.lru_cache(maxsize=16)
def _chunk_table(device: torch.device, numels: tuple[int, ...]) -> tuple[torch.Tensor, bool, Upload | None]:
    """The chunks table [C, 2] (tensor index, first element) of tensors of ``numels`` elements,
    whether every numel is a multiple of 16 (a pure function of the sizes), and its copy.

    Example: numels (CHUNK + 1, 5) give the rows (0, 0), (0, CHUNK), (1, 0)."""
    counts = [(numel + CHUNK - 1) // CHUNK for numel in numels]
    per_tensor, rows = _int64(counts), sum(counts)
    owner = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), per_tensor, output_size=rows)
    first_chunk = torch.cumsum(per_tensor, 0) - per_tensor
    starts = (torch.arange(rows, dtype=torch.int64) - first_chunk[owner]) * CHUNK
    chunks, upload = _to_device(torch.stack([owner, starts], dim=1), device)
    return chunks, functools.reduce(operator.or_, numels) % 16 == 0, upload


def _int64(values: Sequence[int]) -> torch.Tensor:
    """A 1-D int64 host tensor of ``values`` (one C-level conversion, no per-element tensor op)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _to_device(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Upload | None]:
    """``host`` (a freshly built int64 table) on ``device``, without blocking the host, and its copy.

    On the CPU the device is the host: no copy. On CUDA/ROCm the table goes through pinned memory
    with an asynchronous copy: from pageable memory the host would wait for the copy, and so for
    all the work queued before it on the stream. Dropping the pinned block right after the call is
    safe: torch's caching host allocator records the copy's stream event and does not hand the
    block out again until that copy has read it. (A CPU-only torch build cannot pin, and never
    gets here.) Other devices: a plain copy. Under CUDA graph capture a copy would become a node of
    the graph that reads a pinned block long since given back: refused, naming the fix."""
    if device.type == "cpu":
        return host, None
    if device.type != "cuda":
        return host.to(device), None
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "tritonscale: these gradients' launch tables are not built yet, and the stream is capturing a CUDA "
            "graph; run the step outside the capture first (warm-up steps, as torch.cuda.graph requires) with "
            "the gradients at the addresses the graph will use (the same tensors: zero_grad(set_to_none=False), "
            "or the same flatten_grads_ buffer)"
        )
    pinned = host.pin_memory()
    table = torch.empty(pinned.shape, dtype=pinned.dtype, device=device).copy_(pinned, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    done = torch.cuda.Event()
    done.record(stream)
    return table, Upload(stream.cuda_stream, done)


def describe_grads(
    grads: list[torch.Tensor], *, validate: bool = True, run: torch.Tensor | None = None
) -> GradLayout | None:
    """Describe a non-empty list of same-device, same-dtype gradients for one launch per pass.

    Returns None when the group holds no elements (nothing to launch). ``validate=False`` skips
    the checks of ``validate_group`` for callers that already made them. ``run``: one 1-D tensor
    whose elements are exactly the gradients' (the caller proved it: ``grads/flat_runs.one_run``),
    launched as one FLAT range instead of the pointer table.

    Example::

        layout = describe_grads([torch.randn(300, 257).t(), torch.randn(5)])  # TABLE: two tensors
        apply_factor_(layout, factor)
    """
    if validate:
        validate_group(grads)
    nonempty = [g for g in grads if g.numel() > 0]
    if not nonempty:
        return None
    base = _flat_base(nonempty, run)
    grads = nonempty
    cap = program_cap(grads[0].device)
    if base is not None:
        placeholder = _placeholder(base.device)
        numel = base.numel()
        programs = max(1, min(-(-numel // CHUNK), cap))  # (triton.cdiv, without its wrapper's cost)
        return GradLayout(base, True, numel, placeholder, placeholder, programs, numel)
    tensors, chunks, aligned = _tables_for(grads)
    num_chunks = chunks.shape[0]
    numel = sum(g.numel() for g in grads)
    return GradLayout(grads[0], False, num_chunks, tensors, chunks, min(num_chunks, cap), numel, aligned)
