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
from support.multiprocess import run_ranks
from oracles.tolerances import NORM_RTOL, TORCH_CLIP_COEF_RTOL

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


# ------------------------------------------------------------- spike state loaded on one rank
LOADED = dict(skip_norm_sigma=2, skip_norm_window=4)
SPIKE_AT, SCALE = 5, 2.0**10


def _loaded_on_rank_1(rank: int, fused: bool):
    """ZeRO partitions (rank r holds parameter i where i % 2 == r) of a model whose gradients are
    the same on both ranks: 5 agreeing steps, then rank 1 alone loads a fresh scaler's
    state_dict (the same scale, no spike history), then step 5's gradients, 30 times the norm."""
    shapes = [(5, 3), (7,), (4,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(shapes) if i % 2 == rank]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    make = dict(init_scale=SCALE, growth_interval=10**6, backend="torch", **LOADED)
    scaler = tritonscale.GradScaler("cpu", process_group=dist.group.WORLD, **make)
    for step in range(SPIKE_AT + 1):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=g) * (30.0 if step == SPIKE_AT else 1.0) for s in shapes]
        scaler.scale(torch.ones(()))
        for p, grad in zip(params, grads[rank::2]):
            p.grad = grad * SCALE
        if step == SPIKE_AT:
            return params, optimizer, scaler
        scaler.clip_grad_norm_(optimizer, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        if step == SPIKE_AT - 1 and rank == 1:  # the same scale, another history
            scaler.load_state_dict(tritonscale.GradScaler("cpu", **make).state_dict())


def loaded_state_worker(rank: int, world: int) -> dict:
    from support.host_reads import HostReadGuard
    from oracles.scaler_twins import bits, same_bits

    import tritonscale.host_reads

    out = {}
    params, optimizer, scaler = _loaded_on_rank_1(rank, fused=False)
    before = [[bits(p) for p in params], [bits(p.grad) for p in params]]
    try:
        scaler.clip_grad_norm_(optimizer, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        out["cpu"] = ("applied", scaler.last_step_skipped())
    except tritonscale.RankMismatchError as error:
        out["cpu"] = ("raised", str(error))
    out["cpu untouched"] = same_bits(before, [[bits(p) for p in params], [bits(p.grad) for p in params]])
    # The GPU paths: the step reads nothing on the host, is skipped, and the next read raises.
    tritonscale.host_reads.are_free = lambda device: False
    params, optimizer, scaler = _loaded_on_rank_1(rank, fused=True)
    before = [bits(p) for p in params]
    with HostReadGuard().armed():
        scaler.clip_grad_norm_(optimizer, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
    out["gpu untouched"] = same_bits(before, [bits(p) for p in params])
    try:
        scaler.get_scale()
        out["gpu"] = None
    except tritonscale.RankMismatchError as error:
        out["gpu"] = str(error)
    return out


def test_spike_state_loaded_on_one_rank_raises_on_every_rank_before_the_spike_step():
    """Before: rank 0 skipped the spike and rank 1 (no history) applied it, silently; the row
    compared the scale alone, which the checkpoint kept."""
    for rank, out in enumerate(run_ranks(loaded_state_worker, 2)):
        kind, message = out["cpu"]
        assert kind == "raised", f"rank {rank} went on (skipped: {message})"
        assert "the scaler's trackers besides the scale" in message and "the loss scale" not in message
        assert out["cpu untouched"], f"rank {rank}: the refused step changed a parameter or gradient"
        assert out["gpu untouched"], f"rank {rank}: the GPU path's step changed a parameter"
        assert out["gpu"] is not None and "the scaler's trackers" in out["gpu"], f"rank {rank}: {out['gpu']}"
