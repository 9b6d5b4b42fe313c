"""One optimizer's norms feed a scaler's norm history (tritonscale/scaler/norm_history.py).

Two optimizers clipped on one scaler with a norm-history rule are refused before anything changes;
the ways that work (one scaler per optimizer, an optimizer that is only stepped) run as the
reference rule fed that optimizer's norms alone (OLMo-core's, tests/oracles/spike_rules.py).
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from support.compiled_placements import needs_compiled_clip
from oracles.spike_rules import OlmoSkip

import tritonscale
from tritonscale.errors import ScalerConfigError

HISTORY_RULES = {
    "skip_norm_factor": {"skip_norm_factor": 3.0, "norm_warmup_steps": 2},
    "skip_norm_sigma": {"skip_norm_sigma": 6.0, "skip_norm_window": 8},
    "clip_norm_z": {"clip_norm_z": 2.5, "clip_norm_warmup_steps": 4},
}
STEADY = {"a": 10.0, "b": 1.0}  # the two optimizers' steady norms
SCALE = 16.0


class Pair:
    """Two optimizers of one parameter each, their gradients set to a steady norm times the scale."""

    def __init__(self) -> None:
        self.params = {name: torch.nn.Parameter(torch.zeros(4)) for name in STEADY}
        self.opts = {name: torch.optim.SGD([p], lr=0.1) for name, p in self.params.items()}
        self.g = torch.Generator().manual_seed(0)

    def backward(self, scaler: tritonscale.GradScaler) -> None:
        scaler.scale(sum(p.sum() for p in self.params.values()) * 0.0).backward()
        for name, p in self.params.items():
            noise = 1.0 + 0.01 * torch.randn(4, generator=self.g)
            p.grad.copy_(noise * STEADY[name] / 2 * SCALE)  # unscaled norm about STEADY[name]


def _state(scaler: tritonscale.GradScaler) -> dict:
    return {name: getattr(scaler._tensors, name).clone() for name in ("scale", "counters", "norm_stats", "spike_stats")}


@pytest.mark.parametrize("rule", list(HISTORY_RULES))
@pytest.mark.parametrize("when", ["same_iteration", "later_iteration"])
def test_a_second_clipped_optimizer_is_refused_and_nothing_changes(rule, when):
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, **HISTORY_RULES[rule])
    pair.backward(scaler)
    scaler.clip_grad_norm_(pair.opts["a"], 100.0)
    if when == "later_iteration":
        scaler.step(pair.opts["a"])
        scaler.update()
        pair.backward(scaler)
    grads, state = pair.params["b"].grad.clone(), _state(scaler)
    records = dict(scaler._per_optimizer_states)
    with pytest.raises(ScalerConfigError, match=rf"{rule}=") as error:
        scaler.clip_grad_norm_(pair.opts["b"], 100.0)
    message = str(error.value)
    assert "Clip once over all parameters" in message and "its own GradScaler" in message
    assert "only stepped" in message
    assert torch.equal(pair.params["b"].grad, grads)
    assert all(torch.equal(value, _state(scaler)[name]) for name, value in state.items())
    assert dict(scaler._per_optimizer_states) == records and scaler.optimizer_stage(pair.opts["b"]) is None


def test_one_scaler_per_optimizer_judges_each_by_its_own_norms():
    """The way that works: each optimizer's skips are OLMo-core's on its own norms (steady: none),
    where one shared history skipped the steady optimizer as a spike."""
    pair = Pair()
    knobs = HISTORY_RULES["skip_norm_sigma"]
    scalers = {name: tritonscale.GradScaler("cpu", init_scale=SCALE, **knobs) for name in STEADY}
    references = {name: OlmoSkip(8, 6.0) for name in STEADY}
    for _ in range(12):
        for opt in pair.opts.values():
            opt.zero_grad()
        for scaler in scalers.values():
            pair.backward(scaler)  # each scaler scales the same loss; the gradients are set anew
        for name, opt in pair.opts.items():
            norm = scalers[name].clip_grad_norm_(opt, 100.0)
            scalers[name].step(opt)
            scalers[name].update()
            assert scalers[name].last_step_skipped() == references[name].skip(norm.item())


def test_an_optimizer_only_stepped_shares_the_scaler():
    """A clipped, B unscaled and stepped each iteration: A's skips are OLMo-core's on A's norms."""
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, **HISTORY_RULES["skip_norm_sigma"])
    reference, skips = OlmoSkip(8, 6.0), []
    for _ in range(12):
        pair.backward(scaler)
        norm = scaler.clip_grad_norm_(pair.opts["a"], 100.0)
        scaler.step(pair.opts["a"])
        skips.append(scaler.last_step_skipped())
        assert skips[-1] == reference.skip(norm.item())
        scaler.unscale_(pair.opts["b"])
        scaler.step(pair.opts["b"])
        scaler.update()
    assert skips.count(True) <= 1  # the window's first std (one norm) is NaN, as OLMo-core's


class Wrapper:
    """A framework's optimizer wrapper (Accelerate's AcceleratedOptimizer): the real one at ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_the_owner_is_the_real_optimizer_behind_wrappers():
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, **HISTORY_RULES["clip_norm_z"])
    for clipped in (Wrapper(pair.opts["a"]), pair.opts["a"], Wrapper(Wrapper(pair.opts["a"]))):
        pair.backward(scaler)
        scaler.clip_grad_norm_(clipped, 100.0)
        scaler.step(pair.opts["a"])
        scaler.update()
    pair.backward(scaler)
    with pytest.raises(ScalerConfigError, match="clip_norm_z=2.5"):
        scaler.clip_grad_norm_(Wrapper(pair.opts["b"]), 100.0)


def test_a_gone_owner_a_load_and_a_copy_free_the_history():
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, **HISTORY_RULES["skip_norm_sigma"])
    pair.backward(scaler)
    scaler.clip_grad_norm_(pair.opts["a"], 100.0)
    scaler.step(pair.opts["a"])
    scaler.update()
    for fresh in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        pair.backward(fresh)
        fresh.clip_grad_norm_(pair.opts["b"], 100.0)  # a copy starts with no owner
    pair.backward(scaler)
    scaler.load_state_dict(scaler.state_dict())
    scaler.clip_grad_norm_(pair.opts["b"], 100.0)  # the loaded history is no optimizer's yet
    scaler.step(pair.opts["b"])
    scaler.update()
    del pair.opts["b"]
    gc.collect()
    pair.backward(scaler)
    scaler.clip_grad_norm_(pair.opts["a"], 100.0)  # b is gone: a may take the history over


def test_without_a_history_rule_two_clipped_optimizers_share_a_scaler():
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, skip_norm_above=1e3)  # no history: a fixed bound
    for _ in range(2):
        pair.backward(scaler)
        for opt in pair.opts.values():
            scaler.clip_grad_norm_(opt, 100.0)
            scaler.step(opt)
        scaler.update()


@needs_compiled_clip
def test_a_compiled_clip_refuses_the_second_optimizer_with_the_message():
    """Traced (fullgraph): the owner check is a guard on the owner, once warm nothing recompiles for
    it; the second optimizer's clip fails with the message (in Dynamo's error), nothing changed."""
    torch._dynamo.reset()
    pair = Pair()
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, **HISTORY_RULES["skip_norm_sigma"])
    clip = torch.compile(scaler.clip_grad_norm_, backend="aot_eager", fullgraph=True)
    for step in range(4):
        pair.backward(scaler)
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            clip(pair.opts["a"], 100.0)
        scaler.step(pair.opts["a"])
        scaler.update()
    pair.backward(scaler)
    grads = pair.params["b"].grad.clone()
    with pytest.raises(Exception, match="skip_norm_sigma=6.0 on a second optimizer"):
        clip(pair.opts["b"], 100.0)
    assert torch.equal(pair.params["b"].grad, grads) and scaler.optimizer_stage(pair.opts["b"]) is None
