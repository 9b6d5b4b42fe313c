"""tensor_table (kernels/tensor_table.py): which groups run FLAT and which through the pointer table,
with every pass over each layout; non-dense gradients refused; empty gradients skipped."""

import math

import pytest
import torch
from kernel_cases import (
    assert_bitwise,
    assert_norm_close,
    check_finalize_result,
    check_partials_summary,
    max_norm_for,
    run_check,
)
from tritonscale.kernels import apply_factor_, describe_grads
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
    on a copy. (The controller sends such gradients to torch ops instead: tests/test_grad_passes.py.)"""
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
