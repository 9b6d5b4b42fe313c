"""Mixed-precision training demo on CPU: tritonscale's fused clip next to torch's GradScaler.

Trains a small MLP regression with float16 autocast and global-norm clipping twice from the same
seed -- once with torch.amp.GradScaler + unscale_ + clip_grad_norm_, once with
tritonscale.GradScaler.clip_grad_norm_ -- and prints the scale, gradient norm and skipped steps of
each step. The initial scale is deliberately too high, so the first steps overflow and the scale
backs off, then grows again every ``--growth-interval`` good steps.

    python bench/train_demo.py                    # torch backend (plain CPU)
    python bench/train_demo.py --backend triton   # the Triton kernels, through the interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--init-scale", type=float, default=2.0**24)
    parser.add_argument("--growth-interval", type=int, default=5)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=256)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "triton":
        # Must happen before triton is imported: it decides at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import tritonscale

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, args.width),
            torch.nn.GELU(),
            torch.nn.Linear(args.width, args.width),
            torch.nn.GELU(),
            torch.nn.Linear(args.width, 1),
        )
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    data_gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(64, 1, generator=data_gen)
    batches = []
    for _ in range(args.steps):
        x = torch.randn(128, 64, generator=data_gen)
        batches.append((x, torch.tanh(x @ w_true) + 0.1 * torch.randn(128, 1, generator=data_gen)))

    def run(ours: bool):
        model, opt = make()
        kw = dict(init_scale=args.init_scale, growth_interval=args.growth_interval)
        scaler = (
            tritonscale.GradScaler("cpu", backend=args.backend, **kw) if ours else torch.amp.GradScaler("cpu", **kw)
        )
        rows, start = [], time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            if ours:
                norm = scaler.clip_grad_norm_(opt, args.max_norm)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            scaler.step(opt)
            scaler.update()
            rows.append((float(loss.detach()), scale, float(norm), scaler.get_scale() < scale))
        return rows, time.perf_counter() - start

    ours, ours_s = run(True)
    ref, ref_s = run(False)
    backend = tritonscale.backends.resolve_backend(args.backend, torch.device("cpu")).name
    print(f"tritonscale.GradScaler (backend={backend}) vs torch.amp.GradScaler, fp16 autocast, clip {args.max_norm}")
    header = f"{'step':>4} {'loss':>10} {'scale':>10} {'grad norm':>11} {'skipped':>7}"
    print(f"{header} | {'torch loss':>10} {'torch norm':>11}")
    for i, ((loss, scale, norm, skipped), (t_loss, _, t_norm, _)) in enumerate(zip(ours, ref)):
        ours_cols = f"{i:>4} {loss:>10.5f} {scale:>10.0f} {norm:>11.5g} {'yes' if skipped else '':>7}"
        print(f"{ours_cols} | {t_loss:>10.5f} {t_norm:>11.5g}")
    same_scales = [r[1] for r in ours] == [r[1] for r in ref]
    max_loss_diff = max(abs(a[0] - b[0]) for a, b in zip(ours, ref))
    print(
        f"skipped steps: {sum(r[3] for r in ours)} (torch: {sum(r[3] for r in ref)}); "
        f"scale trajectory identical to torch: {same_scales}; max |loss - torch loss| = {max_loss_diff:.3g}"
    )
    print(f"wall time: tritonscale {ours_s:.2f} s, torch {ref_s:.2f} s (whole loop on this CPU)")
    return 0 if same_scales else 1


if __name__ == "__main__":
    sys.exit(main())
