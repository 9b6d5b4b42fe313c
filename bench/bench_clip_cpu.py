"""CPU benchmark: tritonscale's fused unscale+check+clip (torch backend) vs torch's unscale_ + clip_grad_norm_.

Question answered: on a CPU, how much faster is the pre-optimizer section of a step?

    torch:        scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    tritonscale:  scaler.clip_grad_norm_(opt, 1.0)

Gradient memory traffic (bytes model, b bytes per element, N elements): torch reads+writes in
unscale_, reads in the norm, reads+writes in the clip = 5 N b; tritonscale reads in the check pass
and reads+writes in the apply pass = 3 N b, an ideal 1.67x at the bandwidth limit.

Both variants are timed in one process, interleaved (``timing.interleaved``) with the gradients restored (untimed)
before each repeat; medians and 20/80% quantiles are reported, the ratio torch/tritonscale with the
20/80% quantiles of its per-round ratios ("within noise" when they contain 1.0), and a JSON file of
every point (with the raw samples).

    python bench/bench_clip_cpu.py                     # 1M..64M fp32 elements in 200 tensors
    python bench/bench_clip_cpu.py --sizes 65536 --repeats 3 --tensors 4   # smoke size
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from timing import describe, format_ratio, interleaved, machine, split_sizes, spread_of

import tritonscale


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**22, 2**24, 2**26])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("out/bench_clip_cpu.json"))
    return parser.parse_args(argv)


def bench_point(numel: int, n_tensors: int, dtype: torch.dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    sizes = split_sizes(numel, n_tensors)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in sizes]
    saved = [torch.randn(s).mul_(2.0**16).to(dtype) for s in sizes]  # scaled gradients
    opt = torch.optim.SGD(params, lr=0.0)
    kw = dict(init_scale=2.0**16, growth_interval=10**9)
    theirs = torch.amp.GradScaler("cpu", **kw)
    ours = tritonscale.GradScaler("cpu", backend="torch", **kw)
    for scaler in (theirs, ours):
        scaler.scale(torch.ones(()))
    for p, s in zip(params, saved):
        p.grad = s.clone()
    grads = [p.grad for p in params]

    def torch_section():
        theirs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    def ours_section():
        ours.clip_grad_norm_(opt, 1.0)

    scalers = {"torch": theirs, "tritonscale": ours}
    timed = interleaved(
        {"torch": torch_section, "tritonscale": ours_section},
        repeats,
        reset=lambda name: torch._foreach_copy_(grads, saved),
        after=lambda name: scalers[name].update(),
    )
    bytes_per = torch.finfo(dtype).bits // 8
    point = {
        "numel": numel,
        "tensors": n_tensors,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": timed["torch"],
        "tritonscale": timed["tritonscale"],
        "bytes_model": {"torch": 5 * numel * bytes_per, "tritonscale": 3 * numel * bytes_per},
    }
    point["ratio_spread"] = spread_of(timed, "torch", "tritonscale")
    point["ratio"] = point["ratio_spread"]["ratio"]
    return point


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    info = machine()
    print(f"unscale+clip section, {args.dtype}, {args.tensors} tensors, on {describe(info)}; median ms [20%, 80%]")
    print(f"{'elements':>10} {'torch ms':>22} {'tritonscale ms':>22} {'torch/ours [p20, p80]':>32} "
          f"{'bytes torch/ours':>18}")  # fmt: skip
    points = []
    for numel in args.sizes:
        p = bench_point(numel, min(args.tensors, numel), dtype, args.repeats)
        points.append(p)
        t, o = p["torch"], p["tritonscale"]
        print(
            f"{numel:>10} {t['median_ms']:>8.2f} [{t['q20_ms']:.2f}, {t['q80_ms']:.2f}] "
            f"{o['median_ms']:>8.2f} [{o['q20_ms']:.2f}, {o['q80_ms']:.2f}] {format_ratio(p['ratio_spread']):>32} "
            f"{p['bytes_model']['torch'] / 2**20:>8.0f}/{p['bytes_model']['tritonscale'] / 2**20:.0f} MiB"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "points": points}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
