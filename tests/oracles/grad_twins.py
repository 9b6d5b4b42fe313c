"""The oracle for tests that change how gradients lie in memory (tests/grads/): our scaler and
optimizer beside torch's ``GradScaler`` + ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` on twin
parameters holding plain copies of the gradients, one call at a time.

Each ``Twins.step`` fills every gradient the optimizer holds with new scaled values (in place, in
whatever memory and metadata it has now), lets the test write around them (``write``), copies the
gradients' values to the twins, runs one entry point on both sides and compares the norm, the
overflow flag, the gradients, the parameters after the step and the scale after ``update()``.
Memory that is not the optimizer's gradients (``foreign``) must come out bitwise untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from tritonscale import GradScaler

from .tolerances import TORCH_BACKEND_NORM_RTOL

SCALE = 2.0**10
#: What a step calls: clip_grad_norm_ then step, unscale_ then step, or step alone.
ENTRIES = ("clip", "unscale", "step")


def owned(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters that have a gradient, in order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class Twins:
    """Our scaler next to torch's, both kept across steps (same scale, same growth schedule), so an
    overflow one side sees and the other does not shows as a different scale."""

    def __init__(self, backend: str, growth_interval: int = 3, armed: Callable = contextlib.nullcontext) -> None:
        """``armed()``: a context our scaler's unscale_ and clip_grad_norm_ run in
        (``forbid_host_reads.armed``)."""
        self.armed = armed
        self.scaler = GradScaler("cpu", init_scale=SCALE, growth_interval=growth_interval, backend=backend)
        self.theirs = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=growth_interval)
        for s in (self.scaler, self.theirs):
            s.scale(torch.ones(()))
        self.step_index = 0
        #: ours clip_grad_norm_(optimizer, max_norm, norm_type): a test may put a compiled one here
        self.clip = self.scaler.clip_grad_norm_

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        foreign: list[torch.Tensor] = (),
        max_norm: float = 0.5,
        norm_type: float = 2.0,
        entry: str = "clip",
        write: Callable[[], None] | None = None,
    ) -> None:
        """One step of ``entry`` on both sides; ``write()`` runs after the gradients are filled (it
        may write anything around them, or the gradients themselves: the twins copy what is there)."""
        g = torch.Generator().manual_seed(self.step_index)
        self.step_index += 1
        params = owned(optimizer)
        scale = self.scaler.get_scale()
        assert scale == self.theirs.get_scale(), f"scales differ before step {self.step_index}"
        for p in params:
            p.grad.copy_((torch.randn(p.grad.shape, generator=g) * scale).to(p.grad.dtype))
        if write is not None:
            write()
        # A gradient resized or retyped in place no longer fits its parameter: its twin is made to
        # fit the gradient, and nothing steps (an optimizer would refuse it anyway).
        fits = all(p.grad.shape == p.shape and p.grad.dtype == p.dtype for p in params)
        twins = [torch.nn.Parameter(p.detach().clone() if fits else torch.zeros_like(p.grad)) for p in params]
        for t, p in zip(twins, params):
            t.grad = p.grad.clone()
        twin_opt = torch.optim.SGD(twins, lr=optimizer.defaults["lr"])
        untouched = [f.clone() for f in foreign]
        assert fits or entry != "step", "a gradient that does not fit its parameter cannot step"
        norm, want = self._entry(optimizer, twin_opt, entry, max_norm, norm_type)
        if fits:
            self.scaler.step(optimizer)  # a non-fused optimizer's step reads its skip flag, as torch's does
            self.theirs.step(twin_opt)
        ours_inf = bool(self.scaler.found_inf_for(optimizer).item())
        theirs_inf = bool(sum(v.item() for v in self.theirs._found_inf_per_device(twin_opt).values()))
        self.scaler.update()
        self.theirs.update()
        assert ours_inf == theirs_inf, f"found_inf {ours_inf} against torch's {theirs_inf}"
        self._compare(params, twins, norm, want, lr=optimizer.defaults["lr"] if fits else None)
        assert self.scaler.get_scale() == self.theirs.get_scale(), "the scale after update() differs from torch's"
        for f, before in zip(foreign, untouched):
            torch.testing.assert_close(
                f,
                before,
                rtol=0,
                atol=0,
                equal_nan=True,
                msg="memory that is not the optimizer's gradients was written",
            )

    def _entry(self, optimizer, twin_opt, entry, max_norm, norm_type):
        """Ours and torch's unscale (and clip) before the step: the norm, and torch's with the
        float64 norm of the same values (None without a clip)."""
        if entry == "step":
            return None, None
        self.theirs.unscale_(twin_opt)
        if entry == "unscale":
            with self.armed():
                self.scaler.unscale_(optimizer)
            return None, None
        params = owned(twin_opt)
        exact = torch.linalg.vector_norm(torch.stack([t.grad.double().norm(norm_type) for t in params]), norm_type)
        want = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        with self.armed():
            norm = self.clip(optimizer, max_norm, norm_type)
        return norm, (want, exact)

    @staticmethod
    def _compare(params, twins, norm, want, lr: float | None) -> None:
        """Norms and gradients within the tolerance table; parameters (after a step at ``lr``, if
        one was taken) within it too, plus what those gradients' tolerance moves them by."""
        dtypes = {p.grad.dtype for p in params} | {p.dtype for p in params}
        if torch.bfloat16 in dtypes:
            # torch rounds each bfloat16 norm to bfloat16 (2**-9) and so may the torch backend:
            # both against the float64 norm of the same unscaled values, the gradients within a few
            # bfloat16 ulps of torch's.
            close = dict(rtol=2.0**-6, atol=0)
            if norm is not None:
                torch.testing.assert_close(norm.double(), want[1], rtol=2.0**-8, atol=0, equal_nan=True)
        else:
            rtol = max(TORCH_BACKEND_NORM_RTOL[d] for d in dtypes)
            close = dict(rtol=rtol, atol=1e-9)
            if norm is not None:
                torch.testing.assert_close(norm, want[0], rtol=rtol, atol=0, equal_nan=True)
        for i, (p, t) in enumerate(zip(params, twins)):
            torch.testing.assert_close(p.grad, t.grad, **close, equal_nan=True, msg=lambda m, i=i: f"gradient {i}: {m}")
            if lr is not None:
                moved = lr * close["rtol"] * t.grad.float().abs().max().item() if t.grad.numel() else 0.0
                at = dict(rtol=close["rtol"], atol=close["atol"] + moved)
                torch.testing.assert_close(p, t, **at, equal_nan=True, msg=lambda m, i=i: f"parameter {i}: {m}")
