"""The torch and Triton backends (tritonscale/passes/backends/) on the same inputs: they agree with each
other, and their unscale_ matches torch.amp's bit for bit."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracles.kernel_cases import (
    DTYPES,
    EDGE_SIZES,
    NONFINITE,
    SETTINGS,
    UNALIGNED,
    assert_bitwise,
    clip_ratio_st,
    dtype_id,
    make_grads,
    norm_types_st,
    scales_st,
    seeds_st,
)
from oracles.tolerances import NORM_RTOL, TORCH_BACKEND_NORM_RTOL

from tritonscale.kernels.launch_config import CHUNK
from tritonscale.kernels.reference import apply_ref, f32, finalize_ref, inv_scale_of
from tritonscale.passes.backends import TorchBackend, TritonBackend


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
        max_norm = f32(finalize_ref(all_grads, scale, norm_type, None).norm * clip_ratio) if finite else 1.0
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
            for t, (e, g) in enumerate(zip(apply_ref(grads, factor), mine)):
                assert_bitwise(g, e, f"{name} apply_: group {k} gradient {t}", nan_aware=True)


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


@SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    sizes=st.lists(st.one_of(st.integers(0, 3000), st.sampled_from(EDGE_SIZES)), min_size=1, max_size=6),
    seed=seeds_st,
    factor=st.floats(2.0**-27, 4.0, width=32),
    large=st.booleans(),
)
def test_apply_multiplies_as_foreach_mul(dtype, sizes, seed, factor, large):
    # The CPU apply multiplies small tensors through torch's unscale kernel and large ones with
    # _foreach_mul_: both must be _foreach_mul_'s result by the float32 factor, bit for bit.
    from tritonscale.passes.backends import torch_backend

    grads = make_grads(sizes, dtype, seed, 2.0**8)
    expected = [g.clone() for g in grads]
    torch._foreach_mul_(expected, torch.tensor(factor))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_backend, "SMALL_TENSORS", -1 if large else math.inf)
        torch_backend._multiply_(grads, torch.tensor(factor))
    for k, (got, want) in enumerate(zip(grads, expected)):
        assert_bitwise(got, want, f"tensor {k}")
