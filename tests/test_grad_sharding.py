"""FSDP2 (``fully_shard``) on real gloo ranks: DTensor gradients sharded over the mesh.

``scaler.clip_grad_norm_(optimizer, max_norm)`` with no extra argument must take the group from
the gradients' mesh, run the passes over the local shards, and train as torch does: oracles are
the same FSDP2 model with torch's GradScaler + ``torch.nn.utils.clip_grad_norm_`` (same ranks,
same data), and one process training the whole model on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from training_runs import OVERFLOW_STEP, SCALE, STEPS, make_model, make_optimizer, rows_of, single_process, train

import tritonscale


def fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    rows = rows_of(rank, world)
    from tritonscale import rank_combine

    gathers = []  # tritonscale's own collectives (FSDP2 issues its own all-gathers besides)
    gather_rows = rank_combine._gather_rows
    rank_combine._gather_rows = lambda row, group: gathers.append(group) or gather_rows(row, group)
    out = {}
    runs = [("torch-scaler", "fused", None)] + [
        (backend, kind, backend) for backend in ("torch", "triton") for kind in ("fused", "foreach")
    ]
    for name, kind, backend in runs:
        model = make_model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = make_optimizer(model, kind)
        if backend is None:
            scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        else:
            scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend=backend)

        def poison(step, model=model):
            if step == OVERFLOW_STEP and rank == 1:
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")

        gathers.clear()
        result = train(model, scaler, optimizer, rows, poison)
        result["groups"] = [g is mesh.get_group() for g in gathers]
        result["params"] = [p.full_tensor() for p in model.parameters()]  # collectives: after counting
        out[name, kind] = result
    return out


@pytest.fixture(scope="module")
def fsdp_run():
    return run_ranks(fsdp_worker, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_fsdp2_trains_like_torch_and_like_one_process(fsdp_run, backend, kind):
    reference = single_process(kind)
    for rank, ranks in enumerate(fsdp_run):
        ours = ranks[backend, kind]
        assert ours["groups"] == [True] * STEPS, "one collective per step, over the gradients' mesh"
        assert ours["scales"] == reference["scales"], f"rank {rank}: scales differ"
        assert ours["scales"][OVERFLOW_STEP] == SCALE / 2  # the overflow on rank 1 backed every rank off
        norms = ours["norms"]
        assert torch.equal(norms, fsdp_run[0][backend, kind]["norms"]), "ranks disagree on the norm"
        good = [s for s in range(STEPS) if s != OVERFLOW_STEP]
        torch.testing.assert_close(norms[good], ranks["torch-scaler", "fused"]["norms"][good], rtol=1e-5, atol=0)
        torch.testing.assert_close(norms[good], reference["norms"][good], rtol=1e-5, atol=0)
        for got, want in zip(ours["params"], reference["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(ours["params"], ranks["torch-scaler", "fused"]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------- Megatron-style tensor x pipeline parallel, plain tensors
# Each stage's layer: a column-parallel weight and bias (split by rows over the tensor-parallel
# group), a row-parallel weight (split by columns) and a replicated bias and layer-norm weight.
STAGES = {0: {"w_col": (6, 4), "b_col": (6,), "w_row": (4, 6), "b_row": (4,), "ln": (4,)}}
STAGES[1] = {name: shape for name, shape in STAGES[0].items()}
SPLIT_DIM = {"w_col": 0, "b_col": 0, "w_row": 1}  # the rest is replicated inside the group
TP_SCALE = 2.0**8


def full_stage_grads(stage: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(stage)
    return {name: torch.randn(shape, generator=g) * (stage + 1) for name, shape in STAGES[stage].items()}


def tp_pp_worker(rank: int, world: int, backend: str) -> dict:
    import torch.distributed as dist

    tp = 2
    tp_groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
    tp_group, tp_rank, stage = tp_groups[rank // tp], rank % tp, rank // tp
    out = {}
    for poisoned in (False, True):
        params, replicated = {}, []
        for name, grad in full_stage_grads(stage).items():
            part = grad.chunk(tp, SPLIT_DIM[name])[tp_rank] if name in SPLIT_DIM else grad
            params[name] = torch.nn.Parameter(torch.zeros_like(part))
            params[name].grad = part * TP_SCALE
            if name not in SPLIT_DIM:
                replicated.append(params[name])
        if poisoned and rank == world - 1:
            params["b_col"].grad[0] = float("nan")
        tritonscale.mark_replicated(replicated, tp_group)
        optimizer = torch.optim.SGD(params.values(), lr=1.0)
        # The norm is combined over every rank holding a part of the model: all tp x pp ranks.
        scaler = tritonscale.GradScaler("cpu", init_scale=TP_SCALE, backend=backend, process_group=dist.group.WORLD)
        scaler.scale(torch.ones(()))
        norm = scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        out[poisoned] = {
            "norm": norm,
            "grads": {n: p.grad.clone() for n, p in params.items()},
            "skipped": scaler.last_step_skipped(),
            "scale": scaler.get_scale(),
        }
    return out


@pytest.fixture(scope="module", params=["torch", "triton"])
def tp_pp_run(request):
    return request.param, run_ranks(tp_pp_worker, 4, request.param)


def test_tensor_and_pipeline_parallel_norm_counts_replicas_once(tp_pp_run):
    _, ranks = tp_pp_run
    full = [grad for stage in (0, 1) for grad in full_stage_grads(stage).values()]
    oracle = torch.nn.utils.get_total_norm(full)
    coefficient = torch.clamp(1.0 / (oracle + 1e-6), max=1.0)
    for rank, run in enumerate(ranks):
        seen = run[False]
        assert torch.equal(seen["norm"], ranks[0][False]["norm"]), f"rank {rank} disagrees"
        torch.testing.assert_close(seen["norm"], oracle, rtol=1e-6, atol=0)
        for name, grad in full_stage_grads(rank // 2).items():
            part = grad.chunk(2, SPLIT_DIM[name])[rank % 2] if name in SPLIT_DIM else grad
            torch.testing.assert_close(seen["grads"][name], part * coefficient, rtol=2e-6, atol=1e-7)
        assert not seen["skipped"]
        assert run[True]["skipped"] and run[True]["scale"] == TP_SCALE / 2, f"rank {rank} went ahead"


# ------------------------------------------------------ HSDP: a 2-D mesh, replicate x shard
def hsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model, "fused")
    scaler = tritonscale.GradScaler("cpu", init_scale=SCALE, backend="torch")

    def poison(step):
        if step == OVERFLOW_STEP and rank == world - 1:
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")

    result = train(model, scaler, optimizer, rows_of(rank, world), poison)
    result["params"] = [p.full_tensor() for p in model.parameters()]
    result["placements"] = [
        str(p.grad_placements if hasattr(p, "grad_placements") else p.placements) for p in model.parameters()
    ]
    return result


def test_hsdp_replicas_count_once_in_the_norm():
    reference = single_process("fused")
    for rank, ours in enumerate(run_ranks(hsdp_worker, 4)):
        assert "Replicate" in ours["placements"][0] and "Shard" in ours["placements"][0]
        assert ours["scales"] == reference["scales"], f"rank {rank}"
        good = [s for s in range(STEPS) if s != OVERFLOW_STEP]
        torch.testing.assert_close(ours["norms"][good], reference["norms"][good], rtol=1e-5, atol=0)
        for got, want in zip(ours["params"], reference["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
