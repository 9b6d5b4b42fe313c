"""One scaled training step cut at its phases, for the benchmarks that measure a phase at a time.

``bench/launch_cost.py`` (host instructions under callgrind), ``bench/gpu_phases.py`` (host time and
launches per phase, the GPU check's) and ``bench/host_time.py`` (host time on the CPU's GPU paths)
measure the same step: one scaler on its own parameters (``tensors`` of ``each`` float32 elements),
fused AdamW, a loss that is a sum over the parameters, then ``scale``, the clip (ours
``clip_grad_norm_``; torch's ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``), ``step``,
``update`` and, with an LR schedule, ``lr`` (ours ``SkipAwareLR.step``; torch's ``LambdaLR.step``).
Each phase's call goes through ``around(phase, call)``, which the benchmark makes time, count or
mark it. Imports torch and tritonscale when built, not at import: ``launch_cost``'s worker must set
up Triton's driver first.

Example::

    setup = PhaseStep("ours", 1, 1024, {"hysteresis": 2}, total_steps=100)
    setup.step(lambda phase, call: call())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Every phase, in the order a step runs them; ``lr`` only with an LR schedule.
PHASES = ("scale", "clip", "step", "update", "lr")
MAX_NORM = 1.0
#: Both scalers' settings: a scale that does not overflow these losses, and no growth in a run.
SCALER_KW = {"init_scale": 2.0**16, "growth_interval": 2000}


class PhaseStep:
    """One scaler on its own parameters, AdamW(fused=True), and optionally an LR schedule.

    Args:
        variant: ``"torch"`` for ``torch.amp.GradScaler``; any other name for
            ``tritonscale.GradScaler``.
        tensors: how many parameters.
        each: elements per parameter (float32).
        knobs: the tritonscale scaler's policy knobs (``hysteresis=2``, ...); unused for torch.
        device: where the parameters and the scaler live ("cpu" by default).
        backend: the tritonscale scaler's backend ("triton" by default).
        compile_policy: the tritonscale scaler's ``compile_policy`` (None: its default).
        total_steps: with a number, an LR schedule (``LambdaLR``; ours under ``SkipAwareLR`` with
            this ``total_steps``) and a tensor lr; None: neither, a float lr, no ``lr`` phase.
    """

    def __init__(
        self,
        variant: str,
        tensors: int,
        each: int,
        knobs: dict | None = None,
        *,
        device: Any = "cpu",
        backend: str = "triton",
        compile_policy: bool | None = None,
        total_steps: int | None = None,
    ) -> None:
        import torch

        import tritonscale

        torch.manual_seed(0)
        self.variant, self.device = variant, torch.device(device)
        self.params = [torch.nn.Parameter(torch.randn(each, device=self.device)) for _ in range(tensors)]
        self.inputs = [torch.randn(each, device=self.device) for _ in range(tensors)]
        lr = torch.tensor(1e-3, device=self.device) if total_steps is not None else 1e-3
        self.opt = torch.optim.AdamW(self.params, lr=lr, fused=True)
        if variant == "torch":
            self.scaler = torch.amp.GradScaler(self.device.type, **SCALER_KW)
        else:
            self.scaler = tritonscale.GradScaler(self.device.type, backend=backend, compile_policy=compile_policy,
                                                 **SCALER_KW, **(knobs or {}))  # fmt: skip
        self.schedule = None
        if total_steps is not None:
            schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: 1.0 / (1 + k))
            ours = variant != "torch"
            self.schedule = tritonscale.SkipAwareLR(schedule, self.scaler, total_steps=total_steps) if ours else schedule
        #: The phases this step runs, in order.
        self.phases = PHASES if self.schedule is not None else PHASES[:-1]
        self.calls: dict[str, Callable[[], Any]] = {
            "clip": self.clip, "step": lambda: self.scaler.step(self.opt), "update": self.scaler.update,
        }  # fmt: skip
        if self.schedule is not None:
            self.calls["lr"] = self.schedule.step

    def clip(self) -> None:
        """The clip phase: ours fused, torch's ``unscale_`` then ``clip_grad_norm_``."""
        if self.variant == "torch":
            import torch

            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        else:
            self.scaler.clip_grad_norm_(self.opt, MAX_NORM)

    def step(self, around: Callable[[str, Callable[[], Any]], Any]) -> None:
        """One whole step; ``around(phase, call)`` makes each phase's call and returns its result.

        Args:
            around: called once per phase, in ``self.phases``' order, with the phase's name and a
                function of no arguments that runs it.
        """
        loss = sum((p * x).sum() for p, x in zip(self.params, self.inputs))
        scaled = around("scale", lambda: self.scaler.scale(loss))
        scaled.backward()
        for name in self.phases[1:]:
            around(name, self.calls[name])
        self.opt.zero_grad()
