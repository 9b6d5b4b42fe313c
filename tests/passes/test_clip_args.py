"""clip_grad_norm_'s arguments as a torch user passes them: every real number torch's clip takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tritonscale


def _clipped(max_norm, norm_type, ours: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = (
        tritonscale.GradScaler("cpu", init_scale=2.0**8) if ours else torch.amp.GradScaler("cpu", init_scale=2.0**8)
    )
    scaler.scale(model(torch.ones(2, 6)).square().sum()).backward()
    if ours:
        norm = scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
    else:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", [np.float16, np.float32, np.float64, np.int32, np.int64], ids=lambda k: k.__name__)
def test_numpy_max_norm_and_norm_type_clip_as_torchs(kind):
    norm, grads = _clipped(kind(1), kind(2), ours=True)
    ref_norm, ref_grads = _clipped(kind(1), kind(2), ours=False)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [np.bool_(True), True, "1.0", np.float32(-1.0), np.float64("nan")], ids=repr)
def test_bools_strings_negative_and_nan_max_norms_are_still_refused(bad):
    with pytest.raises(ValueError, match="max_norm must be"):
        _clipped(bad, 2.0, ours=True)
