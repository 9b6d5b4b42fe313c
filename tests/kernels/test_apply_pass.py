"""apply_pass (kernels/apply_pass.py): g *= factor in place, rounded exactly as torch rounds it."""

import math

import pytest
import torch
from hypothesis import given
from oracles.kernel_cases import (
    DTYPES,
    SETTINGS_SMALL,
    UNALIGNED,
    assert_bitwise,
    clip_ratio_st,
    dtype_id,
    make_grads,
    max_norm_for,
    norm_types_st,
    run_check,
    scales_st,
    seeds_st,
    size_lists_st,
)

from tritonscale.kernels import apply_factor_, describe_grads
from tritonscale.kernels.reference import apply_ref, inv_scale_of


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@SETTINGS_SMALL
@given(sizes=size_lists_st, seed=seeds_st, scale=scales_st, norm_type=norm_types_st, clip_ratio=clip_ratio_st)
def test_apply_factor_matches_torch_rounding(dtype, sizes, seed, scale, norm_type, clip_ratio):
    """After finalize, apply_factor_ leaves exactly (g.float() * factor).to(dtype) in every gradient."""
    grads = make_grads(sizes, dtype, seed, 1.0)
    max_norm = max_norm_for(grads, scale, norm_type, clip_ratio)
    originals = [g.clone() for g in grads]
    layout, _, res, result = run_check(grads, scale, norm_type, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, res[3]))):
        assert_bitwise(g, e, f"gradient {i} ({dtype_id(dtype)}, factor {res[3]!r})")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 1000.0], ids=lambda s: f"scale={s:g}")
def test_apply_factor_rounds_to_nearest_even(dtype, scale):
    """Worked example of the rounding contract on one tensor (FLAT) and a table of two (TABLE):
    g = 1 + k * 2**-10 for k = 0..4095 in every dtype times inv_scale; for a non-power-of-two scale the
    float32 product generally falls between two representable values and must round to nearest even,
    exactly like torch's cast (and _amp_foreach_non_finite_check_and_unscale_)."""
    base = (1.0 + torch.arange(4096, dtype=torch.float64) * 2.0**-10).to(dtype)
    for grads in ([base.clone()], [base.clone()[:1000], base.clone()[1000:]]):
        layout = describe_grads(grads)
        expected = apply_ref(grads, inv_scale_of(scale))
        apply_factor_(layout, torch.tensor([scale]), invert=True)
        for g, e in zip(grads, expected):
            assert_bitwise(g, e, f"{'FLAT' if layout.flat else 'TABLE'} {dtype_id(dtype)} g * f32(1/{scale:g})")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("flat", [True, False], ids=["FLAT", "TABLE"])
def test_apply_with_unit_factor_still_checks(dtype, flat):
    """factor == 1 skips the writes, but with found_inf given every element is still checked."""
    grads = make_grads([UNALIGNED] if flat else [10, UNALIGNED], dtype, seed=3, magnitude=1.0)
    grads[-1][-1] = math.nan
    layout = describe_grads(grads)
    assert layout.flat == flat
    originals = [g.clone() for g in grads]
    found_inf = torch.zeros(1)
    apply_factor_(layout, torch.ones(1), found_inf=found_inf)
    assert found_inf.item() == 1.0
    for g, o in zip(grads, originals):
        assert_bitwise(g, o, "gradient after factor 1")
