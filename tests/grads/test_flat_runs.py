"""grads/flat_runs.py: views back to back in one storage become one run, covering exactly the
group's elements (never another gradient's, never a gap); a flatten_grads_ buffer is one run."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from oracles.kernel_cases import SETTINGS_SMALL

import tritonscale
from tritonscale.grads import flat_runs as flat_runs_module
from tritonscale.grads.flat_runs import as_runs, flat_runs


def covered(runs: list[torch.Tensor]) -> set[tuple[int, int]]:
    """(storage address, element offset) of every element of these 1-D contiguous tensors."""
    assert all(r.dim() == 1 and r.is_contiguous() for r in runs)
    return {(r.untyped_storage().data_ptr(), r.storage_offset() + i) for r in runs for i in range(r.numel())}


@SETTINGS_SMALL
@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=8),
    gaps=st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=8, max_size=8),
    keep=st.lists(st.booleans(), min_size=8, max_size=8),
    shuffle=st.randoms(use_true_random=False),
)
def test_runs_cover_exactly_the_groups_elements(sizes, gaps, keep, shuffle):
    # A bucket holding views with gaps between some, of which the optimizer owns some (``keep``).
    offsets, at = [], 0
    for size, gap in zip(sizes, gaps):
        offsets.append(at)
        at += size + gap
    bucket = torch.arange(float(at))
    views = [bucket[o : o + n] for o, n in zip(offsets, sizes)]
    group = [v for v, k in zip(views, keep) if k] + [torch.ones(3)]  # and one gradient of its own
    shuffle.shuffle(group)
    runs = as_runs(group)
    want = covered([g for g in group if g.numel()])
    assert covered(runs) == want  # every element once, nothing else
    assert sum(r.numel() for r in runs) == len(want)
    merged = flat_runs(group)
    if merged is not None:
        assert len(merged) < len([g for g in group if g.numel()])
    # Writes through the runs reach the group's gradients, and nothing else of the bucket.
    bucket_before, group_before = bucket.clone(), [g.clone() for g in group]
    for r in runs:
        r.mul_(2)
    assert all(torch.equal(g, 2 * b) for g, b in zip(group, group_before))
    mine = {o for _, o in want if _ == bucket.untyped_storage().data_ptr()}
    others = [i for i in range(at) if i not in mine]
    assert torch.equal(bucket[others], bucket_before[others])


def test_a_flatten_grads_buffer_is_one_run_padding_included():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 17, 3)]
    (buffer,) = tritonscale.flatten_grads_(params)
    (run,) = as_runs([p.grad for p in params])
    assert run.data_ptr() == buffer.data_ptr() and run.numel() == buffer.numel() == 16 + 32 + 16
    # A subset of its views: their own elements only (the padding between them is not theirs).
    runs = as_runs([params[0].grad, params[2].grad])
    assert sorted(r.numel() for r in runs) == [3, 5]


def test_separate_allocations_never_merge():
    a, b = torch.zeros(4), torch.zeros(4)
    assert flat_runs([a, b]) is None
    assert [r is g for r, g in zip(as_runs([a, b]), [a, b])] == [True, True]


def test_non_contiguous_views_stay_as_they_are():
    bucket = torch.zeros(12)
    t = bucket[:6].view(2, 3).t()  # non-contiguous
    tail = bucket[6:12]
    runs = as_runs([t, tail])
    assert any(r is t for r in runs) and sum(r.numel() for r in runs) == 12


def test_the_layouts_kept_are_the_16_last_used():
    """The cache's bound on memory: past 16 groups the least recently used layout is dropped; a
    group used again is the most recent, and its runs are found as before."""
    flat_runs_module._layouts.clear()
    buckets = [torch.zeros(8) for _ in range(20)]
    groups = [[b[:4], b[4:]] for b in buckets]
    for group in groups[:16]:
        flat_runs(group)
    (run,) = flat_runs(groups[0])  # a hit: now the most recent
    assert run.data_ptr() == buckets[0].data_ptr() and run.numel() == 8
    for group in groups[16:]:
        flat_runs(group)
    kept = [key[2] for key in flat_runs_module._layouts]
    assert len(kept) == flat_runs_module._LAYOUTS_KEPT == 16
    assert ((buckets[0].data_ptr(), 4), (buckets[0].data_ptr() + 16, 4)) in kept  # the hit stayed
    assert ((buckets[1].data_ptr(), 4), (buckets[1].data_ptr() + 16, 4)) not in kept  # the least recent went
