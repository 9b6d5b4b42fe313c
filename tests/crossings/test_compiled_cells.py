"""Compiled cells: ``clip_grad_norm_`` and ``update()`` compiled whole (``backend="aot_eager"``,
``fullgraph=True``), wherever the scaler lives, against the same steps eager, bit for bit.

Rows are the compiled call (``clip_grad_norm_`` or ``update()``, the other one eager) and where
the scaler lives (a module global, an ``nn.Module`` attribute, a closure); columns are how it is
compiled (Dynamo's default, or ``dynamic=True``) and the backend. ``max_norm``
changes at every call (an LR-style clip schedule), the scale grows and backs off, and after
WARM steps ``torch._dynamo.config.error_on_recompile`` is on: a guard on anything that changes
per step (the max_norm, the scale, an iteration counter) fails the cell. aot_eager runs the eager
ops, so norms, parameters and stats() must be eager's bits.

The policy rows (``VARIANTS``) compile the clip under the norm rules, a spike planted at SPIKE:
ZClip's adaptive clip (its max_norm from the norm, on the device) with ``max_norm`` a changing
float and a tensor, OLMo-core's z-score skip, and ZClip folded into a fused optimizer's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import tritonscale
from tritonscale.torch_compat import COMPILED_CLIP, has_torch

STEPS = 8
WARM = 3  # calls before which a recompilation is allowed
OVERFLOW = 4
SPIKE = 6  # the policy rows' planted spike: the inputs 50 times larger (a norm ~1000 times the others)
MAX_NORMS = (0.5, 1.0, 0.25, 2.0)


@dataclass(frozen=True)
class Variant:
    """A policy row: the scaler's knobs, the optimizer, ``max_norm`` (``MAX_NORMS`` times
    ``max_norm_times``, a float or a 0-dim tensor), and what the eager run must show at SPIKE."""

    knobs: dict = field(default_factory=dict)
    optimizer: str = "sgd"
    max_norm_times: float = 1.0
    tensor_max_norm: bool = False
    spike: str | None = None  # "skipped" or "clipped adaptively": the rule acted (not a vacuous cell)


ZCLIP = {"clip_norm_z": 2.5, "clip_norm_warmup_steps": 2}
VARIANTS = {
    "plain": Variant(),
    # max_norm 25-200: the adaptive clip's limit (about the norms' mean) is below it at the spike.
    "zclip": Variant(ZCLIP, max_norm_times=100.0, spike="clipped adaptively"),
    "zclip_tensor_max_norm": Variant(ZCLIP, max_norm_times=100.0, tensor_max_norm=True, spike="clipped adaptively"),
    "zscore_skip": Variant({"skip_norm_sigma": 3.0, "skip_norm_window": 4}, spike="skipped"),
    "zclip_fused_fold": Variant(ZCLIP, optimizer="fused_adamw", max_norm_times=100.0, spike="clipped adaptively"),
}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "fused_adamw": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),  # the clip folds into its step
}

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
CELLS = [(call, holder, mode, "torch", "plain") for call in CALLS for holder in HOLDERS for mode in MODES]
CELLS += [("clip_grad_norm_", "closure", mode, "triton", "plain") for mode in MODES]  # the kernels as custom ops
CELLS += [("clip_grad_norm_", "closure", "default", "torch", name) for name in VARIANTS if name != "plain"]


def max_norm_of(variant: Variant, step: int) -> float | torch.Tensor:
    max_norm = MAX_NORMS[step % len(MAX_NORMS)] * variant.max_norm_times
    return torch.tensor(max_norm) if variant.tensor_max_norm else max_norm


def training_run(call: str, holder: str, backend: str, compile_kwargs: dict | None, variant: Variant) -> dict:
    """STEPS steps of a tiny model; ``call`` compiled when ``compile_kwargs`` is given."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = OPTIMIZERS[variant.optimizer](model.parameters())
    grad_scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend, **variant.knobs)
    clip, update = HOLDERS[holder](grad_scaler, opt)
    if compile_kwargs is not None and call == "clip_grad_norm_":
        clip = torch.compile(clip, backend="aot_eager", fullgraph=True, **compile_kwargs)
    if compile_kwargs is not None and call == "update":
        update = torch.compile(update, backend="aot_eager", fullgraph=True, **compile_kwargs)
    g = torch.Generator().manual_seed(1)
    run = {"norms": [], "stats": [], "applied": []}
    for step in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        x[0, 0] = math.inf if step == OVERFLOW else x[0, 0]
        x = x * 50.0 if variant.spike is not None and step == SPIKE else x
        grad_scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with torch._dynamo.config.patch(error_on_recompile=compile_kwargs is not None and step >= WARM):
            run["norms"].append(clip(max_norm_of(variant, step)).clone())
            grad_scaler.step(opt)
            update()
        run["stats"].append({name: value.clone() for name, value in grad_scaler.stats().items()})
        run["applied"].append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    run["params"] = [p.detach().clone() for p in model.parameters()]
    return run


def assert_rule_acted(run: dict, variant: Variant) -> None:
    """The eager run shows the rule at work: its overflow skipped, and at SPIKE the planted spike
    skipped (the z-score rule) or its SGD step clipped below max_norm (ZClip: lr * max_norm
    bounds the step of a clip by max_norm itself)."""
    skipped = [i for i, s in enumerate(run["stats"]) if int(s["skipped"])]
    assert OVERFLOW in skipped and (SPIKE in skipped) == (variant.spike == "skipped"), skipped
    assert len(skipped) == 1 or variant.spike == "skipped", "the run must skip its overflow step alone"
    if variant.spike == "clipped adaptively" and variant.optimizer == "sgd":
        bound = 0.1 * float(max_norm_of(variant, SPIKE))  # SGD's step: lr times the clipped gradient
        assert float(torch.linalg.vector_norm(run["applied"][SPIKE])) < bound / 4


@pytest.mark.parametrize("call, holder, mode, backend, variant", CELLS, ids=["-".join(cell) for cell in CELLS])
def test_compiled_cell(call, holder, mode, backend, variant):
    if call == "clip_grad_norm_" and not has_torch(COMPILED_CLIP):
        pytest.skip("a compiled clip_grad_norm_ needs torch>=2.12 (refused before it: tests/test_torch_compat.py)")
    compiled = training_run(call, holder, backend, MODES[mode], VARIANTS[variant])
    eager = training_run(call, holder, backend, None, VARIANTS[variant])
    assert_rule_acted(eager, VARIANTS[variant])
    for step, (ours, reference) in enumerate(zip(compiled["norms"], eager["norms"])):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, equal_nan=True, msg=f"norm of step {step}")
    for step, (ours, reference) in enumerate(zip(compiled["stats"], eager["stats"])):
        for name in reference:
            torch.testing.assert_close(
                ours[name], reference[name], rtol=0, atol=0, equal_nan=True, msg=f"stats()[{name!r}] of step {step}"
            )
    for ours, reference in zip(compiled["params"], eager["params"]):
        assert torch.equal(ours, reference)
    for step, (ours, reference) in enumerate(zip(compiled["applied"], eager["applied"])):
        assert torch.equal(ours, reference), f"the update of step {step}"
