"""The spike rules with a process group: every rank decides from the group's norm.

Two ranks each hold half of a model's parameters (their own optimizer over their half; the
gradients of the whole model computed alike on both; each half sent from its owner after a step).
With ``process_group`` the clip's norm is the group's, so each rank's z-score skips, ZClip clip
values and parameters must be those of one process holding every parameter (the oracle), and the
ranks' spike state bitwise the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from multiprocess import run_ranks
from tolerances import NORM_RTOL, TORCH_CLIP_COEF_RTOL

import tritonscale
from tritonscale import LossScalePolicy

STEPS, SPIKES, MAX_NORM = 24, (13, 21), 50.0
POLICY = dict(skip_norm_sigma=6, skip_norm_window=8, clip_norm_z=2.5, clip_norm_warmup_steps=4)


def _run(rank: int | None, world: int) -> dict:
    """The loop on ``rank``'s half of the parameters (all of them for ``rank=None``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    batches = [torch.randn(6, 8) * (30.0 if i in SPIKES else 1.0) for i in range(STEPS)]
    params = list(model.parameters()) if rank is None else list(model.parameters())[rank::world]
    optimizer = torch.optim.SGD(params, lr=1e-2)
    group = None if rank is None else dist.group.WORLD
    scaler = tritonscale.GradScaler("cpu", policy=LossScalePolicy(**POLICY), backend="torch", process_group=group)
    norms, skipped = [], []
    for x in batches:
        model.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        norms.append(scaler.clip_grad_norm_(optimizer, max_norm=MAX_NORM).item())
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.last_step_skipped())
        for i, p in enumerate(model.parameters() if group is not None else []):  # each half from its owner
            dist.broadcast(p.data, src=i % world)
    spike_stats = scaler.state_dict()["spike_stats"]
    return {"norms": norms, "skipped": skipped, "params": [p.detach().clone() for p in params], "spike": spike_stats}


def spike_worker(rank: int, world: int) -> dict:
    return _run(rank, world)


def test_ranks_decide_as_one_process():
    ranks = run_ranks(spike_worker, 2)
    oracle = _run(None, 2)
    assert [i for i, s in enumerate(oracle["skipped"]) if s]  # a spike was skipped: not a vacuous run
    for rank, run in enumerate(ranks):
        assert run["skipped"] == oracle["skipped"]
        for ours, theirs in zip(run["norms"], oracle["norms"]):
            assert math.isclose(ours, theirs, rel_tol=NORM_RTOL[torch.float32])
        for ours, theirs in zip(run["params"], oracle["params"][rank::2]):
            torch.testing.assert_close(ours, theirs, rtol=TORCH_CLIP_COEF_RTOL[torch.float32], atol=1e-6)
    assert ranks[0]["spike"] == ranks[1]["spike"]
