"""What an older torch gets (tritonscale/torch_compat.py): the features that need torch 2.12,
refused or done as torch's own GradScaler does at that release.

On torch 2.12 or newer the older release is stood in for by setting ``torch_compat.TORCH_RELEASE``
to (2, 11) (and, for fused Adagrad, removing the ``_step_supports_amp_scaling`` flag that 2.11's
does not set); on torch 2.11 (``.ci/check_floors`` at the floor) the tests run against the real one.
"""

from __future__ import annotations

import pytest
import torch

from tritonscale import GradScaler, torch_compat

OLD = (2, 11)


@pytest.fixture
def torch_2_11(monkeypatch):
    """The torch release tritonscale sees is 2.11 (the real one, or a stand-in on a newer torch)."""
    monkeypatch.setattr(torch_compat, "TORCH_RELEASE", min(torch_compat.TORCH_RELEASE, OLD))


def scaled_model(optimizer_kind, fused: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    optimizer = optimizer_kind(model.parameters(), lr=0.1, fused=fused)
    return model, optimizer


def backward(scaler, model) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    scaler.scale(model(x).square().mean()).backward()


def snapshot(model, optimizer) -> list[torch.Tensor]:
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in [*model.parameters(), *(p.grad for p in model.parameters()), *state]]


@pytest.mark.parametrize("fused", [False, True], ids=["SGD", "fused AdamW"])
def test_a_compiled_clip_on_torch_2_11_is_refused_naming_the_release_and_changes_nothing(torch_2_11, fused):
    torch._dynamo.reset()
    model, optimizer = scaled_model(torch.optim.AdamW if fused else torch.optim.SGD, fused)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    backward(scaler, model)
    before, scaler_before = snapshot(model, optimizer), scaler.state_dict()
    clip = torch.compile(lambda: scaler.clip_grad_norm_(optimizer, 0.5), backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_ inside torch.compile needs torch>=2\.12 \(this is torch"):
        clip()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
    assert scaler.state_dict() == scaler_before
    # Outside the compiled function the same clip runs: the norm of the unscaled gradients, as torch's.
    norm = scaler.clip_grad_norm_(optimizer, 0.5)
    theirs = torch.nn.utils.get_total_norm([grad / 2.0**8 for grad in before[2:4]])
    torch.testing.assert_close(norm, theirs)


def test_the_release_is_read_from_torch_version():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert torch_compat.TORCH_RELEASE == (major, minor)
    assert torch_compat.has_torch((major, minor)) and not torch_compat.has_torch((major, minor + 1))


def adagrad_run(ours: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three clipped steps of fused Adagrad as on torch 2.11 (no _step_supports_amp_scaling): the
    gradients scaler.step leaves, and the parameters after."""
    model, optimizer = scaled_model(torch.optim.Adagrad, fused=True)
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        del optimizer._step_supports_amp_scaling  # what torch 2.11's fused Adagrad sets: nothing
    scaler = GradScaler("cpu", init_scale=2.0**8) if ours else torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for _ in range(3):
        optimizer.zero_grad()
        backward(scaler, model)
        if ours:
            scaler.clip_grad_norm_(optimizer, 0.5)
        else:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
    return [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def test_fused_adagrad_on_torch_2_11_is_unscaled_in_place_as_torchs_grad_scaler_does(torch_2_11):
    # torch's GradScaler unscales and clips in place for an optimizer that declares no amp scaling;
    # folding the clip into the step instead (scale / clip_coef) would round differently.
    (our_grads, our_params), (grads, params) = adagrad_run(ours=True), adagrad_run(ours=False)
    assert all(torch.equal(a, b) for a, b in zip(our_grads, grads))
    assert all(torch.equal(a, b) for a, b in zip(our_params, params))
