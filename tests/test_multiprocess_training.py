"""Whole training runs on real gloo ranks: DDP (replicated gradients: no collective of ours),
checkpoint save/resume under FSDP2, and a rank that fails mid-step.

Oracles: one process on the global batch with torch's GradScaler; the uninterrupted run.
"""

from __future__ import annotations

import copy
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from support.multiprocess import CollectiveCounter, RanksFailed, run_ranks
from oracles.training_runs import OVERFLOW_STEP, SCALE, STEPS, make_model, make_optimizer, rows_of, train

import tritonscale


def overflow_on_rank_1(rank):
    def poison_batch(step, x):
        if step == OVERFLOW_STEP and rank == 1:
            x[0, 0] = float("inf")  # rank 1's loss overflows; DDP's all-reduce spreads it

    return poison_batch


def ddp_worker(rank: int, world: int) -> dict:
    out = {}
    for backend in ("torch", "triton"):
        for kind in ("fused", "foreach", "fused-bucket-view"):
            # gradient_as_bucket_view: the gradients are views of DDP's flat buckets.
            model = torch.nn.parallel.DistributedDataParallel(make_model(), gradient_as_bucket_view="view" in kind)
            optimizer = make_optimizer(model, kind.removesuffix("-bucket-view"))
            scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend=backend)
            counter = CollectiveCounter()  # DDP's own all-reduce runs in C++, not through these
            result = train(model, scaler, optimizer, rows_of(rank, world), poison_batch=overflow_on_rank_1(rank))
            result["collectives"] = counter.take()
            result["params"] = [p.detach().clone() for p in model.module.parameters()]
            out[backend, kind] = result
    return out


def one_process_oracle(kind: str) -> dict:
    model = make_model()
    optimizer = make_optimizer(model, kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def poison_batch(step, x):
        if step == OVERFLOW_STEP:
            x[rows_of(1, 2).start, 0] = float("inf")  # the row rank 1 poisons

    result = train(model, scaler, optimizer, slice(None), poison_batch=poison_batch)
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result


@pytest.fixture(scope="module")
def ddp_run():
    return run_ranks(ddp_worker, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["fused", "foreach", "fused-bucket-view"])
def test_ddp_trains_like_one_process_on_the_global_batch(ddp_run, backend, kind):
    reference = one_process_oracle(kind.removesuffix("-bucket-view"))
    assert reference["scales"][OVERFLOW_STEP] == SCALE / 2
    for rank, ranks in enumerate(ddp_run):
        ours = ranks[backend, kind]
        assert ours["collectives"] == 0, "replicated gradients need no collective"
        assert ours["scales"] == reference["scales"], f"rank {rank}"
        good = [s for s in range(STEPS) if s != OVERFLOW_STEP]
        torch.testing.assert_close(ours["norms"][good], reference["norms"][good], rtol=1e-5, atol=0)
        for got, want in zip(ours["params"], reference["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- checkpoints
RESUME_AT = OVERFLOW_STEP + 1  # after the backoff: the resumed scaler must carry it and the tracker


def checkpoint_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def fresh():
        model = make_model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = make_optimizer(model, "fused")
        return model, optimizer, tritonscale.GradScaler("cpu", init_scale=SCALE, growth_interval=2)

    def poison(model):
        def plant(step):
            if step == OVERFLOW_STEP and rank == 1:
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")

        return plant

    rows = rows_of(rank, world)
    model, optimizer, scaler = fresh()
    train(model, scaler, optimizer, rows, poison(model), steps=range(RESUME_AT))
    saved = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scaler": copy.deepcopy(scaler.state_dict()),
    }
    straight = train(model, scaler, optimizer, rows, steps=range(RESUME_AT, RESUME_AT + 3))
    straight["params"] = [p.to_local().clone() for p in model.parameters()]

    model, optimizer, scaler = fresh()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    resumed = train(model, scaler, optimizer, rows, steps=range(RESUME_AT, RESUME_AT + 3))
    resumed["params"] = [p.to_local().clone() for p in model.parameters()]
    return {"straight": straight, "resumed": resumed}


def test_fsdp2_checkpoint_resumes_bit_identically():
    for rank, run in enumerate(run_ranks(checkpoint_worker, 2)):
        straight, resumed = run["straight"], run["resumed"]
        # growth_interval 2: grown after steps 0-1, backed off at 2; the resumed tracker grows it at 4.
        assert straight["scales"] == resumed["scales"] == [SCALE, 2 * SCALE, 2 * SCALE]
        assert torch.equal(straight["norms"], resumed["norms"]), f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(straight["params"], resumed["params"])), f"rank {rank}"


# ---------------------------------------------------------------- failures
def failing_worker(rank: int, world: int, how: str) -> dict:
    params = [torch.nn.Parameter(torch.zeros(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    # A short timeout on the group the scaler uses: a rank that never arrives costs seconds.
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    scaler = tritonscale.GradScaler("cpu", backend="torch", process_group=group)
    scaler.scale(torch.ones(()))
    params[0].grad = torch.ones(4)
    if rank == 1:
        if how == "raises":
            raise ValueError("rank 1 fails before its clip_grad_norm_")
        time.sleep(5)  # alive, but never reaches the collective
        return {}
    start = time.monotonic()
    try:
        scaler.clip_grad_norm_(optimizer, 1.0)
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("how", ["raises", "stalls"])
def test_a_rank_failing_mid_step_ends_the_others_with_an_error(how):
    if how == "raises":
        with pytest.raises(RanksFailed) as failed:
            run_ranks(failing_worker, 2, how)
        assert "rank 1 fails before its clip_grad_norm_" in str(failed.value)
        survivor = failed.value.results[0]
    else:
        survivor = run_ranks(failing_worker, 2, how)[0]
    assert survivor["error"] is not None, "rank 0 finished a collective rank 1 never joined"
    assert "tritonscale: combining this step's norm and found_inf across the 2 ranks" in survivor["error"]
    assert survivor["seconds"] < 6.0  # the group's 3 s timeout, not a hang
