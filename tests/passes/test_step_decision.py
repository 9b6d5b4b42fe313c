"""The step decided in the clip's finalize (passes/step_decision.py) against the step's own rule.

The clip's finalize decides the fold's divisor, ZClip's max_norm and the step's skip, and the step
runs no rule of its own. The oracle is the same iteration with the finalize kept from deciding
(``StepDecision.earlier_on`` answering no): the step runs the policy's skip rule in tensor ops. Both
are held to the same trajectory, bit for bit, through overflows, norm spikes, an unscale_ before the
clip, and two clips in one iteration: parameters, optimizer state, the scale, the counters and every
skip flag."""

from __future__ import annotations

import math

import pytest
import torch

from tritonscale import GradScaler
from tritonscale.passes.step_decision import StepDecision

POLICIES = {
    "rich": {
        "hysteresis": 2,
        "skip_norm_factor": 3.0,
        "norm_warmup_steps": 3,
        "skip_norm_sigma": 3.0,
        "skip_norm_window": 8,
        "clip_norm_z": 2.0,
        "clip_norm_warmup_steps": 4,
    },
    "goes_ahead": {"dynamic": False, "skip_on_overflow": False, "skip_norm_above": 40.0},
    "defaults": {},
}
STEPS = 24
SPIKES = {9: 30.0, 16: 60.0}  # the gradients' size those steps, times the usual
OVERFLOWS = (6, 13)


def _optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def _trajectory(kind: str, knobs: dict) -> list[list[torch.Tensor]]:
    """Run STEPS steps; each step's parameters, optimizer state, scale, counters and skip flag."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 17, 64)]
    optimizer = _optimizer(kind, params)
    scaler = GradScaler("cpu", init_scale=2.0**8, backend="triton", compile_policy=False, **knobs)
    rows = []
    for step in range(STEPS):
        weight = SPIKES.get(step, 1.0 + 0.1 * math.sin(step))
        loss = sum((p * p).sum() * weight for p in params)
        if step in OVERFLOWS:
            loss = loss + params[1][3] * math.inf
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if step % 5 == 4 and kind == "sgd":
            scaler.unscale_(optimizer)  # the clip after it merges the flag unscale_ recorded
        scaler.clip_grad_norm_(optimizer, 2.0)
        if step % 7 == 3:
            scaler.clip_grad_norm_(optimizer, 1.0)  # a second clip: it decides again
        scaler.step(optimizer)
        scaler.update()
        skip = scaler.last_skip_flag().clone()
        state = [t.clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        tensors = scaler._tensors
        rows.append([*(p.detach().clone() for p in params), *state, tensors.scale.clone(), tensors.counters.clone()])
        rows[-1].append(skip)
    return rows


@pytest.mark.parametrize("kind", ["fused", "sgd"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_finalizes_decision_steps_as_the_steps_own_rule(monkeypatch, kind, policy):
    asked, earlier_on = [], StepDecision.earlier_on
    monkeypatch.setattr(StepDecision, "earlier_on", lambda self, d: asked.append(earlier_on(self, d)) or asked[-1])
    device = _trajectory(kind, POLICIES[policy])
    assert asked and all(decides for decides, _ in asked)  # every clip's finalize decided its step
    monkeypatch.setattr(StepDecision, "earlier_on", lambda self, device: (False, None))  # never decides
    host = _trajectory(kind, POLICIES[policy])
    skipped = [bool(row[-1]) for row in host]
    assert any(skipped) and not all(skipped), skipped  # the rules fired, and not always
    for step, (want, got) in enumerate(zip(host, device)):
        for a, b in zip(want, got):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), (step, a, b)


@pytest.mark.parametrize("decides", [True, False], ids=["finalize_decides", "step_decides"])
def test_a_knob_set_between_the_clip_and_the_step_decides_again(monkeypatch, decides):
    """The clip's finalize decided the skip by the policy as it was; a knob set before the step
    (here: overflowed steps go ahead) makes the step decide again, by the policy as it is now,
    as a step whose finalize did not decide does."""
    if not decides:
        monkeypatch.setattr(StepDecision, "earlier_on", lambda self, device: (False, None))
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = GradScaler("cpu", init_scale=4.0, backend="triton", compile_policy=False, dynamic=False)
    scaler.scale((param * math.inf).sum()).backward()
    scaler.clip_grad_norm_(optimizer, 1.0)
    scaler._policy.skip_on_overflow = False  # set after the clip decided the skip
    before = param.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(param.detach(), before), "the step was skipped by the policy as it had been"
    assert scaler.stats()["skipped_steps"].item() == 0
