"""Gradients split across real processes (ZeRO-style partitions on gloo): the norm, found_inf, the
skip and the scale must be the group's, bitwise the same on every rank, in one collective per step.

The oracle is one process holding all the gradients: torch's ``unscale_`` + ``clip_grad_norm_``.
All scenarios of a world size run in one spawn (each spawn imports torch and triton per rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.host_reads import HostReadGuard
from support.multiprocess import CollectiveCounter, run_ranks
from oracles.tolerances import NORM_RTOL

import tritonscale

SCALE = 2.0**12
MAX_NORM = 0.5
SHAPES = [(5, 3), (7,), (2, 2, 2), (4,), (3, 3), (1,), (6,)]
INF_FLOWS = ["clip+step", "unscale+step", "unscale+clip+step", "step"]  # "step": the fused fold alone


def full_grads() -> list[torch.Tensor]:
    """Every parameter's unscaled gradient (the same on every rank and in the oracle)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g) * 10 ** (i % 3) for i, shape in enumerate(SHAPES)]


def my_part(rank: int, world: int) -> list[int]:
    return [i for i in range(len(SHAPES)) if i % world == rank]  # a partition; rank 3 of 4 holds one


def _setup(rank, world, backend, fused, inject=None):
    params = [torch.nn.Parameter(torch.zeros(SHAPES[i])) for i in my_part(rank, world)]
    if fused:
        optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    else:
        optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend=backend, process_group=dist.group.WORLD)
    scaler.scale(torch.ones(()))
    grads = full_grads()
    for p, i in zip(params, my_part(rank, world)):
        p.grad = grads[i] * SCALE
    if inject is not None and rank == world - 1:
        params[0].grad.view(-1)[0] = inject
    return params, optimizer, scaler


def _run_flow(flow, scaler, optimizer):
    norm = None
    if flow.startswith("unscale"):
        scaler.unscale_(optimizer)
    if "clip" in flow:
        norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    return norm


def zero_worker(rank: int, world: int) -> dict:
    import tritonscale.host_reads

    tritonscale.host_reads.are_free = lambda device: False  # the GPU paths: no host reads at all
    counter = CollectiveCounter()
    host_reads = HostReadGuard()
    out = {}
    for backend in ("torch", "triton"):
        for fused in (False, True):
            params, optimizer, scaler = _setup(rank, world, backend, fused)
            if fused:  # the fold: clip, step and update read nothing back, collective included
                with host_reads.armed():
                    norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
                    scaler.step(optimizer)
                    scaler.update()
            else:
                norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
                out[backend, fused, "clipped"] = [p.grad.clone() for p in params]
                scaler.step(optimizer)
                scaler.update()
            out[backend, fused, "norm"] = norm.clone()
            out[backend, fused, "params"] = [p.detach().clone() for p in params]
            out[backend, fused, "collectives"] = counter.take()
        for flow in INF_FLOWS:
            for bad in ("inf", "nan"):
                params, optimizer, scaler = _setup(rank, world, backend, fused=flow == "step", inject=float(bad))
                counter.take()
                _run_flow(flow, scaler, optimizer)
                out[backend, flow, bad] = {
                    "skipped": scaler.last_step_skipped(),
                    "scale": scaler.get_scale(),
                    "untouched": all(torch.equal(p.detach(), torch.zeros_like(p)) for p in params),
                    "collectives": counter.take(),
                }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def zero_run(request):
    world = request.param
    return world, run_ranks(zero_worker, world)


def oracle(world: int, fused: bool):
    """One process, all gradients: torch's GradScaler, unscale_ + clip_grad_norm_ + step."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, full_grads()):
        p.grad = g * SCALE
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    clipped = [p.grad.clone() for p in params]
    scaler.step(optimizer)
    return norm, clipped, [p.detach().clone() for p in params]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_partitioned_norm_is_the_whole_models(zero_run, backend, fused):
    world, ranks = zero_run
    norm, clipped, stepped = oracle(world, fused)
    norms = [r[backend, fused, "norm"] for r in ranks]
    assert all(torch.equal(n, norms[0]) for n in norms), "the norm differs between ranks"
    torch.testing.assert_close(norms[0], norm, rtol=NORM_RTOL[torch.float32], atol=0)
    for rank, r in enumerate(ranks):
        mine = my_part(rank, world)
        if not fused:
            for got, i in zip(r[backend, fused, "clipped"], mine):
                torch.testing.assert_close(got, clipped[i], rtol=2e-6, atol=1e-7)
        for got, i in zip(r[backend, fused, "params"], mine):
            torch.testing.assert_close(got, stepped[i], rtol=2e-6, atol=1e-7)
        assert r[backend, fused, "collectives"] == 1  # norm and found_inf in one all-gather


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("flow", INF_FLOWS)
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_an_overflow_on_one_rank_skips_every_rank(zero_run, backend, flow, bad):
    world, ranks = zero_run
    for rank, r in enumerate(ranks):
        seen = r[backend, flow, bad]
        assert seen["skipped"], f"rank {rank} stepped"
        assert seen["scale"] == SCALE * 0.5, f"rank {rank} did not back off"
        assert seen["untouched"], f"rank {rank}'s parameters changed"
        # One collective per call that passes over the gradients: unscale_ makes its flags the
        # group's at once (no accessor communicates later), so unscale_ then clip_grad_norm_ is two.
        expected = 2 if flow == "unscale+clip+step" else 1
        assert seen["collectives"] == expected, f"rank {rank}: {seen['collectives']} collectives in {flow}"


def explicit_stage_worker(rank: int, world: int) -> dict:
    """With a process group, unscale_ is the collective (its flags are the group's when it returns);
    reading them -- the record, found_inf_for, overflowed, stats() -- communicates nothing, and
    step() then needs no other collective."""
    counter = CollectiveCounter()
    params, optimizer, scaler = _setup(rank, world, "torch", fused=False, inject=float("inf"))
    counter.take()
    scaler.unscale_(optimizer)
    out = {"unscale_": counter.take()}
    record = scaler._per_optimizer_states[id(optimizer)]
    out["record"] = [float(f) for f in record.found_inf_per_device.values()]
    out["found_inf_for"] = float(scaler.found_inf_for(optimizer))
    out["overflowed"] = scaler.overflowed(optimizer)
    scaler.stats()
    out["read"] = counter.take()
    scaler.step(optimizer)
    scaler.update()
    out["after"] = counter.take()
    out["skipped"] = scaler.last_step_skipped()
    return out


def test_unscale_is_the_collective_and_reading_its_flags_never_communicates():
    ranks = run_ranks(explicit_stage_worker, 2)
    for rank, r in enumerate(ranks):
        assert r["unscale_"] == 1 and r["read"] == 0 and r["after"] == 0, f"rank {rank}: {r}"
        # The inf is on the last rank only; every rank's flag is the group's.
        assert r["record"] == [1.0] and r["found_inf_for"] == 1.0 and r["overflowed"], f"rank {rank}: {r}"
        assert r["skipped"], f"rank {rank} stepped"


def test_the_updaters_all_reduce_plan_follows_a_model_cast_in_place():
    # The plan is cached per layout; a parameter cast in place (same object, new dtype) is a new
    # layout: float16/bfloat16 gradients are summed in a float32 buffer (the buffer's size never
    # depends on a rank's dtypes), float64 ones in float64 (nothing of theirs is rounded away).
    from tritonscale.passes.rank_combine import GradAllReduce

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    for p in params:
        p.grad = torch.zeros_like(p)
    reduce = GradAllReduce()
    (before,), _ = reduce._plan_for(params)
    assert before[1] is torch.float32
    for p in params:
        p.data, p.grad = p.data.bfloat16(), p.grad.bfloat16()
    (after,), _ = reduce._plan_for(params)
    assert after[1] is torch.float32 and after[2] == params and reduce._plan[1] != (2, 0)
    layout = reduce._plan[1]
    for p in params:
        p.data, p.grad = p.data.double(), p.grad.double()
    (wide,), _ = reduce._plan_for(params)
    assert wide[1] is torch.float64 and reduce._plan[1] != layout
