"""The truth the integrations' skip signals are held to: whether the parameters moved.

Every framework test in this folder runs the same matrix (``SKIP_CASES``): a plain optimizer, a
fused one (which skips inside its kernel, so "did ``step`` run" says nothing), hysteresis (the
first overflow skips and keeps the scale, so "the scale went down" says nothing) and a norm-spike
skip (no overflow at all). ``GradInjector`` poisons chosen backward passes; ``Truth`` records,
per optimizer step, whether any parameter changed. A framework's own signal (Accelerate's
``optimizer_step_was_skipped``, a scheduler's step count, timm's ``num_updates``...) must equal it.

Example::

    injector = GradInjector(model.weight, "inf")
    truth = Truth(model)
    for step in range(STEPS):
        truth.before()
        ...one training step of the framework...
        truth.after()
    assert truth.skipped == [s in INJECTED for s in range(STEPS)]
"""

from __future__ import annotations

import torch

import tritonscale

STEPS = 8
INJECTED = (2, 5)  # the 0-based backward passes whose gradient is poisoned
SKIP_CASES = ("sgd", "fused_adamw", "hysteresis", "norm_spike")
SPIKE_FACTOR = 1e6  # a norm spike: one gradient times this (finite in float32 at the scales used)
SPIKE_NORM = 1e4  # skip_norm_above for the norm_spike case: far above every unspiked norm here


def make_optimizer(case: str, params) -> torch.optim.Optimizer:
    """SGD for every case but ``fused_adamw`` (torch's fused AdamW, which folds the skip in its kernel)."""
    if case == "fused_adamw":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=0.1)


def scaler_kwargs(case: str) -> dict:
    """The tritonscale.GradScaler arguments of a case (init_scale small enough for float16 on CPU)."""
    kwargs = {"init_scale": 2.0**10, "growth_interval": 3}
    if case == "hysteresis":
        kwargs["policy"] = tritonscale.LossScalePolicy(hysteresis=2, growth_interval=3)
        del kwargs["growth_interval"]
    if case == "norm_spike":
        kwargs["policy"] = tritonscale.LossScalePolicy(skip_norm_above=SPIKE_NORM, growth_interval=3)
        del kwargs["growth_interval"]
    return kwargs


def injected_kind(case: str) -> str:
    return "spike" if case == "norm_spike" else "inf"


class GradInjector:
    """Poisons ``param``'s gradient on the backward passes in ``at`` (counted from 0): ``"inf"``
    writes inf into one element, ``"spike"`` multiplies the gradient by SPIKE_FACTOR."""

    def __init__(self, param: torch.Tensor, kind: str, at: tuple[int, ...] = INJECTED) -> None:
        self.calls, self.kind, self.at = 0, kind, at
        self.handle = param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call not in self.at:
            return grad
        if self.kind == "spike":
            return grad * SPIKE_FACTOR
        poisoned = grad.clone()
        poisoned.view(-1)[0] = float("inf")
        return poisoned


class Truth:
    """Per optimizer step: did any parameter of ``module`` change (the step was applied)?"""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.skipped: list[bool] = []
        self._before: list[torch.Tensor] | None = None

    def before(self) -> None:
        self._before = [p.detach().clone() for p in self.params]

    def after(self) -> None:
        moved = any(not torch.equal(b, p.detach()) for b, p in zip(self._before, self.params))
        self.skipped.append(not moved)


def lrs_on_applied_steps(skipped: list[bool], read_lr, advance) -> list[float]:
    """The scheduler oracle (Megatron's rule): the learning rate each step used, and the one after the
    last, when the schedule is stepped on the host only on the applied steps of ``skipped``.

    ``read_lr()`` gives the schedule's current rate and ``advance()`` steps it (a fresh scheduler of
    the same kind as the framework's, on a dummy optimizer). Example::

        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (1 + n))
        expected = lrs_on_applied_steps(truth.skipped, lambda: opt.param_groups[0]["lr"], sched.step)
    """
    lrs = []
    for step_skipped in skipped:
        lrs.append(read_lr())
        if not step_skipped:
            advance()
    return lrs + [read_lr()]
