"""tritonscale on several processes, on CPU with gloo. Run, for each layout:

    torchrun --standalone --nproc_per_node 2 examples/train_multiprocess.py --layout ddp|fsdp2|zero|tensor-parallel

Each rank prints nothing but rank 0's last line: the step count, the loss scale and the global
gradient norm, the same on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import tritonscale

IN, HIDDEN, OUT = 32, 64, 8


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's row-parallel output: the partial products summed over the ranks going forward; the
    gradient of a sum is the output's gradient itself, which every rank already holds."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)  # collective: the row-parallel layer's sum
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TensorParallelMLP(torch.nn.Module):
    """Megatron-style: the first layer split by output features, the second by input features;
    the second bias is replicated (every rank holds and updates all of it)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        full = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT))  # same seed everywhere
        self.w1 = torch.nn.Parameter(full[0].weight.detach().chunk(world, 0)[rank].clone())
        self.b1 = torch.nn.Parameter(full[0].bias.detach().chunk(world, 0)[rank].clone())
        self.w2 = torch.nn.Parameter(full[1].weight.detach().chunk(world, 1)[rank].clone())
        self.b2 = torch.nn.Parameter(full[1].bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(x @ self.w1.T + self.b1)
        return ReduceFromParallelRegion.apply(hidden @ self.w2.T) + self.b2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["ddp", "fsdp2", "zero", "tensor-parallel"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=5)
    layout = parser.parse_args().layout
    steps = parser.parse_args().steps

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a timeout: never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    owned = None  # the parameters this rank's optimizer steps: all of them but for ZeRO

    if layout == "ddp":
        # DDP all-reduces the gradients: every rank holds them whole, no process_group.
        model = torch.nn.parallel.DistributedDataParallel(model)
        scaler = tritonscale.GradScaler("cpu")
    elif layout == "fsdp2":
        # FSDP2: the gradients are DTensors; clip_grad_norm_ takes the group from their mesh.
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        scaler = tritonscale.GradScaler("cpu")
    elif layout == "zero":
        # ZeRO-1 style: each rank's optimizer owns a partition of the parameters; name the group.
        model = torch.nn.parallel.DistributedDataParallel(model)
        owned = [p for i, p in enumerate(model.parameters()) if i % world == rank]
        scaler = tritonscale.GradScaler("cpu", process_group=dist.group.WORLD)
    else:
        # Tensor parallel: the norm spans the group; the replicated bias counts once.
        model = TensorParallelMLP(rank, world)
        tritonscale.mark_replicated([model.b2], dist.group.WORLD)
        scaler = tritonscale.GradScaler("cpu", process_group=dist.group.WORLD)

    optimizer = torch.optim.AdamW(owned or model.parameters(), lr=1e-3, fused=True)
    data = torch.Generator().manual_seed(1 + (0 if layout == "tensor-parallel" else rank))
    for _ in range(steps):
        x, y = torch.randn(16, IN, generator=data), torch.randn(16, OUT, generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # the global norm, on every rank
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad()  # every gradient: a ZeRO rank's optimizer owns only its partition
        if layout == "zero":  # each owner sends its updated partition to the others
            for i, p in enumerate(model.parameters()):
                dist.broadcast(p.data, src=i % world)
    if rank == 0:
        print(f"{layout}: {steps} steps on {world} ranks, scale {scaler.get_scale():g}, grad norm {float(norm):.6f}")
    dist.barrier()  # leave together: gloo may abort a rank whose peer tears the group down first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter finalization. destroy_process_group does not stop gloo's worker
    # threads while anything still holds the group, and under FSDP2 torch's DTensor sharding cache
    # keeps the mesh (and its group) alive to the end. A worker that releases a finished
    # collective's tensors while Python finalizes needs the GIL and aborts the process (SIGABRT,
    # "terminate called without an active exception"), after training has succeeded; the same
    # happens with torch's own GradScaler. Everything is flushed and the group is down by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
