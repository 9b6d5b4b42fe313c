"""Both backends against torch at every loss scale, from the floor (2**-126) to float32's max.

The passes take the norm of the still-scaled gradients and divide the scale out afterwards, so
the ends of the range are where they can go wrong where torch (unscale first) does not: at
2**-80 every float32 square of an ordinary gradient underflows, at 2**100 it overflows. The
oracle is torch.amp.GradScaler: ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` on twin
parameters holding the same stored (scaled) gradients, then ``step`` + ``update``.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.host_reads import HostReadGuard
from hypothesis import example, given
from hypothesis import strategies as st
from oracles.kernel_cases import SETTINGS, f32
from oracles.tolerances import NORM_RTOL, TORCH_BACKEND_NORM_RTOL, TORCH_CLIP_COEF_RTOL

import tritonscale
from tritonscale import host_reads
from tritonscale.policy.rounding import SCALE_FLOOR

SHAPES = ((8, 32), (8,), (5, 7))
# How the stored gradients are laid out: the kernels' dtypes, and the torch-op gradients
# (float64; a strided view with gaps, beside two dense float32 ones in the same norm).
KINDS = ("float32", "bfloat16", "float64", "strided")
NONFINITE = {"inf": math.inf, "nan": math.nan}


def make_params(kind: str, scale: float, magnitude: int, seed: int, inject: str | None):
    """Parameters whose gradients hold ``randn * 2**magnitude`` as backward would store it at
    ``scale`` (rounded once to the gradient's dtype); the same ones for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(kind, torch.float32)
    params = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
        grad = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0**magnitude * scale).to(dtype)
        if kind == "strided" and i == len(SHAPES) - 1:  # every other column of a wider buffer
            grad = torch.zeros(shape[0], 2 * shape[1], dtype=dtype)[:, ::2].copy_(grad)
        p.grad = grad
        params.append(p)
    if inject is not None:
        params[0].grad.view(-1)[3] = NONFINITE[inject]
    return params


def torch_run(params, scale: float, max_norm: float, norm_type: float):
    """The oracle: torch's unscale_ + clip_grad_norm_, then step + update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    optimizer = torch.optim.SGD(params, lr=0.5)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    found_inf = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).item()
    clipped = [p.grad.clone() for p in params]
    scaler.step(optimizer)
    scaler.update()
    return norm, found_inf, clipped, scaler.get_scale()


def our_run(params, backend: str, scale: float, max_norm: float, norm_type: float, device_path: bool):
    """tritonscale's clip_grad_norm_, then step + update; ``device_path``: with no host read (the
    path every device but the CPU takes)."""
    scaler = tritonscale.GradScaler("cpu", init_scale=scale, backend=backend)
    optimizer = torch.optim.SGD(params, lr=0.5)
    scaler.scale(torch.ones(()))
    with pytest.MonkeyPatch.context() as patch:
        if device_path:
            patch.setattr(host_reads, "are_free", lambda device: False)
            with HostReadGuard(patch.setattr).armed():
                norm = scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
        else:
            norm = scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
    found_inf = float(scaler.overflowed(optimizer))
    clipped = [p.grad.clone() for p in params]
    scaler.step(optimizer)
    scaler.update()
    return norm.item(), found_inf, clipped, scaler.get_scale()


def true_norm(params, scale: float, norm_type: float) -> float:
    """float64 norm of the gradients unscaled by torch's float32 1/scale."""
    inv = f32(1.0 / scale)
    return torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() * inv for p in params]), norm_type).item()


def assert_same(ours, theirs, truth: float, rtol: float, dtype: torch.dtype, what: str) -> None:
    """found_inf, the next scale and the clipped gradients as torch's; the norm within ``rtol`` of
    the float64 ``truth`` (the tolerance table is relative to that: torch's own bfloat16 norm is
    rounded to bfloat16)."""
    (norm, found, clipped, next_scale), (ref_norm, ref_found, ref_clipped, ref_next) = ours, theirs
    assert found == ref_found, f"{what}: found_inf {found}, torch {ref_found}"
    # A backoff below the floor leaves the floor here (docs/differences-from-torch.md).
    assert next_scale == max(ref_next, SCALE_FLOOR), f"{what}: next scale {next_scale}, torch {ref_next}"
    if ref_found:
        assert norm == ref_norm or (math.isnan(norm) and math.isnan(ref_norm)), f"{what}: {norm} vs torch {ref_norm}"
        return
    assert abs(norm - truth) <= rtol * truth, f"{what}: norm {norm!r}, float64 {truth!r}, torch {ref_norm!r}"
    # The two clip coefficients differ by ours and torch's errors; each product then rounds once to
    # the gradient's dtype (ours: g * f32(inv_scale * coef); torch: (g * inv_scale) * coef), an ulp
    # apart at most (eps relative), or a float32 subnormal's for an unscaled value in that range.
    coef_rtol = rtol + TORCH_CLIP_COEF_RTOL[dtype] + torch.finfo(dtype).eps
    for i, (got, want) in enumerate(zip(clipped, ref_clipped)):
        torch.testing.assert_close(
            got, want, rtol=coef_rtol, atol=2.0**-149, msg=lambda m, i=i: f"{what}: clipped gradient {i}: {m}"
        )


@SETTINGS
@given(
    power=st.integers(-126, 127),
    mantissa=st.one_of(st.just(1.0), st.floats(1.0, 2.0, exclude_max=True, width=32)),
    kind=st.sampled_from(KINDS),
    norm_type=st.sampled_from([1.0, 2.0, math.inf]),
    magnitude=st.integers(-12, 4),
    clip_ratio=st.sampled_from([0.25, 0.9, 2.0]),
    inject=st.sampled_from([None, None, None, "inf", "nan"]),
    device_path=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@example(-80, 1.0, "float32", 2.0, 0, 0.25, None, False, 0)  # issue 26: torch backend clipped nothing
@example(-126, 1.0, "strided", 2.0, 0, 0.25, None, True, 1)  # the floor, torch-op gradients
@example(127, 1.5, "float32", 2.0, -8, 0.25, None, False, 2)  # squares past float32's max
@example(100, 1.0, "strided", 2.0, 0, 0.25, None, False, 3)  # torch-op gradients: the norm read inf
def test_every_scale_matches_torch(power, mantissa, kind, norm_type, magnitude, clip_ratio, inject, device_path, seed):
    scale = f32(mantissa * 2.0**power)
    magnitude = min(magnitude, 124 - power)  # keep the scaled gradients finite (|randn| < 8)
    twins = make_params(kind, scale, magnitude, seed, inject)
    truth = true_norm(twins, scale, norm_type)
    max_norm = f32(truth * clip_ratio) if inject is None else 1.0
    theirs = torch_run(twins, scale, max_norm, norm_type)
    for backend in ("torch", "triton"):
        params = make_params(kind, scale, magnitude, seed, inject)
        ours = our_run(params, backend, scale, max_norm, norm_type, device_path)
        rtol = (TORCH_BACKEND_NORM_RTOL if backend == "torch" else NORM_RTOL)[params[0].dtype]
        assert_same(ours, theirs, truth, rtol, params[0].dtype, f"{backend} backend, scale {scale!r}, {kind}")
