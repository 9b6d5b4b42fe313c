"""CPU benchmark: a whole training step's gradient handling with a fused AdamW.

Question answered: with a fused optimizer, how much faster is clip + step + update?

    torch:        scaler.unscale_(opt); clip_grad_norm_(params, 1.0, foreach=True); scaler.step(opt); scaler.update()
    tritonscale:  scaler.clip_grad_norm_(opt, 1.0); scaler.step(opt); scaler.update()

tritonscale folds the unscale and the clip into the optimizer (grad_scale = scale / clip_coef),
so it reads the gradients once in the check pass and once in AdamW, and writes them only inside
AdamW. Bytes over gradient memory (N elements, b bytes): torch 5Nb + AdamW's 2Nb (read + write back
the unscaled gradient) = 7Nb; tritonscale Nb + 2Nb = 3Nb. AdamW also streams its parameters and two
moments (about 6 N * 4 bytes for fp32), the same for both, so the whole-step ideal is ~1.3x.

Both variants are timed in one process, interleaved, with the gradients and the optimizer state
restored (untimed) before each repeat; learning rate 0 keeps parameters fixed.

    python bench/bench_step_cpu.py                      # 4M..64M fp32 elements in 200 tensors
    python bench/bench_step_cpu.py --sizes 4096 --tensors 3 --repeats 2   # smoke size
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from timing import interleaved, machine, split_sizes

import tritonscale


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**22, 2**24, 2**26])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=Path("out/bench_step_cpu.json"))
    return parser.parse_args(argv)


def bench_point(numel: int, n_tensors: int, repeats: int) -> dict:
    torch.manual_seed(0)
    sizes = split_sizes(numel, n_tensors)
    saved = [torch.randn(s).mul_(2.0**16) for s in sizes]
    runs = {}
    for name in ("torch", "tritonscale"):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
        opt = torch.optim.AdamW(params, lr=0.0, fused=True)
        kw = dict(init_scale=2.0**16, growth_interval=10**9)
        scaler = torch.amp.GradScaler("cpu", **kw) if name == "torch" else tritonscale.GradScaler("cpu", **kw)
        scaler.scale(torch.ones(()))
        for p, s in zip(params, saved):
            p.grad = s.clone()
        runs[name] = (params, opt, scaler)

    def torch_step():
        params, opt, scaler = runs["torch"]
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()

    def ours_step():
        _, opt, scaler = runs["tritonscale"]
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    def reset():
        for params, _, _ in runs.values():
            torch._foreach_copy_([p.grad for p in params], saved)

    timed = interleaved({"torch": torch_step, "tritonscale": ours_step}, repeats, reset, after=lambda name: None)
    point = {"numel": numel, "tensors": n_tensors, "dtype": "float32", **timed}
    point["bytes_model"] = {"torch": 7 * numel * 4, "tritonscale": 3 * numel * 4}
    point["ratio"] = timed["torch"]["median_ms"] / timed["tritonscale"]["median_ms"]
    return point


def main(argv=None) -> int:
    args = parse_args(argv)
    info = machine()
    print(f"clip + fused AdamW step + update, float32, {args.tensors} tensors, torch {info['torch']}, "
          f"{info['threads']} threads; median ms [20%, 80%]")  # fmt: skip
    print(f"{'elements':>10} {'torch ms':>22} {'tritonscale ms':>22} {'ratio':>6}")
    points = []
    for numel in args.sizes:
        p = bench_point(numel, min(args.tensors, numel), args.repeats)
        points.append(p)
        t, o = p["torch"], p["tritonscale"]
        print(f"{numel:>10} {t['median_ms']:>8.2f} [{t['q20_ms']:.2f}, {t['q80_ms']:.2f}] "
              f"{o['median_ms']:>8.2f} [{o['q20_ms']:.2f}, {o['q80_ms']:.2f}] {p['ratio']:>6.2f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "points": points}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
