"""LossScaleOptimizer: TensorFlow's / Keras's shape of loss scaling, on the GradScaler controller.

Oracles: Keras's dynamic loss scale rule written out by hand (tf.keras mixed_precision
``_DynamicLossScaleState.update``: grow by the multiplier after ``growth_steps`` finite steps, only
while the grown scale is finite; halve on a non-finite step, not below 1; either resets the
counter), the same loop driven through ``tritonscale.GradScaler`` by hand (bitwise), and torch's
GradScaler.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings

import pytest
import torch
from oracles.scaler_twins import COPIES, bits, same_bits

import tritonscale
from tritonscale import LossScaleOptimizer, LossScalePolicy


class KerasDynamicLossScaleRef:
    def __init__(self, initial_scale: float = 2.0**15, growth_steps: int = 2000, multiplier: float = 2.0):
        self.scale, self.growth_steps, self.multiplier, self.counter = initial_scale, growth_steps, multiplier, 0

    def update(self, finite: bool) -> None:
        if finite:
            if self.counter + 1 >= self.growth_steps:
                grown = self.scale * self.multiplier
                self.scale = grown if math.isfinite(grown) else self.scale
                self.counter = 0
            else:
                self.counter += 1
        else:
            self.scale = max(self.scale / self.multiplier, 1.0)
            self.counter = 0


def keras_policy(growth_steps: int) -> LossScalePolicy:
    """tf.keras.mixed_precision.LossScaleOptimizer(dynamic_growth_steps=N) as our policy."""
    return LossScalePolicy(growth_interval=growth_steps, min_scale=1.0)


def make(fused=False, backend="torch", seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    return model, LossScaleOptimizer(inner, backend=backend, **kw)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_of(model, step, poison=False):
    x, y = batch(step)
    if poison:
        x = x.clone()
        x[0, 0] = math.inf
    return torch.nn.functional.mse_loss(model(x), y)


# ------------------------------------------------------------ Keras's rule
def test_scale_sequence_follows_keras_dynamic_loss_scale(backend):
    pattern = [False, False, False, True, False, False, True, True, False, False, False, False]
    model, optimizer = make(backend=backend, policy=keras_policy(3), init_scale=4.0)
    ref = KerasDynamicLossScaleRef(initial_scale=4.0, growth_steps=3)
    for step, overflow in enumerate(pattern):
        optimizer.backward_and_step(loss_of(model, step, poison=overflow))
        optimizer.zero_grad()
        ref.update(not overflow)
        assert optimizer.loss_scale == ref.scale, f"step {step}"
        assert optimizer.last_step_applied() is not overflow
        assert float(optimizer.step_applied) == (0.0 if overflow else 1.0)
    assert ref.scale == 2.0  # the pattern reached the floor of 1 and grew again


# ------------------------------------------------------ same as GradScaler
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
@pytest.mark.parametrize("form", ["backward_and_step", "minimize", "split"])
def test_training_equals_the_gradscaler_loop_bitwise(backend, fused, form):
    model, optimizer = make(fused, backend, max_norm=0.5)
    twin, _ = make(fused, backend)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=fused)
    scaler = tritonscale.GradScaler("cpu", backend=backend)
    for step in range(4):
        poison = step == 2
        if form == "backward_and_step":
            norm = optimizer.backward_and_step(loss_of(model, step, poison))
        elif form == "minimize":
            optimizer.minimize(lambda step=step, poison=poison: loss_of(model, step, poison))
            norm = optimizer.scaler.stats()["norm"]
        else:
            optimizer.scaled_backward(loss_of(model, step, poison))
            norm = optimizer.apply()
        optimizer.zero_grad()
        scaler.scale(loss_of(twin, step, poison)).backward()
        twin_norm = scaler.clip_grad_norm_(twin_opt, 0.5)
        scaler.step(twin_opt)
        scaler.update()
        twin_opt.zero_grad()
        # Values, bit for bit (stats() hands out copies: their storage offset is not the clip's).
        assert same_bits(bits(norm.clone()), bits(twin_norm.clone())) or (poison and not torch.isfinite(norm))
        assert optimizer.loss_scale == scaler.get_scale()
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(ours, theirs)
    assert optimizer.loss_scale == 2.0**15  # the poisoned step backed off, as in torch


def test_training_matches_torch_gradscaler():
    model, optimizer = make(max_norm=0.5)
    twin, _ = make()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        optimizer.backward_and_step(loss_of(model, step, step == 1))
        optimizer.zero_grad()
        scaler.scale(loss_of(twin, step, step == 1)).backward()
        scaler.unscale_(twin_opt)
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        scaler.step(twin_opt)
        scaler.update()
        twin_opt.zero_grad()
        assert optimizer.loss_scale == scaler.get_scale()
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_fused_inner_keeps_the_fold(backend, forbid_host_reads, monkeypatch):
    # No apply pass and no host read: the unscale and the clip go into the fused step.
    from tritonscale.passes import grad_passes

    applied = []
    apply_on = grad_passes._apply_on
    monkeypatch.setattr(grad_passes, "_apply_on", lambda *a: applied.append(a) or apply_on(*a))
    model, optimizer = make(fused=True, backend=backend, max_norm=0.5)
    optimizer.scaled_backward(loss_of(model, 0))
    forbid_host_reads.on = True
    optimizer.step()
    forbid_host_reads.on = False
    assert applied == []
    assert optimizer.state[next(model.parameters())]["step"] == 1


# ------------------------------------------- a torch optimizer to its users
def test_is_a_torch_optimizer_to_schedulers_hooks_and_groups():
    model, optimizer = make(max_norm=1.0)
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for step in range(2):
            optimizer.backward_and_step(loss_of(model, step))
            scheduler.step()
            optimizer.zero_grad()
    assert calls == ["pre", "post"] * 2
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    assert optimizer.param_groups[0]["lr"] == 1e-2 * 0.25
    assert all(p.grad is None for p in model.parameters())  # zero_grad reached the inner optimizer
    extra = torch.nn.Parameter(torch.zeros(3))
    optimizer.add_param_group({"params": [extra]})
    assert optimizer.optimizer.param_groups[-1]["params"] == [extra]


def test_state_dict_carries_the_scale_and_resumes_bitwise(backend):
    model, optimizer = make(backend=backend, max_norm=0.5, init_scale=2.0**8)
    for step in range(3):
        optimizer.backward_and_step(loss_of(model, step, poison=step == 1))
        optimizer.zero_grad()
    saved = copy.deepcopy(optimizer.state_dict())  # a checkpoint: not the live state tensors
    assert saved["loss_scaler"]["scale"] == 2.0**7
    saved_params = [p.detach().clone() for p in model.parameters()]
    resumed_model, resumed = make(backend=backend, max_norm=0.5)
    with torch.no_grad():
        for p, q in zip(resumed_model.parameters(), saved_params):
            p.copy_(q)
    resumed.load_state_dict(saved)
    assert resumed.loss_scale == 2.0**7
    for step in range(3, 6):
        for m, o in ((model, optimizer), (resumed_model, resumed)):
            o.backward_and_step(loss_of(m, step))
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
@pytest.mark.parametrize("how", list(COPIES))
def test_copy_mid_training_continues_bitwise_as_the_original(backend, fused, how):
    # As a plain optimizer with a GradScaler does: copied between iterations (model and optimizer
    # together, so they share the copied parameters), the copy continues exactly as the original.
    policy = LossScalePolicy(growth_interval=2)
    model, optimizer = make(fused, backend, max_norm=0.5, policy=policy, init_scale=2.0**8)
    for step in range(3):
        optimizer.backward_and_step(loss_of(model, step, poison=step == 1))
        optimizer.zero_grad()
    copied_model, copied = COPIES[how]((model, optimizer))
    assert type(copied) is LossScaleOptimizer and copied.scaler is not optimizer.scaler
    assert copied.param_groups[0]["params"][0] is next(copied_model.parameters())
    assert (copied.max_norm, copied.loss_scale) == (0.5, optimizer.loss_scale)
    scales = []
    for step in range(3, 8):  # a growth at step 3, an overflow at 4, a growth at 6
        norms = []
        for m, o in ((model, optimizer), (copied_model, copied)):
            norms.append(o.backward_and_step(loss_of(m, step, poison=step == 4)))
            o.zero_grad()
        assert same_bits(bits(norms[0]), bits(norms[1])), f"step {step}"
        assert copied.loss_scale == optimizer.loss_scale, f"step {step}"
        scales.append(optimizer.loss_scale)
    assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**8, 2.0**8]
    for ours, theirs in zip(model.parameters(), copied_model.parameters()):
        assert same_bits(bits(ours), bits(theirs))
    assert same_bits(
        [bits(t) for s in optimizer.optimizer.state.values() for t in s.values()],
        [bits(t) for s in copied.optimizer.state.values() for t in s.values()],
    )


def _scheduled_run(fused: bool, how: str | None = None) -> dict:
    """8 steps with a StepLR scheduler attached (which patches ``optimizer.step`` on the instance),
    overflows at 1 and 5. With ``how``, copied at step 3 (model, optimizer and scheduler together;
    copy.copy: the optimizer alone, which then shares the model, inner optimizer and scaler): from
    there the copy goes on, and a deep copy's original goes on too, interleaved with it (both
    backward, then both step). Returns each one's norms, scales, learning rates and parameters."""
    model, optimizer = make(fused, "torch", max_norm=0.5, policy=LossScalePolicy(growth_interval=2), init_scale=2.0**8)
    runs = {"original": (model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))}
    logs = {"original": []}
    for step in range(8):
        if step == 3 and how is not None:
            m, o, sched = runs["original"]
            runs["copy"] = (m, copy.copy(o), sched) if how == "copy.copy" else COPIES[how]((m, o, sched))
            logs["copy"] = list(logs["original"])
            if how == "copy.copy":
                del runs["original"], logs["original"]
        for m, o, _ in runs.values():
            o.scaled_backward(loss_of(m, step, poison=step in (1, 5)))
        for name, (_, o, sched) in runs.items():
            norm = o.step()
            sched.step()
            o.zero_grad()
            logs[name].append((bits(norm), o.loss_scale, o.param_groups[0]["lr"]))
    return {name: (logs[name], [bits(p) for p in m.parameters()]) for name, (m, _, _) in runs.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
@pytest.mark.parametrize("how", ["copy.copy", *COPIES])
def test_copy_with_an_lr_scheduler_steps_itself_as_the_original_would(fused, how):
    # The scheduler wraps step() on the instance; a copy that kept the wrapper stepped the original.
    oracle = _scheduled_run(fused)["original"]  # the original, continued uncopied
    runs = _scheduled_run(fused, how)
    for name, run in runs.items():
        assert same_bits(run, oracle), name


# ------------------------------------------------------------- bad input
def snapshot(model, optimizer):
    return (
        [bits(p) for p in model.parameters()],
        [bits(p.grad) for p in model.parameters()],
        repr(optimizer.optimizer.state_dict()),
        optimizer.scaler.state_dict(),
    )


@pytest.mark.parametrize("case", ["closure", "plain-backward", "bad-scaler-state", "bad-inner-state", "no-key"])
def test_misuse_is_a_clear_error_with_nothing_changed(case):
    model, optimizer = make(max_norm=0.5)
    optimizer.backward_and_step(loss_of(model, 0))  # some state to protect
    optimizer.zero_grad()
    if case == "plain-backward":
        loss_of(model, 1).backward()
    else:
        optimizer.scaled_backward(loss_of(model, 1))
    before = snapshot(model, optimizer)
    good = optimizer.state_dict()
    with pytest.raises((RuntimeError, ValueError, KeyError, TypeError)) as raised:
        if case == "closure":
            optimizer.step(lambda: loss_of(model, 1))
        elif case == "plain-backward":
            optimizer.step()
        elif case == "bad-scaler-state":
            optimizer.load_state_dict({**good, "loss_scaler": {**good["loss_scaler"], "scale": -1.0}})
        elif case == "bad-inner-state":
            optimizer.load_state_dict({**good, "param_groups": good["param_groups"] * 2})
        else:
            optimizer.load_state_dict(optimizer.optimizer.state_dict())
    expected = {
        "closure": "takes no closure",
        "plain-backward": "without scaled_backward",
        "bad-scaler-state": "scale",
        "bad-inner-state": "parameter groups",
        "no-key": "loss_scaler",
    }[case]
    assert expected in str(raised.value)
    assert same_bits(snapshot(model, optimizer), before)


def test_constructor_checks():
    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        LossScaleOptimizer(model)
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        LossScaleOptimizer(LossScaleOptimizer(inner))
    with pytest.raises(ValueError, match="either policy= or scaler="):
        LossScaleOptimizer(inner, LossScalePolicy(), scaler=tritonscale.GradScaler("cpu"))
    with pytest.raises(ValueError, match="max_norm"):
        LossScaleOptimizer(inner, max_norm=-1.0)
    with pytest.raises(TypeError, match="minimize"):
        LossScaleOptimizer(inner).minimize(torch.ones(()))


def test_init_scale_passed_overrides_the_presets_even_at_torchs_value():
    """Oracles: Keras 3's initial scale (2**15, ``presets.keras()``) and torch's default (2**16)."""
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert LossScaleOptimizer(inner, "keras").scaler.get_scale() == tritonscale.presets.keras().init_scale == 2.0**15
    assert LossScaleOptimizer(inner, "keras", init_scale=2.0**16).scaler.get_scale() == 2.0**16
    assert LossScaleOptimizer(inner).scaler.get_scale() == 2.0**16
    ours = inspect.signature(LossScaleOptimizer).parameters
    torchs = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
    assert type(ours["init_scale"].default) is float and ours["init_scale"].default == torchs
    assert "passed" not in ours


# ------------------------------------ which gradients a step uses (issue 28, item 6)
def fresh_grads_snapshot(model, optimizer):
    """snapshot() plus the pending flag, for the steps that may leave gradients None."""
    return (*snapshot(model, optimizer), optimizer._backward_since_step)


def test_minimize_steps_on_fresh_gradients_as_keras_does(backend):
    # Keras's minimize computes this loss's gradients only: from v = 5 with SGD(lr=2), each
    # minimize(lambda: v.sum()) subtracts lr * 1 (torch's SGD rule p - lr * g, g fresh).
    v = torch.nn.Parameter(torch.tensor([5.0]))
    optimizer = LossScaleOptimizer(torch.optim.SGD([v], lr=2.0), backend=backend)
    expected = v.detach().clone()
    for _ in range(3):
        optimizer.minimize(lambda: v.sum())
        expected = expected - 2.0 * torch.ones_like(expected)
        assert same_bits(bits(v.detach()), bits(expected))


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "sgd-momentum"])
def test_minimize_equals_a_plain_torch_loop_with_zero_grad(backend, momentum):
    # The oracle: torch's own loop, zero_grad() before each backward; no scaling at all (every
    # scale here is a power of two and no step overflows, so the unscaled gradients are exact).
    model, _ = make(backend=backend)
    twin = copy.deepcopy(model)
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), backend=backend)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=momentum)
    for step in range(4):
        optimizer.minimize(lambda step=step: loss_of(model, step))
        twin_opt.zero_grad()
        loss_of(twin, step).backward()
        twin_opt.step()
        assert same_bits([bits(p) for p in model.parameters()], [bits(p) for p in twin.parameters()]), step


class GradScalerLoop:
    """The oracle for minimize on make(True, backend, max_norm=0.5): the same model and fused AdamW
    driven through tritonscale.GradScaler by hand, zero_grad() before each backward."""

    def __init__(self, backend: str):
        self.model, _ = make(True, backend)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, fused=True)
        self.scaler = tritonscale.GradScaler("cpu", backend=backend)

    def step(self, step: int, poison: bool = False) -> None:
        self.optimizer.zero_grad()
        self.scaler.scale(loss_of(self.model, step, poison)).backward()
        self.scaler.clip_grad_norm_(self.optimizer, 0.5)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def agrees_with(self, model, optimizer) -> bool:
        ours = [bits(p) for p in model.parameters()], [bits(p.grad) for p in model.parameters()]
        theirs = [bits(p) for p in self.model.parameters()], [bits(p.grad) for p in self.model.parameters()]
        return same_bits(ours, theirs) and optimizer.loss_scale == self.scaler.get_scale()


def test_minimize_with_a_fused_inner_equals_the_gradscaler_loop_with_zero_grad(backend):
    # The fold path leaves the gradients scaled after the step; a poisoned step leaves inf in them.
    # Neither may reach the next minimize.
    model, optimizer = make(True, backend, max_norm=0.5)
    oracle = GradScalerLoop(backend)
    for step in range(5):
        poison = step == 2
        optimizer.minimize(lambda step=step, poison=poison: loss_of(model, step, poison))
        oracle.step(step, poison)
        assert optimizer.last_step_applied() is not poison, step
        assert oracle.agrees_with(model, optimizer), step


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_backward_and_step_accumulates_as_torch_gradscaler_loop_does(fused):
    # Kept on purpose: backward_and_step is torch's scale/backward/step/update in one call, and
    # accumulates into .grad as that loop does (a scaled_backward before it is a micro-batch of the
    # same step; without zero_grad the leftover gradients are added). The oracle is torch's own loop
    # with the same calls: it mixes scales alike.
    model, optimizer = make(fused)
    twin, _ = make(fused)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    optimizer.scaled_backward(loss_of(model, 0))
    scaler.scale(loss_of(twin, 0)).backward()
    for step in range(1, 4):  # no zero_grad anywhere
        optimizer.backward_and_step(loss_of(model, step))
        scaler.scale(loss_of(twin, step)).backward()
        scaler.step(twin_opt)
        scaler.update()
        assert optimizer.loss_scale == scaler.get_scale(), step
        assert same_bits([bits(p.grad) for p in model.parameters()], [bits(p.grad) for p in twin.parameters()])
        assert same_bits([bits(p) for p in model.parameters()], [bits(p) for p in twin.parameters()]), step


@pytest.mark.parametrize("then", ["step", "zero_grad"])
def test_minimize_with_a_scaled_backward_pending_is_an_error_with_nothing_changed(backend, then):
    model, optimizer = make(True, backend, max_norm=0.5)
    twin, twin_optimizer = make(True, backend, max_norm=0.5)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.minimize(lambda m=m: loss_of(m, 0))  # some state, and gradients left in .grad
        o.scaled_backward(loss_of(m, 1))  # a split-form step begun
    before = fresh_grads_snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match="scaled_backward.*pending") as raised:
        optimizer.minimize(lambda: loss_of(model, 2))
    assert "step()" in str(raised.value) and "zero_grad()" in str(raised.value)
    assert same_bits(fresh_grads_snapshot(model, optimizer), before)
    # What the error says works: the twin never called minimize while the step was pending.
    for o in (optimizer, twin_optimizer):
        getattr(o, then)()
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.minimize(lambda m=m: loss_of(m, 2))
    assert same_bits(fresh_grads_snapshot(model, optimizer), fresh_grads_snapshot(twin, twin_optimizer))


def _raising_hook(grad):
    raise ValueError("a backward hook raised")


@pytest.mark.parametrize("where", ["loss_fn", "backward-start", "backward-midway"])
def test_minimize_that_raises_changes_nothing_and_the_next_is_fresh(backend, where):
    # The gradients are cleared only once loss_fn() has returned, and given back if the backward
    # raises (midway: the last layer's gradients were already written when the hook raised).
    model, optimizer = make(True, backend, max_norm=0.5)
    oracle = GradScalerLoop(backend)
    optimizer.minimize(lambda: loss_of(model, 0))  # leftover (still scaled) gradients to protect
    oracle.step(0)

    def failing():
        if where == "loss_fn":
            raise ValueError("loss_fn raised")
        if where == "backward-start":
            return loss_of(model, 1).detach()  # backward(): "does not require grad"
        x, y = batch(1)
        hidden = model[0](x)
        hidden.register_hook(_raising_hook)
        return torch.nn.functional.mse_loss(model[2](model[1](hidden)), y)

    before = fresh_grads_snapshot(model, optimizer)
    with pytest.raises((ValueError, RuntimeError)):
        optimizer.minimize(failing)
    assert same_bits(fresh_grads_snapshot(model, optimizer), before)
    optimizer.minimize(lambda: loss_of(model, 2))  # then steps on its own loss only
    oracle.step(2)
    assert oracle.agrees_with(model, optimizer)
