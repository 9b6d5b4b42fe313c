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
