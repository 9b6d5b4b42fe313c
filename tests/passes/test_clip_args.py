"""clip_grad_norm_'s arguments as a torch user passes them: every real number torch's clip takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import scaler_twins

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


def _torch_keyword_run(ours: bool, **keywords):
    """One scaled iteration of twin tiny models; ``keywords`` go to the clip (ours) or to
    torch.nn.utils.clip_grad_norm_ (the oracle, after torch's unscale_)."""
    params = scaler_twins.make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = (tritonscale.GradScaler if ours else torch.amp.GradScaler)("cpu", init_scale=2.0**8)
    scaler_twins.scaled_backward(params, scaler)
    if ours:
        norm = scaler.clip_grad_norm_(optimizer, 1.0, **keywords)
    else:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0, **keywords)
    scaler.step(optimizer)
    scaler.update()
    return norm, [p.detach().clone() for p in params]


@pytest.mark.parametrize("foreach", [None, True, False], ids=lambda f: f"foreach={f}")
@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
def test_torchs_foreach_and_error_if_nonfinite_false_step_as_torchs(foreach, positional):
    """torch's other two clip arguments, by keyword and in torch's positional order
    (max_norm, norm_type, error_if_nonfinite, foreach): the same step as torch's."""
    if positional:
        params = scaler_twins.make_params()
        optimizer = torch.optim.SGD(params, lr=0.1)
        scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8)
        scaler_twins.scaled_backward(params, scaler)
        norm = scaler.clip_grad_norm_(optimizer, 1.0, 2.0, False, foreach)
        scaler.step(optimizer)
        ours = norm, [p.detach().clone() for p in params]
    else:
        ours = _torch_keyword_run(True, error_if_nonfinite=False, foreach=foreach)
    norm, stepped = _torch_keyword_run(False, error_if_nonfinite=False, foreach=foreach)
    torch.testing.assert_close(ours[0], norm, rtol=1e-6, atol=0)
    for a, b in zip(ours[1], stepped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_error_if_nonfinite_true_names_what_the_scaler_does_and_changes_nothing():
    params = scaler_twins.make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8)
    scaler_twins.scaled_backward(params, scaler, inject=float("inf"))
    before = scaler_twins.Snapshot.take(params, [optimizer], scaler)
    with pytest.raises(ValueError, match=r"error_if_nonfinite=True .*step\(\) skips.*max_consecutive_skips"):
        scaler.clip_grad_norm_(optimizer, 1.0, error_if_nonfinite=True)
    before.assert_same(scaler_twins.Snapshot.take(params, [optimizer], scaler))
    scaler.clip_grad_norm_(optimizer, 1.0)  # the iteration goes on as if the call never happened
    scaler.step(optimizer)
    scaler.update()
    assert float(scaler.get_scale()) == 2.0**7  # the overflow backed the scale off, as documented


@pytest.mark.parametrize("keywords", [dict(foreach="yes"), dict(error_if_nonfinite=1)], ids=repr)
def test_torch_keywords_of_the_wrong_type_are_refused(keywords):
    params = scaler_twins.make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8)
    scaler_twins.scaled_backward(params, scaler)
    with pytest.raises(TypeError, match=f"{next(iter(keywords))} must be"):
        scaler.clip_grad_norm_(optimizer, 1.0, **keywords)
