import os; os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E401,E702,I001  # fmt: skip

# (Line 1 selects Triton's interpreter before anything imports triton; tests/conftest.py may too.)
#
# Property tests of the kernel launchers (tritonscale.kernels) and of the two backends against
# plain-torch oracles computed in float64.
#
# Contract under test (module docstrings of kernels/*.py and tritonscale/backends/*.py):
#   check_pass(layout, partials, code)  read-only; writes partials[:, :layout.programs] (fp32 [3, P]:
#       max |g| over finite elements, the power-of-two-scaled sum, sum of |g| over inf/NaN elements)
#   finalize(partials, P, scale, code, max_norm) -> fp32 [4] = (found_inf, norm, clip_coef, factor)
#       norm      = total norm of the unscaled gradients (NaN if any NaN, else +inf if any inf)
#       clip_coef = min(max_norm / (norm + 1e-6), 1)      (torch.nn.utils.clip_grad_norm_'s rule)
#       factor    = inv_scale * clip_coef, exactly 1.0 when found_inf; inv_scale = f32(1 / f64(scale))
#   apply_factor_(layout, f[, invert, found_inf])  g <- f32(g) * f (or * f32(1/f64(f))) rounded once to
#       g's dtype, like torch._amp_foreach_non_finite_check_and_unscale_; found_inf <- 1 on inf/NaN.
#
# Every partials buffer is NaN-poisoned and one column wider than the pass needs, so a column the pass
# failed to write, or one it wrote beyond its share, is caught.

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tritonscale.kernels import NORM_INF, apply_factor_, check_pass, describe_grads, finalize, norm_code
from tritonscale.kernels.check_pass import PARTIAL_ROWS
from tritonscale.kernels.launch_config import CHUNK, DEFAULT_BLOCK

import tritonscale
from tritonscale.backends import TorchBackend, TritonBackend

from tolerances import NORM_RTOL, TORCH_BACKEND_NORM_RTOL  # the one tolerance table  # isort: skip

# Added to every norm comparison: half a unit in the last place of the smallest float32 subnormal,
# the rounding of a norm that is itself subnormal (only the subnormal tests get near it).
NORM_ATOL = 2.0**-150

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NORM_TYPES = [1.0, 2.0, math.inf]
SCALES = [1.0, 2.0**16, 2.0**-3, 2.0**24, 3.0, 1000.0, 12345.0, 0.7]  # powers of two and not
FP32_MAX = torch.finfo(torch.float32).max
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

# Sizes on either side of the block (4096) and of the chunk (65536), plus anything up to ~70000.
EDGE_SIZES = [
    0, 1, 2, 15, 17, DEFAULT_BLOCK - 1, DEFAULT_BLOCK, DEFAULT_BLOCK + 1,
    CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + DEFAULT_BLOCK + 3, 69999,
]  # fmt: skip
assert DEFAULT_BLOCK == 4096 and CHUNK == 65536, "the edge sizes above assume these launch constants"

# No shrink phase: every interpreted launch costs milliseconds, and shrinking one failing example
# took minutes; a failure is reported as drawn (seeded, so it reproduces).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
SETTINGS = settings(max_examples=30, deadline=None, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])
SETTINGS_SMALL = settings(max_examples=20, deadline=None, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def inv_scale_of(scale: float) -> float:
    """float32(1 / float64(scale)): torch.amp.GradScaler's rounding of the inverse scale."""
    return f32(1.0 / scale)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` (a copy), so comparisons see -0.0, NaN payloads and all."""
    width = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.detach().clone().contiguous().view(width)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str, nan_aware: bool = False) -> None:
    """Bit-identical; with ``nan_aware``, NaN positions must match and their payloads are ignored
    (torch's vectorised casts and Triton's may pick different NaN bit patterns)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    if nan_aware:
        nan_a, nan_e = torch.isnan(a), torch.isnan(e)
        assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
        a, e = a[~nan_a], e[~nan_e]
    diff = bits(a) != bits(e)
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {a.numel()} elements differ; first at {i}: "
            f"got {a[i].item()!r} expected {e[i].item()!r}"
        )


def ulp_distance_f32(a: float, b: float) -> int:
    """Number of float32 values between a and b (both finite float32 values)."""

    def ordered(x: float) -> int:
        i = torch.tensor(x, dtype=torch.float32).view(torch.int32).item()
        return i if i >= 0 else -(i & 0x7FFFFFFF)

    return abs(ordered(a) - ordered(b))


# ---------------------------------------------------------------------------------------------------
# Oracles


@dataclass
class Oracle:
    found_inf: float
    norm: float  # float64 norm of the unscaled gradients (NaN/inf per torch)
    clip_coef: float  # float64 clip coefficient from that norm
    factor: float  # inv_scale * clip_coef in float64 (1.0 when found_inf)


def oracle(grads: list[torch.Tensor], scale: float, norm_type: float, max_norm: float | None) -> Oracle:
    """float64 torch computation: vector_norm of the concatenated unscaled gradients and
    clip_grad_norm_'s coefficient."""
    inv = inv_scale_of(scale)
    parts = [g.detach().reshape(-1).double() for g in grads]
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    norm = torch.linalg.vector_norm(flat * inv, ord=norm_type).item() if flat.numel() else 0.0
    found_inf = 0.0 if bool(torch.isfinite(flat).all()) else 1.0
    clip = 1.0 if max_norm is None else min(max_norm / (norm + 1e-6), 1.0)
    return Oracle(found_inf, norm, clip, 1.0 if found_inf else inv * clip)


def torch_clip_coef(norm: float, max_norm: float) -> float:
    """clip_grad_norm_'s coefficient op for op, in float32, from a given float32 norm."""
    total_norm = torch.tensor(norm, dtype=torch.float32)
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).item()


def expected_product(g: torch.Tensor, factor: float) -> torch.Tensor:
    """What apply_factor_ must leave in ``g``: float32 product, rounded once to g's dtype."""
    return (g.float() * torch.tensor(factor, dtype=torch.float32)).to(g.dtype)


def assert_norm_close(got: float, expected64: float, dtype: torch.dtype, what: str = "norm") -> None:
    rtol = NORM_RTOL[dtype]
    expected32 = f32(expected64)  # inf when the true norm is above float32's range
    if math.isnan(expected64) or math.isinf(expected32):
        assert got == expected32 or (math.isnan(got) and math.isnan(expected32)), (
            f"{what}: got {got!r}, expected {expected32!r}"
        )
        return
    assert math.isfinite(got), f"{what}: got {got!r}, expected {expected64!r}"
    rel = abs(got - expected64) / max(abs(expected64), 1e-300)
    assert abs(got - expected64) <= rtol * abs(expected64) + NORM_ATOL, (
        f"{what}: got {got!r}, expected {expected64!r} (rel. error {rel:.2e})"
    )


# ---------------------------------------------------------------------------------------------------
# Running the kernels


def run_check(grads: list[torch.Tensor], scale: float, norm_type: float, max_norm: float | None):
    """describe_grads + check_pass + finalize, asserting the read-only and partials contracts.

    Returns (layout, partials, result as a list of 4 floats, result tensor)."""
    layout = describe_grads(grads)
    assert layout is not None, "describe_grads returned None for a group with elements"
    before = [bits(g) for g in grads]
    partials = torch.full((PARTIAL_ROWS, layout.programs + 1), float("nan"))
    check_pass(layout, partials, norm_code(norm_type))
    for i, (g, b) in enumerate(zip(grads, before)):
        assert torch.equal(bits(g), b), f"check_pass modified gradient {i}"
    used = partials[:, : layout.programs]
    # Rows 0 (max) and 1 (scaled sum) are finite and >= 0 whatever the input; row 2 is checked
    # against the input in check_partials_summary (NaN there is a legitimate value).
    assert torch.isfinite(used[:2]).all() and (used[:2] >= 0).all(), f"partials unwritten or invalid:\n{used}"
    assert torch.isnan(partials[:, layout.programs]).all(), "check_pass wrote past its columns"
    scale_t = torch.tensor([scale], dtype=torch.float32)
    result = finalize(partials, layout.programs, scale_t, norm_code(norm_type), max_norm)
    assert result.dtype == torch.float32 and result.shape == (4,)
    return layout, partials, result.tolist(), result


def check_partials_summary(partials: torch.Tensor, programs: int, grads: list[torch.Tensor]) -> None:
    """Row 0 is max |g| over finite elements and row 2 the sum of |g| over the inf/NaN ones: over
    all columns these are exact properties of the whole group (max |g|; 0, +inf or NaN)."""
    assert PARTIAL_ROWS == 3, "check_pass's partials layout changed: update this helper"
    flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
    finite = flat[torch.isfinite(flat)]
    expected_max = finite.abs().max().item() if finite.numel() else 0.0
    assert partials[0, :programs].max().item() == expected_max, "max |g| over the partials"
    bad = partials[2, :programs]
    assert bool(((bad == 0) | (bad == math.inf) | torch.isnan(bad)).all()), f"non-finite row: {bad}"
    if torch.isnan(flat).any():
        assert torch.isnan(bad).any(), "a NaN gradient left no NaN in the partials"
    else:
        assert not torch.isnan(bad).any(), f"NaN partial without a NaN gradient (unwritten column?): {bad}"
        assert (bad.max().item() == math.inf) == bool(torch.isinf(flat).any()), f"inf partials: {bad}"


def check_finalize_result(res: list[float], orc: Oracle, dtype: torch.dtype, scale: float, max_norm: float | None):
    """The finite-gradient contract of finalize's four outputs."""
    found_inf, norm, clip_coef, factor = res
    assert found_inf == 0.0, f"found_inf {found_inf} for finite gradients"
    assert_norm_close(norm, orc.norm, dtype)
    if max_norm is None:
        assert clip_coef == 1.0
    else:
        # clip_grad_norm_'s rule applied to the kernel's own norm: max_norm * (1 / x) instead of
        # max_norm / x may round differently, by one unit in the last place at most.
        want = torch_clip_coef(norm, max_norm)
        assert ulp_distance_f32(clip_coef, want) <= 1, f"clip_coef {clip_coef!r}, torch rule {want!r}"
    # factor is the float32 product of the two float32 values it combines ...
    assert factor == f32(inv_scale_of(scale) * clip_coef), f"factor {factor!r} != f32(inv_scale * {clip_coef!r})"
    # ... and matches the float64 oracle up to the norm's tolerance plus a few roundings.
    assert abs(factor - orc.factor) <= (NORM_RTOL[dtype] + 2.0**-21) * abs(orc.factor) + NORM_ATOL, (
        f"factor {factor!r}, oracle {orc.factor!r}"
    )


# ---------------------------------------------------------------------------------------------------
# Strategies

sizes_st = st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 300), st.integers(0, 70000))
size_lists_st = st.lists(sizes_st, min_size=1, max_size=6).filter(lambda s: sum(s) > 0)
norm_types_st = st.sampled_from(NORM_TYPES)
scales_st = st.sampled_from(SCALES).map(f32)
seeds_st = st.integers(0, 2**31 - 1)
# Clip threshold as a multiple of the true norm: clipping active (< 1) or not (> 1); None: no clip.
clip_ratio_st = st.one_of(st.none(), st.sampled_from([0.01, 0.5, 0.999, 1.001, 2.0, 100.0]))
# Magnitudes that keep every dtype finite (fp16: 5.5 sigma * 1e3 < 65504).
MAGNITUDES = {
    torch.float32: [1e-30, 1e-3, 1.0, 1e3, 2.0**16, 1e15],
    torch.float16: [1e-3, 1.0, 1e3],
    torch.bfloat16: [1e-30, 1e-3, 1.0, 1e3, 2.0**16, 1e15],
}


def make_grads(sizes: list[int], dtype: torch.dtype, seed: int, magnitude: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen, dtype=torch.float64) * magnitude).to(dtype) for n in sizes]
    assert all(torch.isfinite(g).all() for g in grads)
    return grads


def max_norm_for(grads, scale, norm_type, ratio) -> float | None:
    if ratio is None:
        return None
    return f32(oracle(grads, scale, norm_type, None).norm * ratio)


def test_norm_codes():
    """torch-style norm types map to the kernels' codes; anything else is refused before a launch."""
    assert (norm_code(1), norm_code(2.0), norm_code(math.inf)) == (1, 2, NORM_INF)
    with pytest.raises(ValueError):
        norm_code(3.0)
    layout = describe_grads([torch.ones(8)])
    with pytest.raises(ValueError):
        check_pass(layout, torch.full((PARTIAL_ROWS, 1), float("nan")), 3)


# ---------------------------------------------------------------------------------------------------
# check_pass + finalize on finite gradients


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
    orc = oracle(grads, scale, norm_type, max_norm)
    check_finalize_result(res, orc, dtype, scale, max_norm)
    if norm_type == math.inf:
        # Worked example of exactness: the inf-norm is max|g| (exact in float32) times inv_scale; the
        # product of two float32 values is exact in float64 and the kernel rounds it once, as f32() does.
        assert res[1] == f32(orc.norm), f"inf-norm {res[1]!r} != f32(oracle) {f32(orc.norm)!r}"


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
    for i, (g, o) in enumerate(zip(grads, originals)):
        assert_bitwise(g, expected_product(o, res[3]), f"gradient {i} ({dtype_id(dtype)}, factor {res[3]!r})")


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
        expected = [expected_product(g, inv_scale_of(scale)) for g in grads]
        apply_factor_(layout, torch.tensor([scale]), invert=True)
        for g, e in zip(grads, expected):
            assert_bitwise(g, e, f"{'FLAT' if layout.flat else 'TABLE'} {dtype_id(dtype)} g * f32(1/{scale:g})")


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
    orc = oracle(grads, scale, norm_type, max_norm)
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


UNALIGNED = CHUNK + 3 * DEFAULT_BLOCK + 5  # crosses the chunk, not a multiple of the block
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
    for g, o in zip(grads, originals):
        assert_bitwise(g, expected_product(o, 2.0**-10), "unscaled gradient", nan_aware=True)


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


# ---------------------------------------------------------------------------------------------------
# Overflow safety, zeros, subnormals


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
    orc = oracle(grads, scale, norm_type, max_norm)
    assert math.isfinite(orc.norm) and orc.norm < FP32_MAX
    check_finalize_result(res, orc, dtype, scale, max_norm)
    apply_factor_(layout, result[3:4])
    for g, o in zip(grads, originals):
        assert_bitwise(g, expected_product(o, res[3]), "clipped gradient")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's f64 -> f32
@pytest.mark.parametrize("norm_type", [1.0, 2.0], ids=lambda n: f"norm={n:g}")
@pytest.mark.parametrize("max_norm", [None, 5.0], ids=["no-clip", "clip"])
def test_norm_above_float32_range_is_inf_but_not_found_inf(norm_type, max_norm):
    """Worked example: four gradients of float32's max with scale 1 have a 2-norm of 2 * 3.4e38 and a
    1-norm of 4 * 3.4e38, both above float32's range: norm = inf, but no element is non-finite, so
    found_inf = 0 and clip_grad_norm_'s rule gives clip_coef = 5 / inf = 0, factor = 0."""
    grads = [torch.full((4,), FP32_MAX)]
    layout, _, res, _ = run_check(grads, 1.0, norm_type, max_norm)
    found_inf, norm, clip_coef, factor = res
    assert found_inf == 0.0 and norm == math.inf
    assert (clip_coef, factor) == ((1.0, 1.0) if max_norm is None else (0.0, 0.0))
    assert oracle(grads, 1.0, norm_type, max_norm).norm > FP32_MAX


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sizes", [[1], [UNALIGNED], [0, 17, UNALIGNED, 3]], ids=["one", "flat", "table"])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
def test_all_zero_gradients(dtype, sizes, norm_type):
    grads = [torch.zeros(n, dtype=dtype) for n in sizes]
    grads[-1].view(-1)[0] = -0.0  # the sign of zero must not matter either
    layout, _, res, result = run_check(grads, 3.0, norm_type, 1.0)
    assert res == [0.0, 0.0, 1.0, f32(inv_scale_of(3.0))]
    apply_factor_(layout, result[3:4])
    assert all(bool((g == 0).all()) for g in grads)


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
    check_finalize_result(res, oracle(grads, scale, norm_type, None), dtype, scale, None)


# ---------------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
@pytest.mark.parametrize(
    "sizes", [[4 * CHUNK + 999], [CHUNK + 1, 5, CHUNK, 3 * DEFAULT_BLOCK, CHUNK + 7]], ids=["FLAT", "TABLE"]
)
def test_check_and_finalize_are_deterministic(sizes, norm_type):
    grads = make_grads(sizes, torch.float32, seed=13, magnitude=3.0)
    layout1, partials1, _, result1 = run_check(grads, 3.0, norm_type, 0.5)
    layout2, partials2, _, result2 = run_check(grads, 3.0, norm_type, 0.5)
    assert layout1.programs == layout2.programs == 4  # more chunks than programs: grid-stride loops
    assert torch.equal(bits(partials1), bits(partials2)), "partials differ between identical runs"
    assert torch.equal(bits(result1), bits(result2)), f"{result1.tolist()} != {result2.tolist()}"


# ---------------------------------------------------------------------------------------------------
# Layouts


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
    check_finalize_result(res, oracle(grads, 3.0, norm_type, max_norm), torch.float32, 3.0, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, o) in enumerate(zip(grads, originals)):
        assert_bitwise(g, expected_product(o, res[3]), f"gradient {i}")
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
def test_non_dense_gradient_raises_and_modifies_nothing(case):
    """Launchers: describe_grads refuses it (alone or in a TABLE). Public API: GradScaler's unscale_
    and clip_grad_norm_ on the Triton backend raise ValueError before any pass, so the dense
    gradient of the same optimizer is left exactly as it was."""
    bad = non_dense_cases()[case]()
    with pytest.raises(ValueError, match="not dense"):
        describe_grads([bad])
    with pytest.raises(ValueError, match="not dense"):
        describe_grads([torch.randn(100), bad])

    good = torch.nn.Parameter(torch.empty(100))
    other = torch.nn.Parameter(torch.empty(bad.shape))
    good.grad, other.grad = torch.randn(100) * 1000, bad
    good_before, bad_before = bits(good.grad), bits(bad)
    opt = torch.optim.SGD([good, other], lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=3.0, backend="triton")
    scaler.scale(torch.ones(()))  # creates the device-side scale
    with pytest.raises(ValueError, match="not dense"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="not dense"):
        scaler.clip_grad_norm_(opt, max_norm=1e-3)
    assert torch.equal(bits(good.grad), good_before) and torch.equal(bits(other.grad), bad_before)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 3), (2, 0, 4)], ids=lambda s: "x".join(map(str, s)))
def test_empty_gradients_are_skipped(shape):
    """Zero-element tensors of any shape (e.g. nn.Linear(0, 3).weight's gradient, shape (3, 0) with
    strides (1, 1)) hold nothing to check: a group of them has no layout, and next to a real
    gradient they change nothing."""
    assert describe_grads([torch.zeros(shape), torch.zeros(0)]) is None
    grads = [torch.zeros(shape), torch.randn(33)]
    layout, _, res, _ = run_check(grads, 2.0, 2.0, None)
    assert layout.flat and layout.numel == 33
    assert_norm_close(res[1], oracle(grads, 2.0, 2.0, None).norm, torch.float32)


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
    check_finalize_result(res, oracle(grads, scale, norm_type, max_norm), dtype, scale, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, o) in enumerate(zip(grads, originals)):
        assert_bitwise(g, expected_product(o, res[3]), f"view {i}")
    padding = torch.ones(buffer.numel(), dtype=torch.bool)
    for g in grads:
        padding[g.storage_offset() : g.storage_offset() + g.numel()] = False
    assert (buffer[padding] == 0).all(), "padding of the flat buffer is no longer zero"

    if len(grads) > 1:  # every view but the first (TABLE unless just one), the first left alone
        buffer.copy_(buffer_before)
        subset = grads[1:]
        layout, partials, res, result = run_check(subset, scale, norm_type, max_norm)
        assert layout.flat == (len(subset) == 1)
        check_finalize_result(res, oracle(subset, scale, norm_type, max_norm), dtype, scale, max_norm)
        apply_factor_(layout, result[3:4])
        assert_bitwise(grads[0], originals[0], "view outside the group")
        for i, (g, o) in enumerate(zip(subset, originals[1:])):
            assert_bitwise(g, expected_product(o, res[3]), f"view {i + 1}")


# ---------------------------------------------------------------------------------------------------
# Backends: torch and Triton on the same inputs


def make_groups(data, seed: int, allow_nonfinite: bool) -> list[list[torch.Tensor]]:
    """1-3 dtype groups of 1-4 tensors each, optionally with injected inf/NaN."""
    dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3, unique=True), label="dtypes")
    groups = []
    for k, dtype in enumerate(dtypes):
        sizes = data.draw(
            st.lists(st.one_of(st.integers(0, 300), st.sampled_from(EDGE_SIZES)), min_size=1, max_size=4), label="sizes"
        )
        groups.append(make_grads(sizes, dtype, seed + k, 1.0))
    if allow_nonfinite and data.draw(st.booleans(), label="inject"):
        candidates = [(k, t) for k, grads in enumerate(groups) for t, g in enumerate(grads) if g.numel()]
        if candidates:
            k, t = data.draw(st.sampled_from(candidates), label="tensor")
            i = data.draw(st.integers(0, groups[k][t].numel() - 1), label="index")
            kind = data.draw(st.sampled_from(sorted(NONFINITE)), label="value")
            groups[k][t].view(-1)[i] = NONFINITE[kind]
    return groups


def clone_groups(groups):
    return [[g.clone() for g in grads] for grads in groups]


@SETTINGS
@given(data=st.data(), seed=seeds_st, scale=scales_st, norm_type=norm_types_st, clip_ratio=clip_ratio_st)
def test_backends_agree(data, seed, scale, norm_type, clip_ratio):
    groups = make_groups(data, seed, allow_nonfinite=True)
    all_grads = [g for grads in groups for g in grads]
    finite = all(bool(torch.isfinite(g).all()) for g in all_grads)
    max_norm = None
    if clip_ratio is not None:
        max_norm = f32(oracle(all_grads, scale, norm_type, None).norm * clip_ratio) if finite else 1.0
    # Each backend within its own tolerance of the truth, so within the sum of the two of each other.
    rtol = max(NORM_RTOL[g.dtype] + TORCH_BACKEND_NORM_RTOL[g.dtype] for g in all_grads)
    scale_t = torch.tensor([scale])
    results, applied = {}, {}
    for backend in (TorchBackend(), TritonBackend()):
        mine = clone_groups(groups)
        r = backend.check(mine, scale_t, norm_type, max_norm)
        results[backend.name] = (r.found_inf.item(), r.norm.item(), r.factor.item())
        backend.apply_(r)
        applied[backend.name] = mine
    (fi_t, norm_t, fac_t), (fi_k, norm_k, fac_k) = results["torch"], results["triton"]
    assert fi_t == fi_k == (0.0 if finite else 1.0), f"found_inf torch {fi_t}, triton {fi_k}"
    if not finite:
        assert (math.isnan(norm_t) and math.isnan(norm_k)) or norm_t == norm_k == math.inf, (norm_t, norm_k)
        assert fac_t == fac_k == 1.0
    else:
        if norm_type == math.inf:
            assert norm_t == norm_k, "inf-norm: both exact (max |g| * inv_scale, rounded once)"
        else:
            assert abs(norm_t - norm_k) <= rtol * abs(norm_t), f"norm torch {norm_t!r}, triton {norm_k!r}"
        if max_norm is None:
            assert fac_t == fac_k == f32(inv_scale_of(scale))
        else:
            assert abs(fac_t - fac_k) <= (rtol + 2.0**-21) * abs(fac_t), f"factor torch {fac_t!r}, triton {fac_k!r}"
    for name, factor in (("torch", fac_t), ("triton", fac_k)):
        for k, (grads, mine) in enumerate(zip(groups, applied[name])):
            for t, (o, g) in enumerate(zip(grads, mine)):
                assert_bitwise(g, expected_product(o, factor), f"{name} apply_: group {k} gradient {t}", nan_aware=True)


@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 1000.0], ids=lambda s: f"scale={s:g}")
@pytest.mark.parametrize("inject_kind", [None, "inf", "-inf", "nan"], ids=lambda k: k or "finite")
def test_unscale_matches_torch_amp(backend, dtype, scale, inject_kind):
    gen = torch.Generator().manual_seed(23)
    sizes = [0, 1, 4097, UNALIGNED]
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    if inject_kind:  # last element of an unaligned tensor, and first of a second chunk
        grads[2][4096] = NONFINITE[inject_kind]
        grads[3][CHUNK] = NONFINITE[inject_kind]
    for layout_grads in (grads, grads[3:]):  # TABLE, then FLAT (one contiguous tensor)
        ours, theirs = [g.clone() for g in layout_grads], [g.clone() for g in layout_grads]
        found_ours, found_theirs = torch.zeros(1), torch.zeros(1)
        scale_t = torch.tensor([scale])
        backend.unscale_([ours], scale_t, found_ours)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, scale_t.double().reciprocal().float())
        assert found_ours.item() == found_theirs.item() == (1.0 if inject_kind else 0.0)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_bitwise(a, b, f"{backend.name} unscale_ of gradient {i} ({dtype_id(dtype)})", nan_aware=True)


def test_flat_buffer_with_an_empty_parameter_stays_flat():
    # nn.Linear(0, 3) has a [3, 0] weight: its empty view must not knock the group off the FLAT path.
    params = [torch.nn.Parameter(torch.randn(3, 0)), torch.nn.Parameter(torch.randn(40))]
    (buffer,) = tritonscale.flatten_grads_(params)
    layout = describe_grads([p.grad for p in params])
    assert layout.flat and layout.first is buffer
