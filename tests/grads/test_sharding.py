"""FSDP2 (``fully_shard``) on real gloo ranks: DTensor gradients sharded over the mesh.

``scaler.clip_grad_norm_(optimizer, max_norm)`` with no extra argument must take the group from
the gradients' mesh, run the passes over the local shards, and train as torch does: oracles are
the same FSDP2 model with torch's GradScaler + ``torch.nn.utils.clip_grad_norm_`` (same ranks,
same data), and one process training the whole model on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from support.multiprocess import run_ranks
from oracles.training_runs import (
    OVERFLOW_STEP,
    SCALE,
    STEPS,
    make_model,
    make_optimizer,
    rows_of,
    single_process,
    train,
)

import tritonscale


def fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    rows = rows_of(rank, world)
    from tritonscale.passes import rank_combine

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


# ------------------------------------------------------------------ bad input
def bad_input_worker(rank: int, world: int) -> dict:
    import pickle

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    errors = {}

    def attempt(name, params, scaler=None, call="clip"):
        scaler = scaler or tritonscale.GradScaler("cpu", init_scale=SCALE)
        scaler.scale(torch.ones(()))
        optimizer = torch.optim.AdamW(params, lr=1.0)
        before = [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone() for p in params]
        try:
            scaler.clip_grad_norm_(optimizer, 1.0) if call == "clip" else scaler.unscale_(optimizer)
        except (ValueError, TypeError) as error:
            after = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
            untouched = all(torch.equal(a, b) for a, b in zip(before, after)) and scaler.get_scale() == SCALE
            records = scaler._per_optimizer_states.values()
            ready = all(r.stage is tritonscale.OptState.READY and not r.found_inf_per_device for r in records)
            errors[name] = (type(error).__name__, str(error), untouched, ready)
        else:
            errors[name] = None

    # Marked replicas, but no group to combine the norm over: refused on every rank alike.
    plain = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    for p in plain:
        p.grad = torch.ones_like(p) * SCALE
    tritonscale.mark_replicated(plain[1:], dist.group.WORLD)
    attempt("marked-without-group", plain)

    # A Partial gradient is a sum still to be reduced.
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    replicated.grad = DTensor.from_local(torch.ones(4) * SCALE, mesh, [Partial()])
    attempt("partial", [replicated])

    # One DTensor, one plain tensor: no one group gives their norm.
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(torch.ones(4) * SCALE, mesh, [Shard(0)])
    lone = torch.nn.Parameter(torch.zeros(2))
    lone.grad = torch.ones(2) * SCALE
    attempt("mixed", [sharded, lone])
    attempt("mixed-unscale", [sharded, lone], call="unscale")

    try:
        tritonscale.mark_replicated(plain, "tp")
    except TypeError as error:
        errors["mark-not-a-group"] = (type(error).__name__, str(error), True, True)
    try:
        pickle.dumps(tritonscale.GradScaler("cpu", process_group=dist.group.WORLD))
    except TypeError as error:
        errors["pickle"] = (type(error).__name__, str(error), True, True)
    return errors


@pytest.mark.parametrize(
    "case, message",
    [
        ("marked-without-group", "marked replicated over a process group"),
        ("partial", "Partial placement on mesh dimension 0"),
        ("mixed", r"param_groups\[0\]\['params'\]\[0\] and param_groups\[0\]\['params'\]\[1\] are split differently"),
        ("mixed-unscale", "split differently across processes"),
        ("mark-not-a-group", "group must be a torch.distributed ProcessGroup, got str"),
        ("pickle", "process_group cannot be pickled"),
    ],
)
def test_bad_layouts_are_clear_errors_with_nothing_changed(bad_input_run, case, message):
    import re

    for rank, errors in enumerate(bad_input_run):
        assert errors[case] is not None, f"rank {rank} accepted {case}"
        kind, text, untouched, nothing_recorded = errors[case]
        assert re.search(message, text), text
        assert untouched and nothing_recorded, f"rank {rank}: {case} changed state before raising"


@pytest.fixture(scope="module")
def bad_input_run():
    return run_ranks(bad_input_worker, 2)


def test_process_group_must_be_a_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None, got str"):
        tritonscale.GradScaler("cpu", process_group="world")
