"""The columns: where a cell's gradients live and what is done to them, the loss scale it starts
from, and the backend.

A gradient context acts on both sides of a cell: on ours it sets up the layout under test (a
``flatten_grads_`` buffer, bucket views) and perturbs it; on the twin, which always holds plain
gradients, it does the same thing to the values (the same noise on the same elements, the same
model surgery), so that the twin stays the oracle of what ours must compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

import tritonscale

from .twins import FLOOR, GROWTH_INTERVAL, OVERFLOW_AT, OVERFLOWS, Side

RECOGNISED_FROM = 1  # flat buffers and buckets are recognised at step 0's pass; perturbed after
NOISE = 0.01  # DP-SGD-style noise, relative to the loss scale


class GradsContext:
    """Plain gradients (``zero_grad()`` sets them to None; autograd allocates new ones)."""

    name = "plain"
    sparse = False  # the model's first parameter gets a sparse gradient
    keeps_views = False  # ours keeps gradient views: zero_grad(set_to_none=False)
    skips_rows: tuple[str, ...] = ()  # rows this context does not apply to (they run their own backward)

    def setup(self, side: Side) -> None:
        """After the side is built, before step 0 (ours is set up before the twin)."""

    def set_to_none(self, side: Side) -> bool:
        return not (side.ours and self.keeps_views)

    def before_zero_grad(self, side: Side, step: int) -> None:
        """At the start of an iteration, before the gradients are zeroed."""

    def after_backward(self, side: Side, step: int) -> None:
        """After the scaled backward, before any scaler call of the iteration."""

    def accumulate(self, side: Side, step: int, scaled_backward) -> None:
        """After the first scaled backward of the iteration: more micro-batches, if any."""


class Flat(GradsContext):
    """``tritonscale.flatten_grads_``: every gradient a view of one padded buffer."""

    name = "flat"
    keeps_views = True

    def setup(self, side: Side) -> None:
        if side.ours:
            (buffer,) = tritonscale.flatten_grads_(side.model.parameters())
            side.objects["buffer"] = buffer
            # Where each gradient sits in the buffer: the twin writes the same elements.
            side.cell.layout = [(p.grad.storage_offset() - buffer.storage_offset(), p.numel()) for p in side.params()]
            side.cell.buffer_size = buffer.numel()


class FlatWrittenWhole(Flat):
    """Noise added to the whole buffer returned by flatten_grads_ (padding included) every step."""

    name = "flat_written_whole"

    def after_backward(self, side: Side, step: int) -> None:
        g = torch.Generator().manual_seed(500 + step)
        noise = torch.randn(side.cell.buffer_size, generator=g) * (NOISE * side.scaler.get_scale())
        with torch.no_grad():
            if side.ours:
                side.objects["buffer"].add_(noise)
            else:  # the same noise on the gradients' elements; the padding's is no gradient
                for p, (offset, numel) in zip(side.params(), side.cell.layout):
                    p.grad.view(-1).add_(noise[offset : offset + numel])


class FlatNanPadding(Flat):
    """``buffer.fill_(nan)`` then ``zero_grad(set_to_none=False)``: NaN left in the padding."""

    name = "flat_nan_padding"

    def before_zero_grad(self, side: Side, step: int) -> None:
        if side.ours and step == RECOGNISED_FROM:
            side.objects["buffer"].fill_(math.nan)


class BucketViews(GradsContext):
    """DDP's gradient_as_bucket_view: gradients back to back in one storage, no flatten_grads_."""

    name = "bucket_views"
    keeps_views = True

    def setup(self, side: Side) -> None:
        if side.ours:
            bucket = torch.zeros(sum(p.numel() for p in side.params()))
            offset = 0
            for p in side.params():
                p.grad = bucket[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            side.objects["bucket"] = bucket


class MovedAfterRecognition(Flat):
    """After recognition, the gradients' memory moves: ``p.grad.data = clone`` (step 4), then a
    ``model.to(float64).to(float32)`` round trip (step 7, both sides)."""

    name = "moved"

    def before_zero_grad(self, side: Side, step: int) -> None:
        if side.ours and step == 4:
            for p in side.params():
                p.grad.data = p.grad.data.clone()
        if step == 7:
            side.model.to(torch.float64).to(torch.float32)


class ResizedInPlace(Flat):
    """Model surgery after recognition, between backward and the scaler's calls (step 5): the
    first parameter loses its last three rows in place, its gradient too (``as_strided_`` at the same
    address: the row's values stay in memory, no gradient's any more), and its optimizer state."""

    name = "resized"

    def after_backward(self, side: Side, step: int) -> None:
        if step != 5:
            return
        p = side.params()[0]
        rows, cols = p.shape[0] - 3, p.shape[1]
        p.data = p.data[:rows]
        if side.ours:
            p.grad.as_strided_((rows, cols), (cols, 1))
        else:
            p.grad = p.grad[:rows].clone()
        _convert_state(side, p, lambda t: t[:rows].clone())


class RetypedInPlace(Flat):
    """After recognition (step 5) the third parameter becomes bfloat16, and its gradient a
    bfloat16 tensor at the same address (``p.grad.data = ...``); its optimizer state follows."""

    name = "retyped"

    def before_zero_grad(self, side: Side, step: int) -> None:
        if step != 5:
            return
        p = side.params()[2]
        p.data = p.data.to(torch.bfloat16)
        if side.ours:
            g = p.grad.detach()
            p.grad.data = g.reshape(-1).view(torch.bfloat16)[: g.numel()].view(g.shape)
        else:
            p.grad = None
        _convert_state(side, p, lambda t: t.to(torch.bfloat16))


class Accumulated(GradsContext):
    """Gradient accumulation: two more scaled backwards (other micro-batches) into the same
    gradients before the scaler's calls, as a loop with ``accumulation_steps=3`` does."""

    name = "accumulated"
    skips_rows = ("Updater",)  # the Updater runs its own backward, one per update

    def accumulate(self, side: Side, step: int, scaled_backward) -> None:
        for micro in (1, 2):
            scaled_backward(side.model.loss(step + 100 * micro))


class Sparse(GradsContext):
    """The first parameter is an embedding table with sparse gradients."""

    name = "sparse"
    sparse = True


def _convert_state(side: Side, p: torch.nn.Parameter, convert) -> None:
    state = side.optimizer.state.get(p, {})
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            state[key] = convert(value)


def inject_overflow(side: Side, step: int) -> None:
    """The cell's overflow steps: the same element of the same gradient on both sides."""
    if step in OVERFLOWS:
        where, element = OVERFLOW_AT
        with torch.no_grad():
            side.params()[where].grad.view(-1)[element] = OVERFLOWS[step]


GRADS = [
    GradsContext(),
    Flat(),
    FlatWrittenWhole(),
    FlatNanPadding(),
    BucketViews(),
    MovedAfterRecognition(),
    ResizedInPlace(),
    RetypedInPlace(),
    Sparse(),
    Accumulated(),
]


@dataclass(frozen=True)
class ScaleContext:
    """The scaler's constructor arguments: the initial scale (or ``enabled=False``), and whether
    they come as numpy scalars (which torch.amp.GradScaler accepts)."""

    name: str
    init_scale: float = 2.0**16
    enabled: bool = True
    numpy: bool = False

    def kwargs(self) -> dict:
        return {"init_scale": self.scale(), "growth_interval": self.growth_interval(), "enabled": self.enabled}

    def scale(self) -> float:
        return np.float32(self.init_scale) if self.numpy else self.init_scale

    def growth_interval(self) -> int:
        return np.int64(GROWTH_INTERVAL) if self.numpy else GROWTH_INTERVAL


SCALES = [
    ScaleContext("floor", FLOOR),
    ScaleContext("tiny", 2.0**-80),
    ScaleContext("ordinary", 2.0**16),
    ScaleContext("near_max", 2.0**126),
    ScaleContext("numpy_scalars", 2.0**16, numpy=True),
    ScaleContext("disabled", enabled=False),
]

#: "triton_retimed": the Triton backend run twice, each time with an autotuner that times every
#: launch configuration with another stopwatch (stopwatch.py): the results must be the same bits.
#: "gpu_paths": the Triton backend on the paths a GPU takes, host reads not free (gpu_paths.py).
BACKENDS = ["torch", "triton", "triton_retimed", "gpu_paths"]
