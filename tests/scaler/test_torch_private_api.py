"""torch.amp.GradScaler's private members and protocols, with torch's scaler as the oracle.

Covers torch's private names (the last section of grad_scaler.py) and wrapper optimizers
(scaler/step_protocols.py): the step(grad_scaler=...) protocol of apex /
TransformerEngine fused optimizers, wrapper optimizers (Accelerate, Fabric) unscaled exactly once,
and each private member a framework reads.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.amp.grad_scaler import OptState as TorchOptState

import tritonscale
from tritonscale import GradScaler

SCALE = 2.0**8


def make_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]


def backward(params, scaler, bad=None, seed=1):
    torch.manual_seed(seed)
    loss = sum((p * torch.randn_like(p)).sum() * 3 for p in params)
    scaler.scale(loss).backward()
    if bad is not None:
        params[0].grad[0, 0] = bad


def scalers(backend):
    return torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2), GradScaler(
        "cpu", init_scale=SCALE, growth_interval=2, backend=backend
    )


# ------------------------------------------------------ step(grad_scaler=...) protocol
class LegacyFusedSGD(torch.optim.Optimizer):
    """An optimizer of the older protocol, written the way apex's FusedSGD and TransformerEngine's
    FusedAdam(capturable=True) use it: it asks the scaler for found_inf and the scale, unscales
    while it steps, and skips on inf/NaN itself."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None, grad_scaler=None):
        inv_scale = 1.0
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is TorchOptState.READY:
                found = grad_scaler._check_inf_per_device(self)
                inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
            else:
                found = grad_scaler._found_inf_per_device(self)
            if sum(v.item() for v in found.values()):
                return "skipped"
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad * inv_scale, alpha=-group["lr"])
        return "stepped"


@pytest.mark.parametrize("before_step", ["nothing", "unscale_", "clip"])
def test_grad_scaler_protocol_trains_like_torch(backend, before_step):
    runs = []
    for scaler in scalers(backend):
        params = make_params()
        optimizer = LegacyFusedSGD(params, lr=0.1)
        results = []
        for i, bad in enumerate([None, None, math.inf, None, math.nan, None]):
            optimizer.zero_grad()
            backward(params, scaler, bad, seed=i)
            if before_step == "unscale_":
                scaler.unscale_(optimizer)
            elif before_step == "clip":
                if isinstance(scaler, GradScaler):
                    scaler.clip_grad_norm_(optimizer, 0.5)
                else:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, 0.5)
            with pytest.warns(FutureWarning, match="stop passing itself") as caught:
                results.append(scaler.step(optimizer))
            if isinstance(scaler, GradScaler):  # ours points at the line that called scaler.step()
                assert {w.filename for w in caught if "stop passing itself" in str(w.message)} == {__file__}
            scaler.update()
        runs.append((results, scaler.get_scale(), [p.detach().clone() for p in params]))
    (torch_results, torch_scale, torch_params), (our_results, our_scale, our_params) = runs
    assert our_results == torch_results and our_scale == torch_scale
    for ours, theirs in zip(our_params, torch_params):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_pytorch_grad_scaler_pass_itself(backend):
    # PyTorch's own test_grad_scaler_pass_itself, ported: an optimizer whose step declares
    # grad_scaler gets the scaler (and no attributes); one that does not gets grad_scale/found_inf.
    seen = {}

    class Placeholder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class Optimizer1(Placeholder):
        def step(self, closure=None, *, grad_scaler=None):
            seen["1"] = (grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"))

    class Optimizer2(Placeholder):
        def step(self, closure=None):
            seen["2"] = (isinstance(self.grad_scale, torch.Tensor), isinstance(self.found_inf, torch.Tensor))

    model = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(model.parameters()), Optimizer2(model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 4)).float().mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen["1"] == (scaler, False, False)
    assert seen["2"] == (True, True)


# --------------------------------------------------------------- wrapper optimizers
class Wrapper(torch.optim.Optimizer):
    """Shaped like Accelerate's AcceleratedOptimizer: an Optimizer holding the real one in .optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


ROUTES = {  # (object given to clip_grad_norm_, object given to step), as frameworks mix them
    "clip-wrapper-step-inner": (lambda w: w, lambda w: w.optimizer),
    "clip-inner-step-wrapper": (lambda w: w.optimizer, lambda w: w),
    "wrapper-of-wrapper": (lambda w: Wrapper(w), lambda w: w.optimizer),
}


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_wrapper_and_inner_optimizer_are_unscaled_once(backend, route, fused):
    to_clip, to_step = ROUTES[route]
    runs = []
    for scaler in scalers(backend):
        params = make_params()
        inner = torch.optim.AdamW(params, lr=0.1, eps=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
        wrapper = Wrapper(inner)
        for i, bad in enumerate([None, None, math.inf, None]):
            wrapper.zero_grad()
            backward(params, scaler, bad, seed=i)
            if isinstance(scaler, GradScaler):
                scaler.clip_grad_norm_(to_clip(wrapper), 0.5)
            else:  # torch's oracle: the real optimizer, unscaled once
                scaler.unscale_(inner)
                torch.nn.utils.clip_grad_norm_(params, 0.5)
            # torch's oracle steps the real optimizer: given the wrapper after unscale_(inner) it would
            # unscale a second time (the defect ours must not have).
            scaler.step(to_step(wrapper) if isinstance(scaler, GradScaler) else inner)
            scaler.update()
            assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")
        runs.append((scaler.get_scale(), [p.detach().clone() for p in params]))
    (torch_scale, torch_params), (our_scale, our_params) = runs
    assert our_scale == torch_scale
    for ours, theirs in zip(our_params, torch_params):
        # The fold divides by scale/clip_coef where torch multiplies twice: ~1 ulp per factor.
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-7)


class Loop:
    """Two wrappers holding each other."""

    def __init__(self, other=None):
        self.optimizer = other if other is not None else Loop(self)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda opt: Loop(), ValueError, "loops"),
        (lambda opt: torch.nn.Linear(2, 2), TypeError, "expected a torch.optim.Optimizer"),
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1), TypeError, "LR scheduler"),
    ],
    ids=["looping-chain", "a-module", "a-scheduler"],
)
@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_", "step"])
def test_what_is_not_an_optimizer_is_refused_and_changes_nothing(backend, make, error, match, call):
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    backward(params, scaler)
    grads = [p.grad.clone() for p in params]
    state = scaler.state_dict()
    with pytest.raises(error, match=match):
        getattr(scaler, call)(make(optimizer), *((1.0,) if call == "clip_grad_norm_" else ()))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert scaler.state_dict() == state and len(scaler._per_optimizer_states) == 0


# ---------------------------------------------------------------- private members
# Each member, and who reads it (framework source, 2025-2026 releases).
PRIVATE_MEMBERS = {
    "_scale": "Lightning/Fabric checkpointing, fairseq's overflow check, timm",
    "_growth_tracker": "checkpoint code, torch's own tests",
    "_enabled": "Accelerate, Lightning MixedPrecision",
    "_per_optimizer_states": "Lightning (stage), Accelerate, fused optimizers (found_inf_per_device)",
    "_growth_factor": "ColossalAI / DeepSpeed-style scaler wrappers, logging",
    "_backoff_factor": "the same",
    "_growth_interval": "the same",
    "_init_scale": "Lightning's scaler re-creation, checkpoint code",
    "_init_growth_tracker": "the same",
    "_device": "Accelerate and Lightning device checks",
    "_lazy_init_scale_growth_tracker": "subclasses that scale by hand",
    "_unscale_grads_": "ColossalAI / DeepSpeed-style sharded scalers",
    "_maybe_opt_step": "sharded scalers' step()",
    "_check_inf_per_device": "apex / TransformerEngine fused optimizers (grad_scaler= protocol)",
    "_found_inf_per_device": "the same",
    "_get_scale_async": "the same",
}


def test_private_members_have_torchs_meaning(backend):
    theirs, ours = scalers(backend)
    for scaler in (theirs, ours):
        assert all(hasattr(scaler, name) for name in PRIVATE_MEMBERS)
    outcome = {}
    for scaler in (theirs, ours):
        params = make_params()
        optimizer = torch.optim.SGD(params, lr=0.1)
        backward(params, scaler, math.inf)
        state = scaler._per_optimizer_states[id(optimizer)]
        found = scaler._unscale_grads_(optimizer, scaler._scale.double().reciprocal().float(), torch.zeros(()), False)
        state["found_inf_per_device"] = found
        state["stage"] = TorchOptState.UNSCALED
        stepped = scaler._maybe_opt_step(optimizer, state)
        scaler.update()
        outcome[scaler is ours] = {
            "scale": float(scaler._scale),
            "tracker": int(scaler._growth_tracker),
            "knobs": (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval),
            "init": (scaler._init_scale, scaler._init_growth_tracker, scaler._enabled, scaler._device),
            "found": {d: float(t) for d, t in found.items()},
            "stepped": stepped,
            "grads": [p.grad.clone() for p in params],
            "async_scale": scaler._get_scale_async() is scaler._scale,
        }
    for key in outcome[False]:
        if key == "grads":
            assert all(torch.equal(a, b) for a, b in zip(outcome[True][key], outcome[False][key]))
        else:
            assert outcome[True][key] == outcome[False][key], key


def test_stage_values_are_torchs_enum(backend):
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend=backend)
    backward(params, scaler)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is TorchOptState.READY
    scaler.clip_grad_norm_(optimizer, 1.0)
    record = scaler._per_optimizer_states[id(optimizer)]
    assert record["stage"] is TorchOptState.UNSCALED and "found_inf_per_device" in record
    assert tritonscale.OptState is TorchOptState
    scaler.step(optimizer)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is TorchOptState.STEPPED


def test_not_an_instance_of_torchs_class():
    # Decided (README, "Drop-in compatibility"): inheriting torch's class would let every torch
    # method we do not override run silently on our state; code that must accept both checks for
    # the methods it calls, or for either class.
    assert not isinstance(GradScaler("cpu"), torch.amp.GradScaler)
