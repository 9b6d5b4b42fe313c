"""The guard on a fused optimizer whose clip was folded into its step (``passes/step_protocols.py``).

After ``scaler.clip_grad_norm_(opt)`` with a fused optimizer the gradients still hold the loss
scale: only ``scaler.step(opt)`` hands the optimizer ``scale / clip_coef`` to divide by. A direct
``opt.step()`` would apply them ``scale`` times too large, so it raises and changes nothing. Oracles:
a twin run that never tried the direct step (bitwise), a deepcopy of model and optimizer that has no
guard (bitwise), and torch's unscale_ + clip_grad_norm_ for the gradients the fold leaves.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from compiled_placements import needs_compiled_clip
from oracles.scaler_twins import COPIES as WHOLE_COPIES
from oracles.scaler_twins import Snapshot, bits, same_bits, torch_clip
from torch._dynamo.testing import CompileCounterWithBackend

from tritonscale import GradScaler

FUSED = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
DIRECT = r"step\(\) called directly .* scaler\.step\(optimizer\)"


class Wrapper:
    """A framework's optimizer wrapper (Accelerate's, Fabric's): the real one in ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, *args, **kwargs):
        return self.optimizer.step(*args, **kwargs)


class WholeStateSGD(torch.optim.SGD):
    """An optimizer whose copies and pickles keep every attribute, its step hooks included (torch's
    own ``__getstate__`` drops them)."""

    def __getstate__(self):
        return dict(self.__dict__)


def make(name="sgd", seed=0, factory=None):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, (factory or FUSED[name])(model.parameters())


def loss_of(model, step):
    g = torch.Generator().manual_seed(50 + step)
    return model(torch.randn(4, 6, generator=g)).square().mean()


def iteration(model, optimizer, scaler, step, clips=1, steps=None):
    """One scaled iteration; ``steps``: the object scaler.step gets (the optimizer by default)."""
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    for _ in range(clips):
        scaler.clip_grad_norm_(optimizer, 0.1)
    scaler.step(steps if steps is not None else optimizer)
    scaler.update()


def param_bits(model):
    return [bits(p) for p in model.parameters()]


@pytest.mark.parametrize("clips", [1, 2], ids=["one-clip", "two-clips"])
@pytest.mark.parametrize("via", ["optimizer", "scheduler", "wrapper"])
@pytest.mark.parametrize("name", list(FUSED))
def test_direct_step_after_a_folded_clip_raises_changing_nothing(backend, name, via, clips):
    """The direct step raises (through an LR scheduler's wrapper of ``step`` and a framework's
    wrapper too) and leaves everything as it was: scaler.step then continues bitwise like the twin
    run that never tried it."""
    runs = []
    for tries in (True, False):
        model, optimizer = make(name)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if via == "scheduler" else None
        steps = Wrapper(optimizer) if via == "wrapper" else optimizer
        scaler = GradScaler("cpu", init_scale=2.0**16, backend=backend)
        iteration(model, optimizer, scaler, 0)  # optimizer state to protect
        optimizer.zero_grad()
        scaler.scale(loss_of(model, 1)).backward()
        for _ in range(clips):
            scaler.clip_grad_norm_(optimizer, 0.1)
        if tries:
            before = Snapshot.take(list(model.parameters()), [optimizer], scaler)
            with pytest.raises(RuntimeError, match=DIRECT):
                steps.step()
            Snapshot.take(list(model.parameters()), [optimizer], scaler).assert_same(before)
        scaler.step(steps)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        iteration(model, optimizer, scaler, 2, clips, steps)
        runs.append(param_bits(model))
    assert same_bits(runs[0], runs[1])


@needs_compiled_clip
def test_a_compiled_clip_guards_from_its_first_call_without_recompiling():
    """The clip traced whole (fullgraph=True) installs the guard too, while Dynamo traces it: the
    direct step raises from the first iteration on, changing nothing, and the clip compiles once
    (a recompilation raises: error_on_recompile)."""
    torch._dynamo.reset()
    model, optimizer = make("adamw")
    scaler = GradScaler("cpu", backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    clip = torch.compile(lambda: scaler.clip_grad_norm_(optimizer, 0.1), backend=counter, fullgraph=True)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            clip()
        before = Snapshot.take(list(model.parameters()), [optimizer], scaler)
        with pytest.raises(RuntimeError, match=DIRECT):
            optimizer.step()
        Snapshot.take(list(model.parameters()), [optimizer], scaler).assert_same(before)
        scaler.step(optimizer)
        scaler.update()
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", list(FUSED))
def test_grads_over_folded_grad_scale_are_torchs_unscaled_clipped_grads(backend, name):
    """What p.grad holds after a folded clip: the scaled gradient; divided by
    ``scaler.folded_grad_scale(opt)`` it is torch's unscale_ + clip_grad_norm_ result."""
    model, optimizer = make(name)
    ref_model, ref_optimizer = make(name)
    ours, theirs = GradScaler("cpu", backend=backend), torch.amp.GradScaler("cpu")
    for m, s in ((model, ours), (ref_model, theirs)):
        s.scale(loss_of(m, 0)).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    assert ours.folded_grad_scale(optimizer) is None  # nothing folded yet
    ours.clip_grad_norm_(optimizer, 0.1)
    torch_clip(theirs, ref_optimizer, 0.1)
    folded = ours.folded_grad_scale(Wrapper(optimizer))
    for p, r, q in zip(model.parameters(), raw, ref_model.parameters()):
        assert same_bits(bits(p.grad), bits(r))  # still scaled: the fold writes no gradient
        torch.testing.assert_close(p.grad / folded, q.grad)
    ours.step(optimizer)  # the fused step divides, and writes the true gradients back
    assert ours.folded_grad_scale(optimizer) is None
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("ends", ["update", "abandon-optimizer", "abandon-all"])
def test_nothing_is_pending_after_update_or_abandon_iteration(ends):
    """Once the iteration ends (update) or is forgotten (abandon_iteration), a direct step is the
    user's plain step again: bitwise the step of a copy that never had the guard."""
    model, optimizer = make()
    scaler = GradScaler("cpu")
    scaler.scale(loss_of(model, 0)).backward()
    scaler.clip_grad_norm_(optimizer, 0.1)
    with pytest.raises(RuntimeError, match=DIRECT):
        optimizer.step()
    if ends == "update":
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        loss_of(model, 1).backward()  # a plain, unscaled step next
    else:
        scaler.abandon_iteration(optimizer if ends == "abandon-optimizer" else None)
    twin_model, twin_optimizer = copy.deepcopy((model, optimizer))  # (a deepcopy drops .grad)
    assert not twin_optimizer._optimizer_step_pre_hooks
    for p, q in zip(model.parameters(), twin_model.parameters()):
        q.grad = p.grad.clone()
    optimizer.step()
    twin_optimizer.step()
    assert same_bits(param_bits(model), param_bits(twin_model))


SETUPS = {  # the scaler's settings and the optimizer: only the first folds the clip (and guards)
    "folded": ({}, FUSED["sgd"]),
    "disabled": ({"enabled": False}, FUSED["sgd"]),
    "fold_into_optimizer=False": ({"fold_into_optimizer": False}, FUSED["sgd"]),
    "unfused": ({}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_only_a_folded_clip_guards_the_direct_step(setup):
    """The other clips write unscaled, clipped gradients: a direct step after them is left alone
    and is what scaler.step(opt) does in the twin run (bitwise)."""
    kwargs, factory = SETUPS[setup]
    runs = []
    for direct in (True, False):
        model, optimizer = make(factory=factory)
        scaler = GradScaler("cpu", **kwargs)
        scaler.scale(loss_of(model, 0)).backward()
        scaler.clip_grad_norm_(optimizer, 0.1)
        if direct and setup == "folded":
            with pytest.raises(RuntimeError, match=DIRECT):
                optimizer.step()
            return
        optimizer.step() if direct else scaler.step(optimizer)
        runs.append(param_bits(model))
    assert same_bits(runs[0], runs[1])


COPIES = {"copy": copy.copy, **WHOLE_COPIES}  # a shallow copy too


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("keeps_hooks", [False, True], ids=["torch-getstate", "whole-state"])
def test_copies_of_a_guarded_optimizer_do_not_carry_the_scaler(how, keeps_hooks):
    """A copy (even one that keeps its step hooks) steps freely and holds no reference to the
    scaler, which the guard holds weakly; the original stays guarded."""
    factory = (lambda ps: WholeStateSGD(ps, lr=0.1, fused=True)) if keeps_hooks else None
    model, optimizer = make(factory=factory)
    scaler = GradScaler("cpu")
    scaler.scale(loss_of(model, 0)).backward()
    scaler.clip_grad_norm_(optimizer, 0.1)
    copied = COPIES[how](optimizer)
    assert bool(copied._optimizer_step_pre_hooks) is keeps_hooks
    copied.step()  # no clip of the copy's: nothing pending
    with pytest.raises(RuntimeError, match=DIRECT):
        optimizer.step()
    scaler_ref = weakref.ref(scaler)
    del scaler
    gc.collect()
    assert scaler_ref() is None  # neither the guard nor a copy keeps the scaler alive
    optimizer.step()  # its scaler is gone: nothing pending
