"""What combining the norm and found_inf across ranks costs, against the all-reduce alternatives.

Spawns ``--ranks`` gloo processes on this machine (CPU) and times, interleaved and in lockstep on
every rank:

* ``all-gather (ours)``: ``rank_combine.combine_check``: one ``all_gather_single`` of each rank's
  ``[norm, found_inf]`` row, combined in rank order (bitwise the same on every rank);
* ``2 all-reduces (Megatron)``: a MAX for found_inf, a SUM for the squared norm, then the root;
* ``all-gather alone``: the transport of ours, without the combination's small ops;
* ``1 all-reduce``: one SUM of ``[norm**2, found_inf]`` (one collective, but the float sum is in
  the transport's order, and a sum of squares can overflow float32 where a norm does not);
* ``clip, local`` / ``clip, partitioned``: a whole ``clip_grad_norm_`` over ``--numel`` elements in
  ``--tensors`` tensors per rank, without and with ``process_group``: what distribution adds.

Every timed call starts from a barrier (``lockstep``): without one, a rank that arrives first at a
collective times its wait for the other (still restoring its gradients, say), and the two ranks
reported one ratio 9x apart. The first round is a warm-up. Printed per rank: the median of each,
with the ranks' spread (largest median over smallest), and the ratios in ``RATIOS`` with the 20%
and 80% quantiles of their per-round ratios, marked "within noise" when those contain 1.0.

    python bench/collectives.py --out out/collectives     # JSON + a table on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timing import describe, format_ratio, interleaved, machine, split_sizes, spread_of

# (numerator, denominator): time ratios printed and stored per rank, > 1 where the numerator is slower
RATIOS = (
    ("all-gather (ours)", "2 all-reduces (Megatron)"),
    ("all-gather (ours)", "1 all-reduce"),
    ("clip, partitioned", "clip, local"),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/collectives"), help="folder of collectives.json")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes to spawn")
    parser.add_argument("--repeats", type=int, default=200, help="interleaved rounds")
    parser.add_argument("--numel", type=int, default=2**20, help="gradient elements per rank")
    parser.add_argument("--tensors", type=int, default=50, help="tensors the elements are split into")
    return parser.parse_args(argv)


def lockstep(variants: dict[str, Callable[[], None]], repeats: int, restore: Callable[[str], None],
             barrier: Callable[[], None]) -> dict[str, dict]:  # fmt: skip
    """``timing.interleaved`` with every rank starting each timed call together: ``restore(name)``
    (untimed, its length differs across ranks), then ``barrier()``, then the timed call. Example::

        timed = lockstep(variants, 200, restore, lambda: dist.barrier(group=group))
    """

    def reset(name: str) -> None:
        restore(name)
        barrier()

    return interleaved(variants, repeats, reset=reset)


def rank_spread(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Per variant: each rank's median (ms) and their spread, the largest over the smallest (1.0 when
    the ranks agree; a symmetric collective far from 1.0 means a rank timed something else)."""
    spreads = {}
    for name in per_rank[0]:
        medians = [ranks[name]["median_ms"] for ranks in per_rank]
        spreads[name] = {"median_ms_per_rank": medians, "spread": max(medians) / min(medians)}
    return spreads


def _rank_main(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    import datetime

    import tritonscale
    from tritonscale.passes.backends import CheckResult
    from tritonscale.passes.rank_combine import combine_check

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    group = dist.group.WORLD
    one = torch.ones(())
    local = CheckResult(torch.zeros(()), torch.tensor(3.0), one, one, plan=[])

    def megatron() -> None:
        found, squares = local.found_inf.clone(), local.norm.square()
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(squares, group=group)
        squares.sqrt()

    def one_all_reduce() -> None:
        row = torch.stack([local.norm.square(), local.found_inf])
        dist.all_reduce(row, group=group)
        row[0].sqrt()

    params = [torch.nn.Parameter(torch.zeros(n)) for n in split_sizes(args.numel, args.tensors)]
    grads = [torch.randn(p.shape) for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scalers = {
        "clip, local": tritonscale.GradScaler("cpu", backend="torch"),
        "clip, partitioned": tritonscale.GradScaler("cpu", backend="torch", process_group=group),
    }
    for scaler in scalers.values():
        scaler.scale(one)

    def restore(name: str) -> None:
        if name.startswith("clip"):
            for p, g in zip(params, grads):
                p.grad = g.clone()

    def clip(scaler) -> None:
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler._per_optimizer_states.clear()  # the next call starts a fresh iteration, no step

    row, rows = torch.zeros(2, dtype=torch.float64), torch.zeros(2 * world, dtype=torch.float64)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before 2.13
    variants = {
        "all-gather (ours)": lambda: combine_check(local, one, 2.0, 1.0, group),
        "all-gather alone": lambda: all_gather(rows, row, group=group),
        "2 all-reduces (Megatron)": megatron,
        "1 all-reduce": one_all_reduce,
        **{name: (lambda scaler=scaler: clip(scaler)) for name, scaler in scalers.items()},
    }
    timed = lockstep(variants, args.repeats, restore, lambda: dist.barrier(group=group))
    torch.save(timed, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None, progress=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(args.ranks, tmp, args), nprocs=args.ranks, start_method="spawn")
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.ranks)]
    info = machine(torch.device("cpu"))
    print(f"{args.ranks} gloo ranks on {describe(info)}; {args.repeats} interleaved repeats; medians (ms); "
          "ratios with the p20-p80 of the per-round ratios")  # fmt: skip
    agreement = rank_spread(per_rank)
    print(f"{'variant':28s} " + " ".join(f"rank {r:<5d}" for r in range(args.ranks)) + " max/min")
    for name, row in agreement.items():
        print(f"{name:28s} " + " ".join(f"{ms:<10.3f}" for ms in row["median_ms_per_rank"]) + f" {row['spread']:.2f}")
    ratios = []
    for num, den in RATIOS:
        spreads = [spread_of(ranks, num, den) for ranks in per_rank]
        ratios.append({"ratio": f"{num} / {den}", "per_rank": spreads})
        print(f"{num} / {den}: " + "; ".join(f"rank {r} {format_ratio(s)}" for r, s in enumerate(spreads)))
    result = {"machine": info, "ranks": args.ranks, "numel_per_rank": args.numel, "tensors": args.tensors,
              "repeats": args.repeats, "per_rank": per_rank, "rank_spread": agreement, "ratios": ratios}  # fmt: skip
    path = args.out / "collectives.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    if progress is not None:
        progress(1, 1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
