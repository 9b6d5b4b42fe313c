"""The direct-step guard (``scaler/step_protocols.py``): a fused optimizer whose clip was folded into its
step, and any optimizer stepped directly after its unscale_ or clip with no update() between.

After ``scaler.clip_grad_norm_(opt)`` with a fused optimizer the gradients still hold the loss
scale: only ``scaler.step(opt)`` hands the optimizer ``scale / clip_coef`` to divide by. A direct
``opt.step()`` would apply them ``scale`` times too large, so it raises and changes nothing. Oracles:
a twin run that never tried the direct step (bitwise), a deepcopy of model and optimizer that has no
guard (bitwise), and torch's unscale_ + clip_grad_norm_ for the gradients the fold leaves.

Any other optimizer's direct step goes ahead, as torch's does after unscale_; without an update()
after it, the next iteration's clip (or unscale_) is refused as torch's second unscale_ is, naming
the fix. Oracle: torch's GradScaler running the same loop.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from support.compiled_placements import needs_compiled_clip
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


# ------------------------------------------------- a direct step on any optimizer, then no update()
class GradScalerArgumentSGD(torch.optim.SGD):
    """An optimizer on the older protocol (apex, TransformerEngine): ``step(grad_scaler=...)``."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        return super().step(closure)


DIRECT_KINDS = {  # (the optimizer, the scaler's arguments, whether the object stepped is a wrapper)
    "plain": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, False),
    "foreach": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True), {}, False),
    "fused_unfolded": (FUSED["adamw"], {"fold_into_optimizer": False}, False),
    "grad_scaler_argument": (lambda ps: GradScalerArgumentSGD(ps, lr=0.1), {}, False),
    "wrapper": (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, True),
}
#: torch's refusal word for word, which ours must begin with.
UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."


def _direct_iteration(model, optimizer, steps, scaler, step, first, ours):
    """One iteration of the issue's loop: backward, the unscale (ours: ``first``, clip_grad_norm_ or
    unscale_ + clip; torch's: unscale_ + clip), a direct ``steps.step()`` (the optimizer or its
    wrapper); no update()."""
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    if not ours or first == "unscale_":
        scaler.unscale_(steps)
    if ours:
        scaler.clip_grad_norm_(steps, 100.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
    steps.step()


@pytest.mark.parametrize("first", ["clip_grad_norm_", "unscale_"])
@pytest.mark.parametrize("kind", list(DIRECT_KINDS))
def test_a_direct_step_without_update_is_refused_where_torch_refuses(backend, kind, first):
    """The issue's loop (clip, then ``optimizer.step()`` directly, never scaler.step/update) on
    every optimizer kind but a folded one (whose direct step is refused at once, above): the first
    iteration steps as torch's does, bit for bit (max_norm 100 clips nothing); at the second,
    torch's unscale_ raises, and so does ours (the clip, or unscale_), with torch's type and
    message, naming scaler.step and scaler.update, changing nothing. The fix then works: update()
    ends the stale iteration, and the next one through the scaler is torch's, bit for bit."""
    factory, kwargs, wrapped = DIRECT_KINDS[kind]
    sides = {}
    for ours in (True, False):
        model, optimizer = make(factory=factory)
        steps = Wrapper(optimizer) if wrapped and ours else optimizer  # torch's scaler takes no wrapper
        scaler = GradScaler("cpu", backend=backend, **kwargs) if ours else torch.amp.GradScaler("cpu")
        _direct_iteration(model, optimizer, steps, scaler, 0, first, ours)
        sides[ours] = (model, optimizer, steps, scaler)
    assert same_bits(param_bits(sides[True][0]), param_bits(sides[False][0]))
    for ours, (model, optimizer, _, scaler) in sides.items():
        optimizer.zero_grad()
        scaler.scale(loss_of(model, 1)).backward()
        if not ours:
            with pytest.raises(RuntimeError) as torch_error:
                scaler.unscale_(optimizer)
            assert str(torch_error.value) == UNSCALED_TWICE
            continue
        before = Snapshot.take(list(model.parameters()), [optimizer], scaler)
        with pytest.raises(RuntimeError) as ours_error:
            scaler.clip_grad_norm_(optimizer, 100.0) if first == "clip_grad_norm_" else scaler.unscale_(optimizer)
        Snapshot.take(list(model.parameters()), [optimizer], scaler).assert_same(before)
        message = str(ours_error.value)
        assert message.startswith(UNSCALED_TWICE), message
        assert "scaler.step(optimizer)" in message and "scaler.update()" in message, message
    for ours, (model, optimizer, steps, scaler) in sides.items():  # the fix
        scaler.update()
        if ours:
            scaler.clip_grad_norm_(steps, 100.0)
        else:
            scaler.unscale_(steps)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        scaler.step(steps)
        scaler.update()
    assert same_bits(param_bits(sides[True][0]), param_bits(sides[False][0]))
    assert sides[True][3].get_scale() == sides[False][3].get_scale()


@pytest.mark.parametrize("kind", list(DIRECT_KINDS))
def test_a_direct_step_then_update_is_torchs_loop_and_nothing_is_refused(kind):
    """clip, a direct ``optimizer.step()``, then ``scaler.update()`` (torch allows it) and a second
    clip in one iteration are not refused: bit for bit torch's run."""
    factory, kwargs, wrapped = DIRECT_KINDS[kind]
    runs = []
    for ours in (True, False):
        model, optimizer = make(factory=factory)
        steps = Wrapper(optimizer) if wrapped and ours else optimizer  # torch's scaler takes no wrapper
        scaler = GradScaler("cpu", **kwargs) if ours else torch.amp.GradScaler("cpu")
        for step in range(3):
            _direct_iteration(model, optimizer, steps, scaler, step, "clip_grad_norm_", ours)
            scaler.update()
        optimizer.zero_grad()
        scaler.scale(loss_of(model, 3)).backward()
        for _ in range(2):
            scaler.clip_grad_norm_(optimizer, 100.0) if ours else torch_clip(scaler, optimizer, 100.0)
        scaler.step(optimizer)
        scaler.update()
        runs.append((param_bits(model), scaler.get_scale()))
    assert same_bits(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_the_refusal_reads_nothing_on_the_gpu_paths(forbid_host_reads):
    """The direct step is noted and the clip refused on the host's bookkeeping alone."""
    model, optimizer = make(factory=DIRECT_KINDS["plain"][0])
    scaler = GradScaler("cpu", backend="triton")
    with forbid_host_reads.armed():
        scaler.scale(loss_of(model, 0)).backward()
        scaler.clip_grad_norm_(optimizer, 100.0)
        optimizer.step()
        optimizer.zero_grad()
        scaler.scale(loss_of(model, 1)).backward()
        with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called .* scaler\.update\(\)"):
            scaler.clip_grad_norm_(optimizer, 100.0)
