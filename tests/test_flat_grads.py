"""flatten_grads_ (tritonscale/flat_grads.py): gradients made views of one buffer run as one FLAT range."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_cases import (
    DTYPES,
    EDGE_SIZES,
    SETTINGS_SMALL,
    assert_bitwise,
    check_finalize_result,
    check_partials_summary,
    clip_ratio_st,
    dtype_id,
    make_grads,
    max_norm_for,
    norm_types_st,
    run_check,
    scales_st,
    seeds_st,
)
from tritonscale.kernels import apply_factor_, describe_grads
from tritonscale.kernels.reference import apply_ref, finalize_ref

import tritonscale


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@SETTINGS_SMALL
@given(
    sizes=st.lists(st.one_of(st.integers(1, 300), st.sampled_from(EDGE_SIZES[1:])), min_size=1, max_size=5),
    seed=seeds_st,
    scale=scales_st,
    norm_type=norm_types_st,
    clip_ratio=clip_ratio_st,
)
def test_flatten_grads_buffer_is_flat(dtype, sizes, seed, scale, norm_type, clip_ratio):
    """Gradients made views of one buffer by tritonscale.flatten_grads_ run as one FLAT range (the
    zero padding between views included); a subset of the views runs through the table."""
    params = [torch.nn.Parameter(torch.empty(n, dtype=dtype)) for n in sizes]
    for p, g in zip(params, make_grads(sizes, dtype, seed, 1.0)):
        p.grad = g
    (buffer,) = tritonscale.flatten_grads_(params)
    grads = [p.grad for p in params]
    buffer_before = buffer.clone()
    originals = [g.clone() for g in grads]
    max_norm = max_norm_for(grads, scale, norm_type, clip_ratio)
    layout, partials, res, result = run_check(grads, scale, norm_type, max_norm)
    # The whole padded buffer, even for one view: its length is a multiple of 16, so loads vectorise.
    assert layout.flat and layout.first is buffer
    assert layout.numel == buffer.numel()
    check_partials_summary(partials, layout.programs, grads)
    check_finalize_result(res, finalize_ref(grads, scale, norm_type, max_norm), dtype, scale, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, res[3]))):
        assert_bitwise(g, e, f"view {i}")
    padding = torch.ones(buffer.numel(), dtype=torch.bool)
    for g in grads:
        padding[g.storage_offset() : g.storage_offset() + g.numel()] = False
    assert (buffer[padding] == 0).all(), "padding of the flat buffer is no longer zero"

    if len(grads) > 1:  # every view but the first (TABLE unless just one), the first left alone
        buffer.copy_(buffer_before)
        subset = grads[1:]
        layout, partials, res, result = run_check(subset, scale, norm_type, max_norm)
        assert layout.flat == (len(subset) == 1)
        check_finalize_result(res, finalize_ref(subset, scale, norm_type, max_norm), dtype, scale, max_norm)
        apply_factor_(layout, result[3:4])
        assert_bitwise(grads[0], originals[0], "view outside the group")
        for i, (g, e) in enumerate(zip(subset, apply_ref(originals[1:], res[3]))):
            assert_bitwise(g, e, f"view {i + 1}")


def test_flat_buffer_with_an_empty_parameter_stays_flat():
    # nn.Linear(0, 3) has a [3, 0] weight: its empty view must not knock the group off the FLAT path.
    params = [torch.nn.Parameter(torch.randn(3, 0)), torch.nn.Parameter(torch.randn(40))]
    (buffer,) = tritonscale.flatten_grads_(params)
    layout = describe_grads([p.grad for p in params])
    assert layout.flat and layout.first is buffer
