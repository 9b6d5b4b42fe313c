"""Shared cases and checks of the kernel property tests (a helper module, not a test file).

Tests of the kernel launchers (tritonscale.kernels) and of the two backends import what they need
from here by name; the float64 oracle itself is tritonscale.kernels.reference.

Contract under test (module docstrings of tritonscale/kernels/*.py and tritonscale/passes/backends/*.py):
  check_pass(layout, partials, code)  read-only; writes partials[:, :layout.programs] (fp32 [3, P]:
      max |g| over finite elements, the power-of-two-scaled sum, sum of |g| over inf/NaN elements)
  finalize(partials, P, scale, code, max_norm) -> fp32 [4] = (found_inf, norm, clip_coef, factor)
      norm      = total norm of the unscaled gradients (NaN if any NaN, else +inf if any inf)
      clip_coef = min(max_norm / (norm + 1e-6), 1)      (torch.nn.utils.clip_grad_norm_'s rule)
      factor    = inv_scale * clip_coef, exactly 1.0 when found_inf; inv_scale = f32(1 / f64(scale))
  apply_factor_(layout, f[, invert, found_inf])  g <- f32(g) * f (or * f32(1/f64(f))) rounded once to
      g's dtype, like torch._amp_foreach_non_finite_check_and_unscale_; found_inf <- 1 on inf/NaN.

Every partials buffer is NaN-poisoned and one column wider than the pass needs, so a column the pass
failed to write, or one it wrote beyond its share, is caught.
"""

import math

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from tritonscale.kernels import check_pass, describe_grads, finalize, norm_code
from tritonscale.kernels.check_pass import PARTIAL_ROWS
from tritonscale.kernels.launch_config import CHUNK, DEFAULT_BLOCK
from tritonscale.kernels.reference import FinalizeRef, check_ref, f32, finalize_ref, inv_scale_of, torch_clip_coef

from .tolerances import NORM_RTOL

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
UNALIGNED = CHUNK + 3 * DEFAULT_BLOCK + 5  # crosses the chunk, not a multiple of the block

# No shrink phase: every interpreted launch costs milliseconds, and shrinking one failing example
# took minutes; a failure is reported as drawn (seeded, so it reproduces).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
SETTINGS = settings(max_examples=30, deadline=None, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])
SETTINGS_SMALL = settings(max_examples=20, deadline=None, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def run_check(
    grads: list[torch.Tensor], scale: float, norm_type: float, max_norm: float | None, run: torch.Tensor | None = None
):
    """describe_grads + check_pass + finalize, asserting the read-only and partials contracts.
    ``run``: the gradients' one run, if the caller found one (``describe_grads(run=...)``).

    Returns (layout, partials, result as a list of 4 floats, result tensor)."""
    layout = describe_grads(grads, run=run)
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
    ref = check_ref(grads)
    assert partials[0, :programs].max().item() == ref.max_abs, "max |g| over the partials"
    bad = partials[2, :programs]
    assert bool(((bad == 0) | (bad == math.inf) | torch.isnan(bad)).all()), f"non-finite row: {bad}"
    if ref.has_nan:
        assert torch.isnan(bad).any(), "a NaN gradient left no NaN in the partials"
    else:
        assert not torch.isnan(bad).any(), f"NaN partial without a NaN gradient (unwritten column?): {bad}"
        assert (bad.max().item() == math.inf) == ref.has_inf, f"inf partials: {bad}"


def check_finalize_result(
    res: list[float], orc: FinalizeRef, dtype: torch.dtype, scale: float, max_norm: float | None
) -> None:
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
    return f32(finalize_ref(grads, scale, norm_type, None).norm * ratio)
