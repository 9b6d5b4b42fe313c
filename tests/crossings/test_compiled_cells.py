"""Compiled cells: ``clip_grad_norm_`` and ``update()`` compiled whole (``backend="aot_eager"``,
``fullgraph=True``), wherever the scaler lives, against the same steps eager, bit for bit.

Rows are the compiled call (``clip_grad_norm_`` or ``update()``, the other one eager) and where
the scaler lives (a module global, an ``nn.Module`` attribute, a closure); columns are how it is
compiled (Dynamo's default, or ``dynamic=True``) and the backend. ``max_norm``
changes at every call (an LR-style clip schedule), the scale grows and backs off, and after
WARM steps ``torch._dynamo.config.error_on_recompile`` is on: a guard on anything that changes
per step (the max_norm, the scale, an iteration counter) fails the cell. aot_eager runs the eager
ops, so norms, parameters and stats() must be eager's bits.
"""

from __future__ import annotations

import math

import pytest
import torch

import tritonscale

STEPS = 8
WARM = 3  # calls before which a recompilation is allowed
OVERFLOW = 4
MAX_NORMS = (0.5, 1.0, 0.25, 2.0)

# The module-global holder's scaler and optimizer: the compiled functions read these names.
scaler: tritonscale.GradScaler | None = None
optimizer: torch.optim.Optimizer | None = None


def clip_global(max_norm: float) -> torch.Tensor:
    return scaler.clip_grad_norm_(optimizer, max_norm)


def update_global() -> None:
    scaler.update()


class Trainer(torch.nn.Module):
    """The scaler as an attribute of a module whose methods are compiled."""

    def __init__(self, grad_scaler: tritonscale.GradScaler, opt: torch.optim.Optimizer) -> None:
        super().__init__()
        self.grad_scaler, self.opt = grad_scaler, opt

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.grad_scaler.clip_grad_norm_(self.opt, max_norm)

    def update(self) -> None:
        self.grad_scaler.update()


def module_global(grad_scaler, opt):
    global scaler, optimizer
    scaler, optimizer = grad_scaler, opt
    return clip_global, update_global


def module_attribute(grad_scaler, opt):
    trainer = Trainer(grad_scaler, opt)
    return trainer.clip, trainer.update


def closure(grad_scaler, opt):
    return (lambda max_norm: grad_scaler.clip_grad_norm_(opt, max_norm)), (lambda: grad_scaler.update())


HOLDERS = {"module_global": module_global, "module_attribute": module_attribute, "closure": closure}
MODES = {"default": {}, "dynamic": {"dynamic": True}}
CALLS = ("clip_grad_norm_", "update")
CELLS = [(call, holder, mode, "torch") for call in CALLS for holder in HOLDERS for mode in MODES]
CELLS += [("clip_grad_norm_", "closure", mode, "triton") for mode in MODES]  # the kernels as custom ops


def training_run(call: str, holder: str, backend: str, compile_kwargs: dict | None) -> dict:
    """STEPS steps of a tiny model; ``call`` compiled when ``compile_kwargs`` is given."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)
    clip, update = HOLDERS[holder](grad_scaler, opt)
    if compile_kwargs is not None and call == "clip_grad_norm_":
        clip = torch.compile(clip, backend="aot_eager", fullgraph=True, **compile_kwargs)
    if compile_kwargs is not None and call == "update":
        update = torch.compile(update, backend="aot_eager", fullgraph=True, **compile_kwargs)
    g = torch.Generator().manual_seed(1)
    run = {"norms": [], "stats": []}
    for step in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        x[0, 0] = math.inf if step == OVERFLOW else x[0, 0]
        grad_scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        with torch._dynamo.config.patch(error_on_recompile=compile_kwargs is not None and step >= WARM):
            run["norms"].append(clip(MAX_NORMS[step % len(MAX_NORMS)]).clone())
            grad_scaler.step(opt)
            update()
        run["stats"].append({name: value.clone() for name, value in grad_scaler.stats().items()})
    run["params"] = [p.detach().clone() for p in model.parameters()]
    return run


@pytest.mark.parametrize("call, holder, mode, backend", CELLS, ids=["-".join(cell) for cell in CELLS])
def test_compiled_cell(call, holder, mode, backend):
    compiled = training_run(call, holder, backend, MODES[mode])
    eager = training_run(call, holder, backend, None)
    assert [int(s["skipped"]) for s in eager["stats"]].count(1) == 1, "the run must skip its overflow step"
    for step, (ours, reference) in enumerate(zip(compiled["norms"], eager["norms"])):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, equal_nan=True, msg=f"norm of step {step}")
    for step, (ours, reference) in enumerate(zip(compiled["stats"], eager["stats"])):
        for name in reference:
            torch.testing.assert_close(
                ours[name], reference[name], rtol=0, atol=0, equal_nan=True, msg=f"stats()[{name!r}] of step {step}"
            )
    for ours, reference in zip(compiled["params"], eager["params"]):
        assert torch.equal(ours, reference)
