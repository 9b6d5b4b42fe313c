"""tensor_table (kernels/tensor_table.py): which groups run FLAT and which through the pointer table,
with every pass over each layout; non-dense gradients refused; empty gradients skipped; the tables
cached as pure functions of their keys (sizes; addresses and sizes) while gradients move."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.kernel_cases import (
    DTYPES,
    SETTINGS_SMALL,
    assert_bitwise,
    assert_norm_close,
    check_finalize_result,
    check_partials_summary,
    make_grads,
    max_norm_for,
    norm_types_st,
    run_check,
    scales_st,
    seeds_st,
)

from tritonscale.kernels import GradLayout, apply_factor_, describe_grads, tensor_table
from tritonscale.kernels.launch_config import CHUNK
from tritonscale.kernels.reference import apply_ref, finalize_ref


def dense_layout_cases() -> dict:
    gen = torch.Generator().manual_seed(17)
    big = torch.randn(70000, generator=gen)
    return {
        # name: (grads, expected FLAT?, storage to check for stray writes or None)
        "contiguous-1d": ([torch.randn(CHUNK + 1, generator=gen)], True, None),
        "contiguous-2d": ([torch.randn(257, 300, generator=gen)], True, None),
        "offset-view": ([big[3 : 3 + CHUNK + 10]], True, big),
        "transposed-2d": ([torch.randn(300, 257, generator=gen).t()], False, None),
        "permuted-3d": ([torch.randn(7, 90, 110, generator=gen).permute(2, 0, 1)], False, None),
        "size1-dim-with-odd-stride": (
            [torch.randn(5 * 7, generator=gen).as_strided((5, 1, 7), (7, 999, 1))],
            True,
            None,
        ),
        "zero-dim": ([torch.tensor(-2.5), torch.randn(10, generator=gen)], False, None),
        "mixed-table": (
            [torch.randn(300, 257, generator=gen).t(), torch.tensor(4.0), torch.zeros(0), big[:5000]],
            False,
            big,
        ),
    }


@pytest.mark.parametrize("case", sorted(dense_layout_cases()))
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=lambda n: f"norm={n:g}")
def test_dense_layouts(case, norm_type):
    grads, expect_flat, storage = dense_layout_cases()[case]
    layout = describe_grads(grads)
    assert layout.flat == expect_flat
    assert layout.numel == sum(g.numel() for g in grads)
    storage_before = storage.clone() if storage is not None else None
    originals = [g.clone() for g in grads]
    max_norm = max_norm_for(grads, 3.0, norm_type, 0.5)
    layout, partials, res, result = run_check(grads, 3.0, norm_type, max_norm)
    check_partials_summary(partials, layout.programs, grads)
    check_finalize_result(res, finalize_ref(grads, 3.0, norm_type, max_norm), torch.float32, 3.0, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, res[3]))):
        assert_bitwise(g, e, f"gradient {i}")
    if storage is not None:  # elements of the underlying storage outside the views are untouched
        untouched = torch.ones(storage.numel(), dtype=torch.bool)
        for g in grads:
            if g.numel() and g.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr():
                offset = g.storage_offset()
                untouched[offset : offset + g.numel()] = False
        assert_bitwise(storage[untouched], storage_before[untouched], "storage outside the views")


def non_dense_cases() -> dict:
    return {
        "strided-slice": lambda: torch.randn(20)[::2],
        "column-slice": lambda: torch.randn(4, 5)[:, :3],
        "expanded": lambda: torch.randn(3, 1).expand(3, 4),
    }


@pytest.mark.parametrize("case", sorted(non_dense_cases()))
def test_non_dense_gradient_is_refused_by_the_launchers(case):
    """describe_grads refuses it, alone or in a TABLE: the kernels update in place and would work
    on a copy. (The controller sends such gradients to torch ops instead:
    tests/passes/test_grad_passes.py.)"""
    bad = non_dense_cases()[case]()
    with pytest.raises(ValueError, match="not dense"):
        describe_grads([bad])
    with pytest.raises(ValueError, match="not dense"):
        describe_grads([torch.randn(100), bad])


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 3), (2, 0, 4)], ids=lambda s: "x".join(map(str, s)))
def test_empty_gradients_are_skipped(shape):
    """Zero-element tensors of any shape (e.g. nn.Linear(0, 3).weight's gradient, shape (3, 0) with
    strides (1, 1)) hold nothing to check: a group of them has no layout, and next to a real
    gradient they change nothing."""
    assert describe_grads([torch.zeros(shape), torch.zeros(0)]) is None
    grads = [torch.zeros(shape), torch.randn(33)]
    layout, _, res, _ = run_check(grads, 2.0, 2.0, None)
    assert layout.flat and layout.numel == 33
    assert_norm_close(res[1], finalize_ref(grads, 2.0, 2.0, None).norm, torch.float32)


# ---------------------------------------------------------------------------------------------------
# The cached tables while gradients move


def fresh_tables(grads: list[torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """The (tensors, chunks) tables of ``grads`` built from scratch in plain Python: the oracle the
    cached tables must equal."""
    nonempty = [g for g in grads if g.numel() > 0]
    tensors = [[g.data_ptr(), g.numel()] for g in nonempty]
    chunks = [[i, start] for i, g in enumerate(nonempty) for start in range(0, g.numel(), CHUNK)]
    return tensors, chunks


def assert_tables_fresh(layout: GradLayout, grads: list[torch.Tensor]) -> None:
    tensors, chunks = fresh_tables(grads)
    assert not layout.flat
    assert layout.tensors.tolist() == tensors, "tensors table"
    assert layout.chunks.tolist() == chunks, "chunks table"


def check_and_apply(grads: list[torch.Tensor], scale: float, norm_type: float) -> GradLayout:
    """A check pass and an apply pass through describe_grads, each against the plain-torch reference."""
    originals = [g.clone() for g in grads]
    layout, partials, res, result = run_check(grads, scale, norm_type, None)
    check_partials_summary(partials, layout.programs, grads)
    check_finalize_result(res, finalize_ref(originals, scale, norm_type, None), grads[0].dtype, scale, None)
    apply_factor_(layout, result[3:4])
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, res[3]))):
        assert_bitwise(g, e, f"gradient {i}")
    return layout


# At least two non-empty gradients (one alone goes FLAT); small, since each step runs three
# interpreted launches (gradients over a chunk: test_new_sizes_at_the_same_addresses_get_their_own_tables).
table_sizes_st = st.lists(st.integers(0, 300), min_size=2, max_size=6).filter(lambda sizes: sum(map(bool, sizes)) >= 2)


@settings(SETTINGS_SMALL, max_examples=8)
@given(
    sizes=table_sizes_st,
    steps=st.integers(2, 3),
    dtype=st.sampled_from(DTYPES),
    norm_type=norm_types_st,
    scale=scales_st,
    seed=seeds_st,
)
def test_reallocated_gradients_rebuild_only_the_tensors_table(sizes, steps, dtype, norm_type, scale, seed):
    """``zero_grad(set_to_none=True)`` (torch's default) hands every step new gradients of the same
    sizes at new addresses: every pass matches the reference each step, the chunks table (sizes
    only) is built once (one tensor, the same every step), the tensors table (addresses) is built
    anew each step (a cache miss each), and both equal a fresh build."""
    table_builds = tensor_table._tables.cache_info().misses
    kept, first = [], None
    for step in range(steps):
        grads = make_grads(sizes, dtype, seed + step, 1.0)
        kept.append(grads)  # kept alive: the next step's gradients cannot take these addresses
        layout = check_and_apply(grads, scale, norm_type)
        assert_tables_fresh(layout, grads)
        first = first or layout
        assert layout.chunks is first.chunks, f"step {step}: chunks table rebuilt for gradients that only moved"
    assert tensor_table._tables.cache_info().misses - table_builds == steps


def test_new_sizes_at_the_same_addresses_get_their_own_tables():
    """A new parameter set whose gradients start where the old ones did (views of one buffer at fixed
    offsets): the addresses are equal and the sizes are not, in the same number of chunk rows or
    another; the tables follow the sizes, the passes match the reference, and the buffer outside the
    views is untouched."""
    buffer = torch.randn(2 * CHUNK + 600, generator=torch.Generator().manual_seed(23))
    offsets = (0, CHUNK + 300)
    chunks_seen = []
    for sizes in [(300, CHUNK + 1), (CHUNK + 1, 300), (17, 300)]:
        grads = [buffer[offset : offset + n] for offset, n in zip(offsets, sizes)]
        outside = torch.ones(buffer.numel(), dtype=torch.bool)
        for offset, n in zip(offsets, sizes):
            outside[offset : offset + n] = False
        before = buffer[outside].clone()
        layout = check_and_apply(grads, 2.0**16, 2.0)
        assert_tables_fresh(layout, grads)
        assert_bitwise(buffer[outside], before, f"{sizes}: the buffer outside the views")
        chunks_seen.append(layout.chunks)
    again = describe_grads([buffer[offset : offset + n] for offset, n in zip(offsets, (300, CHUNK + 1))])
    assert again.chunks is chunks_seen[0]  # the first sizes again: their cached table


def test_a_table_to_build_under_cuda_graph_capture_is_refused(monkeypatch):
    """A table first built while the stream captures a CUDA graph would leave in the graph a copy
    reading a pinned block given back at once: refused, naming the fix (a warm-up step outside the
    capture), and nothing cached. The capture is stood in for on the CPU: the check comes before
    any CUDA call."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    caches = (tensor_table._tables, tensor_table._chunk_table)
    for cache in caches:
        cache.cache_clear()  # pure functions of their keys: emptying them changes no result
    with pytest.raises(RuntimeError, match="outside the capture"):
        tensor_table._tables(torch.device("cuda"), (4096, 8192), (300, 17))
    assert [cache.cache_info().currsize for cache in caches] == [0, 0]


@pytest.mark.gpu
def test_gpu_reallocated_gradients_tables_without_waiting_or_reading(forbid_host_reads):
    """On CUDA, gradients re-allocated at new addresses get a tensors table equal to a fresh build,
    uploaded without the host waiting on the stream (sync debug mode "error": a pageable copy
    synchronizes) and without a device-to-host read; the apply pass through it is exact."""
    sizes = [(300, 257), (CHUNK + 1,), (5,), (17,)]
    gen = torch.Generator(device="cuda").manual_seed(5)
    steps = [[torch.randn(size, device="cuda", generator=gen) for size in sizes] for _ in range(2)]
    first = describe_grads(steps[0])
    grads = steps[1]  # the first step's gradients stay alive: new addresses, same sizes
    torch.cuda.set_sync_debug_mode("error")
    try:
        with forbid_host_reads.armed():
            layout = describe_grads(grads)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert layout.chunks is first.chunks
    assert_tables_fresh(layout, grads)
    originals = [g.clone() for g in grads]
    apply_factor_(layout, torch.tensor([0.5], device="cuda"))
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, 0.5))):
        assert_bitwise(g, e, f"gradient {i}")


class FakeStream:
    """Stands for a CUDA stream on the CPU: its handle and the events it was made to wait for."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.waited = handle, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    """Table builds on a stand-in "cuda" device: each copy is an Upload on the current fake stream
    (its event a fresh object), and ``streams[k]`` is made current by ``current[0] = k``."""
    streams, current, built = {k: FakeStream(k) for k in (11, 22)}, [11], []

    def to_device(host, device):
        upload = tensor_table.Upload(current[0], object())
        built.append(upload)
        return host, upload

    monkeypatch.setattr(tensor_table, "_to_device", to_device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current[0]])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for cache in (tensor_table._tables, tensor_table._chunk_table):
        cache.cache_clear()
    yield streams, current, built
    for cache in (tensor_table._tables, tensor_table._chunk_table):
        cache.cache_clear()  # the fake uploads must not outlive the test


def test_another_stream_reads_the_same_tables_after_their_copies(fake_cuda_streams):
    """The tables are keyed by what they describe, not by the stream (torch.cuda.graph captures on a
    stream of its own, after a warm-up on a side stream): the stream that built them reads them as
    they are; another gets the same tables, no second build, and waits on both copies' events
    first (the ordering the old per-stream keys gave, by an event instead of a second copy)."""
    streams, current, built = fake_cuda_streams
    cuda, key = torch.device("cuda"), ((4096, 8192), (300, CHUNK + 17))
    first = tensor_table.ready_tables(cuda, *key)
    assert len(built) == 2 and streams[11].waited == []  # its own copies: ordered already
    current[0] = 22
    other = tensor_table.ready_tables(cuda, *key)
    assert other[0] is first[0] and other[1] is first[1] and len(built) == 2  # no rebuild
    assert {id(e) for e in streams[22].waited} == {id(upload.done) for upload in built} and len(streams[22].waited) == 2


def test_inside_a_capture_the_tables_are_read_without_a_wait(fake_cuda_streams, monkeypatch):
    """Waiting on an event recorded outside a capture is invalid inside it, so a capture stream
    reads warm tables with no wait: torch.cuda.graph synchronized the device before capturing."""
    streams, current, built = fake_cuda_streams
    cuda, key = torch.device("cuda"), ((4096,), (300,))
    tensor_table.ready_tables(cuda, *key)
    current[0] = 22
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tensor_table.ready_tables(cuda, *key)
    assert streams[22].waited == [] and len(built) == 2


@pytest.mark.gpu
def test_gpu_tables_built_on_a_side_stream_serve_torch_cuda_graph():
    """torch's recipe: describe on a side stream (warm-up), then inside ``torch.cuda.graph(g)`` (its
    own capture stream) the same tables are found, no copy is made in the capture, and the applied
    factor replays right; on a third stream, outside a capture, the same tables again."""
    grads = [torch.randn(300, device="cuda"), torch.randn(CHUNK + 17, device="cuda")]
    originals = [g.clone() for g in grads]
    factor = torch.tensor([0.5], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = describe_grads(grads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = describe_grads(grads)
        apply_factor_(captured, factor)
    assert captured.tensors is first.tensors and captured.chunks is first.chunks
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for i, (g, e) in enumerate(zip(grads, apply_ref(apply_ref(originals, 0.5), 0.5))):
        assert_bitwise(g, e, f"gradient {i}")
    with torch.cuda.stream(torch.cuda.Stream()):
        assert describe_grads(grads).tensors is first.tensors
