"""One small training run, shared by the multi-process tests and their one-process oracles:
the model, the data of each step, the scaled loop and its record (norms, scales, parameters)."""

from __future__ import annotations

import torch

import tritonscale

STEPS = 4
OVERFLOW_STEP = 2  # rank 1 alone sees an inf there: every rank must skip
SCALE = 2.0**10
MAX_NORM = 0.3
BATCH = 8


def rows_of(rank: int, world: int) -> slice:
    """This rank's rows of each global batch (the data-parallel split)."""
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def make_optimizer(model, kind):
    return torch.optim.AdamW(model.parameters(), lr=0.05, fused=kind == "fused", foreach=kind == "foreach")


def train(model, scaler, optimizer, rows: slice, poison=None, steps=range(STEPS), poison_batch=None) -> dict:
    """Scaled steps on ``rows`` of each global batch. ``poison(step)`` may plant an inf in a
    gradient after backward, ``poison_batch(step, x)`` in this rank's inputs before forward."""
    norms, scales = [], []
    for step in steps:
        x, y = batch(step)
        x = x[rows].clone()
        if poison_batch is not None:
            poison_batch(step, x)
        loss = torch.nn.functional.mse_loss(model(x), y[rows])
        scaler.scale(loss).backward()
        if poison is not None:
            poison(step)
        if isinstance(scaler, tritonscale.GradScaler):
            norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
        else:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        scales.append(scaler.get_scale())
    return {"norms": torch.stack(norms), "scales": scales}


def single_process(kind: str) -> dict:
    """The whole model on the global batch, torch's GradScaler; the same planted overflow."""
    model = make_model()
    optimizer = make_optimizer(model, kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def poison(step):
        if step == OVERFLOW_STEP:
            model[0].weight.grad.view(-1)[0] = float("inf")

    result = train(model, scaler, optimizer, slice(None), poison)
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result
