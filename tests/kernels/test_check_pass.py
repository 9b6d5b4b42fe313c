"""check_pass (kernels/check_pass.py): the read-only pass, its partials, and what finalize makes of them.

Property tests against tritonscale.kernels.reference: finite gradients of every size, layout and
magnitude; injected inf/-inf/NaN anywhere; squares that overflow float32; subnormals.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracles.kernel_cases import (
    DTYPES,
    FP32_MAX,
    MAGNITUDES,
    NONFINITE,
    NORM_TYPES,
    SETTINGS,
    UNALIGNED,
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
    size_lists_st,
)

from tritonscale.kernels import NORM_INF, apply_factor_, check_pass, describe_grads, norm_code
from tritonscale.kernels.check_pass import PARTIAL_ROWS
from tritonscale.kernels.launch_config import CHUNK, DEFAULT_BLOCK
from tritonscale.kernels.reference import apply_ref, f32, finalize_ref, torch_clip_coef


def test_norm_codes():
    """torch-style norm types map to the kernels' codes; anything else is refused before a launch."""
    assert (norm_code(1), norm_code(2.0), norm_code(math.inf)) == (1, 2, NORM_INF)
    with pytest.raises(ValueError):
        norm_code(3.0)
    layout = describe_grads([torch.ones(8)])
    with pytest.raises(ValueError):
        check_pass(layout, torch.full((PARTIAL_ROWS, 1), float("nan")), 3)


# ---------------------------------------------------------------------------------------------------
# Finite gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@SETTINGS
@given(
    sizes=size_lists_st,
    seed=seeds_st,
    data=st.data(),
    scale=scales_st,
    norm_type=norm_types_st,
    clip_ratio=clip_ratio_st,
)
def test_check_and_finalize_match_float64_oracle(dtype, sizes, seed, data, scale, norm_type, clip_ratio):
    grads = make_grads(sizes, dtype, seed, data.draw(st.sampled_from(MAGNITUDES[dtype]), label="magnitude"))
    max_norm = max_norm_for(grads, scale, norm_type, clip_ratio)
    layout, partials, res, _ = run_check(grads, scale, norm_type, max_norm)
    assert layout.flat == (sum(1 for n in sizes if n) == 1), "one non-empty contiguous tensor is FLAT"
    check_partials_summary(partials, layout.programs, grads)
    orc = finalize_ref(grads, scale, norm_type, max_norm)
    check_finalize_result(res, orc, dtype, scale, max_norm)
    if norm_type == math.inf:
        # Worked example of exactness: the inf-norm is max|g| (exact in float32) times inv_scale; the
        # product of two float32 values is exact in float64 and the kernel rounds it once, as f32() does.
        assert res[1] == f32(orc.norm), f"inf-norm {res[1]!r} != f32(oracle) {f32(orc.norm)!r}"


# ---------------------------------------------------------------------------------------------------
# Injected inf / -inf / NaN


def inject(grads: list[torch.Tensor], where: list[tuple[int, int, str]]) -> None:
    for t, i, kind in where:
        grads[t].view(-1)[i] = NONFINITE[kind]


def check_nonfinite_result(res: list[float], grads, scale, norm_type, max_norm) -> None:
    found_inf, norm, clip_coef, factor = res
    any_nan = any(bool(torch.isnan(g).any()) for g in grads)
    assert found_inf == 1.0, f"found_inf {found_inf}"
    if any_nan:
        assert math.isnan(norm), f"norm {norm!r} with a NaN gradient"
    else:
        assert norm == math.inf, f"norm {norm!r} with an inf gradient (and no NaN)"
    # torch's own float64 norm agrees with the rule above.
    orc = finalize_ref(grads, scale, norm_type, max_norm)
    assert math.isnan(orc.norm) if any_nan else orc.norm == math.inf
    if max_norm is None:
        assert clip_coef == 1.0
    else:
        want = torch_clip_coef(norm, max_norm)  # NaN for a NaN norm, 0 for an inf one
        assert clip_coef == want or (math.isnan(clip_coef) and math.isnan(want)), f"clip_coef {clip_coef!r}"
    assert factor == 1.0, f"factor {factor!r}: an overflowed step must leave its gradients alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@SETTINGS
@given(
    sizes=size_lists_st,
    seed=seeds_st,
    data=st.data(),
    scale=scales_st,
    norm_type=norm_types_st,
    clip_ratio=clip_ratio_st,
)
def test_nonfinite_gradient_is_flagged(dtype, sizes, seed, data, scale, norm_type, clip_ratio):
    grads = make_grads(sizes, dtype, seed, 1.0)
    max_norm = max_norm_for(grads, scale, norm_type, clip_ratio)
    nonempty = [i for i, n in enumerate(sizes) if n]
    where = []
    for _ in range(data.draw(st.integers(1, 2), label="injections")):
        t = data.draw(st.sampled_from(nonempty), label="tensor")
        i = data.draw(st.one_of(st.sampled_from([0, sizes[t] - 1]), st.integers(0, sizes[t] - 1)), label="index")
        where.append((t, i, data.draw(st.sampled_from(sorted(NONFINITE)), label="value")))
    inject(grads, where)
    originals = [g.clone() for g in grads]
    layout, partials, res, result = run_check(grads, scale, norm_type, max_norm)
    check_partials_summary(partials, layout.programs, grads)
    check_nonfinite_result(res, grads, scale, norm_type, max_norm)
    # The factor is 1: the apply pass must not change a single bit.
    apply_factor_(layout, result[3:4])
    for i, (g, o) in enumerate(zip(grads, originals)):
        assert_bitwise(g, o, f"gradient {i} after applying factor 1")
    # A plain unscale_ (invert + check) over the same gradients flags them too.
    found_inf = torch.zeros(1)
    apply_factor_(layout, torch.tensor([scale]), invert=True, found_inf=found_inf)
    assert found_inf.item() == 1.0, "apply_factor_(invert=True, found_inf=...) missed the inf/NaN"
    for g, o in zip(grads, originals):  # the non-finite values survive as what they were
        assert torch.equal(torch.isnan(g), torch.isnan(o))
        assert torch.equal(torch.isposinf(g), torch.isposinf(o)) and torch.equal(torch.isneginf(g), torch.isneginf(o))


POSITIONS = {
    # name: (sizes, tensor index, element index)
    "first-element-of-group": ([1000, 4097], 0, 0),
    "last-element-of-unaligned-tensor": ([300, UNALIGNED], 1, UNALIGNED - 1),
    "one-element-tensor": ([5000, 1, 70], 1, 0),
    "last-of-first-chunk": ([UNALIGNED], 0, CHUNK - 1),
    "first-of-second-chunk": ([UNALIGNED], 0, CHUNK),
    "flat-single-last-element": ([DEFAULT_BLOCK + 1], 0, DEFAULT_BLOCK),
}


@pytest.mark.parametrize("kind", sorted(NONFINITE))
@pytest.mark.parametrize("position", sorted(POSITIONS))
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
def test_nonfinite_at_named_position(position, kind, norm_type):
    sizes, t, i = POSITIONS[position]
    grads = make_grads(sizes, torch.float32, seed=7, magnitude=1.0)
    inject(grads, [(t, i, kind)])
    originals = [g.clone() for g in grads]
    layout, partials, res, _ = run_check(grads, 1024.0, norm_type, 1.0)
    check_partials_summary(partials, layout.programs, grads)
    check_nonfinite_result(res, grads, 1024.0, norm_type, 1.0)
    found_inf = torch.zeros(1)
    apply_factor_(layout, torch.tensor([1024.0]), invert=True, found_inf=found_inf)
    assert found_inf.item() == 1.0
    for g, e in zip(grads, apply_ref(originals, 2.0**-10)):
        assert_bitwise(g, e, "unscaled gradient", nan_aware=True)


# ---------------------------------------------------------------------------------------------------
# Overflow safety and subnormals


def big_case(dtype: torch.dtype, pattern: str) -> list[torch.Tensor]:
    """Finite gradients whose squares (or sums) overflow float32; the big values either come first
    or only in a later block/chunk, so the running-max rescaling is exercised both ways."""
    small = make_grads([UNALIGNED], torch.float32, seed=11, magnitude=1.0)[0]
    if pattern == "3e19-among-ones":
        small[12345] = 3e19
        return [small.to(dtype)]
    if pattern == "1e38-late":
        small[-1] = 1e38
        small[CHUNK + 1] = -3e37
        return [small.to(dtype)]
    if pattern == "1e38-early-then-small":
        small[0] = -1e38
        return [small.to(dtype), torch.full((300,), 1e-3, dtype=dtype)]
    if pattern == "max-finite":
        top = torch.finfo(dtype).max
        return [torch.tensor([top, -top, 1.0], dtype=dtype), small.to(dtype)]
    raise AssertionError(pattern)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("pattern", ["3e19-among-ones", "1e38-late", "1e38-early-then-small", "max-finite"])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
def test_huge_finite_gradients_do_not_overflow(dtype, pattern, norm_type):
    grads = big_case(dtype, pattern)
    # With scale 2**16 every unscaled norm here is below float32's max (largest: 1-norm of
    # 2 * 3.4e38 / 65536 ~= 1e34), so the only acceptable answer is the finite oracle value.
    scale, max_norm = 2.0**16, 1.0
    originals = [g.clone() for g in grads]
    layout, partials, res, result = run_check(grads, scale, norm_type, max_norm)
    check_partials_summary(partials, layout.programs, grads)
    orc = finalize_ref(grads, scale, norm_type, max_norm)
    assert math.isfinite(orc.norm) and orc.norm < FP32_MAX
    check_finalize_result(res, orc, dtype, scale, max_norm)
    apply_factor_(layout, result[3:4])
    for g, e in zip(grads, apply_ref(originals, res[3])):
        assert_bitwise(g, e, "clipped gradient")


SUBNORMALS = {
    # dtype: (smallest subnormal, smallest normal)
    torch.float32: (2.0**-149, 2.0**-126),
    torch.bfloat16: (2.0**-133, 2.0**-126),
    torch.float16: (2.0**-24, 2.0**-14),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mix", ["subnormal-only", "subnormal-with-normals"])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
@pytest.mark.parametrize("scale", [1.0, 2.0**-10], ids=["scale=1", "scale=2^-10"])
def test_subnormal_gradients(dtype, mix, norm_type, scale):
    tiny, normal = SUBNORMALS[dtype]
    gen = torch.Generator().manual_seed(5)
    # Uniform over the subnormal range, both signs, including the smallest subnormal itself.
    values = (torch.rand(DEFAULT_BLOCK + 77, generator=gen, dtype=torch.float64) * 2 - 1) * (normal - tiny)
    values[:3] = torch.tensor([tiny, -tiny, normal - tiny], dtype=torch.float64)
    grads = [values.to(dtype)]
    if mix == "subnormal-with-normals":
        grads.append(make_grads([100], dtype, seed=6, magnitude=1e-3)[0])
    assert (grads[0].abs() < normal).all() and (grads[0] != 0).sum() > 1000
    layout, partials, res, _ = run_check(grads, scale, norm_type, None)
    check_partials_summary(partials, layout.programs, grads)
    check_finalize_result(res, finalize_ref(grads, scale, norm_type, None), dtype, scale, None)
