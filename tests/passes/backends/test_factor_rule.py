""" "The factor is 1 on overflow" has one home, ``base.gradient_factor``: it gives the bits of the
rule worked on Python numbers (each product rounded once to float32), its overflowed step under a
policy that goes ahead is torch's unscale, and the kernels' finalize (which cannot call Python)
computes the same factor from its own results."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonscale.passes.backends import TritonBackend, gradient_factor, inverse_scale

#: float32 values for 1/scale and the clip coefficient: ordinary, at the ends of float32, inf, 0 and NaN.
floats32 = st.floats(min_value=0.0, width=32, allow_nan=False) | st.sampled_from([0.0, 1.0, 2.0**-126, math.nan])


def _torch_unscale_factor(scale: torch.Tensor) -> torch.Tensor:
    """What torch.amp.GradScaler.unscale_ multiplies by: its own inverse of the scale."""
    return scale.double().reciprocal().float()


def _float32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _bits(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32)


@settings(max_examples=200, deadline=None)
@given(inv=floats32, clip=floats32 | st.none(), overflow=st.booleans(), unscale=st.booleans())
def test_the_factor_is_the_rule_on_python_numbers(inv, clip, overflow, unscale):
    found = torch.tensor(float(overflow))
    ours = gradient_factor(
        found, torch.tensor(inv), None if clip is None else torch.tensor(clip), unscale_on_overflow=unscale
    )
    # The rule by hand: a float64 product of two float32 numbers, rounded once, is float32's product.
    factor = inv if clip is None else _float32(inv * clip)
    expected = (inv if unscale else 1.0) if overflow else factor
    assert ours.shape == ()
    assert torch.equal(_bits(expected), ours.view(torch.int32)), (expected, ours)


@pytest.mark.parametrize("scale", [2.0**16, 3.0, 2.0**-126])
@pytest.mark.parametrize("unscale", [False, True], ids=["skipped", "goes_ahead"])
def test_an_overflowed_step_keeps_its_gradients_or_unscales_as_torch(scale, unscale):
    scale_t = torch.tensor([scale])
    factor = gradient_factor(torch.tensor(1.0), inverse_scale(scale_t), torch.tensor(0.0), unscale_on_overflow=unscale)
    expected = _torch_unscale_factor(scale_t).reshape(()) if unscale else torch.ones(())
    assert torch.equal(factor.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["no_clip", "clip"])
def test_the_kernels_factor_is_the_rules(bad, max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(300), torch.randn(7, 5)]
    if bad is not None:
        grads[1][3, 2] = bad
    scale = torch.tensor([1024.0])
    result = TritonBackend().check([grads], scale, 2.0, max_norm)
    rule = gradient_factor(result.found_inf, inverse_scale(scale), result.clip_coef)
    assert torch.equal(result.factor.view(torch.int32), rule.view(torch.int32))
