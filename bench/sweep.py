"""Benchmark sweep: torch's step against tritonscale's over sizes, dtypes and layouts.

Question answered: at equal results, how much faster is a whole step's gradient handling (clip +
optimizer step + scale update), and how close to the memory-bandwidth limit does it run?

Variants (one optimizer step each, clipping at max_norm=1, a power-of-two scale):

* ``torch``        unscale_ + clip_grad_norm_(foreach=True) + unfused-optimizer step + update
* ``tritonscale``  clip_grad_norm_ (check -> finalize -> apply) + unfused-optimizer step + update
* ``torch-fused``  as ``torch`` with AdamW(fused=True)
* ``fold``         tritonscale's clip_grad_norm_ folded into AdamW(fused=True) + step + update
* ``copy``         one copy of the gradient bytes: the device's bandwidth, as the limit

The unfused optimizer is SGD with momentum (foreach), whose step allocates no temporaries, so the
difference between the first two variants is the gradient handling; ``--unfused adamw`` uses
AdamW(foreach=True) instead (on CPU its temporaries make the timings bimodal).

Bytes model (the ``bytes`` field of each point, N elements of b bytes; parameters, gradients and
optimizer state share the dtype): gradient handling torch 5Nb (unscale_ reads+writes, the norm
reads, the clip reads+writes), tritonscale 3Nb (check reads, apply reads+writes), fold Nb (check
reads). Optimizer: SGD with momentum 5Nb (gradient, buffer, parameter), fused AdamW 7Nb (gradient,
parameter, two moments), 8Nb in the fold (it writes the unscaled gradient back). Totals: torch
10Nb, tritonscale 8Nb, torch-fused 12Nb, fold 9Nb, copy 2Nb. GB/s and the fraction of the copy's
bandwidth are computed from these totals.

Layouts: ``flat`` (gradients as views of one buffer, tritonscale.flatten_grads_), ``200`` (200
tensors), ``2000x4K`` (2000 tensors of 4096 elements, whatever the size). float16 gradients:
torch refuses to unscale them, so only ``fold`` and ``copy`` run there.

On CPU (the default) the torch backend is timed in one process, interleaved, after a warm-up,
median of repeats. On a GPU (``--device cuda``) the Triton kernels run, autotuned, timed with
triton.testing.do_bench (after a warm-up step that fills the autotune cache), and the kernel
launches of one step are counted with torch.profiler.

    python bench/sweep.py --out out/sweep                       # CPU: 64K..64M elements
    python bench/sweep.py --device cuda --max-size 1073741824   # GPU: up to 1G elements
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import figures
import torch
from timing import describe, interleaved, machine, split_sizes

import tritonscale

VARIANTS = ("torch", "tritonscale", "torch-fused", "fold", "copy")
GRAD_PASSES = {"torch": 5, "tritonscale": 3, "torch-fused": 5, "fold": 1, "copy": 2}  # bytes / (N * b)
OPTIMIZER_PASSES = {"sgd": 5, "adamw": 7, "fused-adamw": 7, "fused-adamw-fold": 8}
LAYOUTS = ("flat", "200", "2000x4K")
COLORS = {
    "torch": "tab:blue",
    "tritonscale": "tab:orange",
    "torch-fused": "tab:green",
    "fold": "tab:red",
    "copy": "tab:gray",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-size", type=int, default=2**16)
    parser.add_argument("--max-size", type=int, default=2**26)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument(
        "--unfused", choices=["sgd", "adamw"], default="sgd", help="optimizer of the first two variants"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("out/sweep"))
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)  # set by run_all
    return parser.parse_args(argv)


def sizes_between(low: int, high: int) -> list[int]:
    out, n = [], low
    while n <= high:
        out.append(n)
        n *= 4
    return out


class Setup:
    """One variant's model state: parameters with scaled gradients, its optimizer and scaler."""

    def __init__(
        self, variant: str, sizes: list[int], dtype, device, saved: list[torch.Tensor], flat: bool, unfused: str
    ):
        self.variant = variant
        self.params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype, device=device)) for s in sizes]
        if flat:
            tritonscale.flatten_grads_(self.params)
        else:
            for p in self.params:
                p.grad = torch.empty_like(p)
        self.grads = [p.grad for p in self.params]
        self.saved = saved
        # Learning rate 0: parameters stay fixed, so every repeat sees the same step.
        if variant in ("torch-fused", "fold"):
            self.opt = torch.optim.AdamW(self.params, lr=0.0, fused=True)
        elif unfused == "adamw":
            self.opt = torch.optim.AdamW(self.params, lr=0.0, foreach=True)
        else:
            self.opt = torch.optim.SGD(self.params, lr=0.0, momentum=0.9, foreach=True)
        kw = dict(init_scale=2.0**16, growth_interval=10**9)
        ours = variant in ("tritonscale", "fold")
        self.scaler = tritonscale.GradScaler(device.type, **kw) if ours else torch.amp.GradScaler(device.type, **kw)
        self.scaler.scale(torch.ones((), device=device))
        self.reset()

    def reset(self) -> None:
        torch._foreach_copy_(self.grads, self.saved)

    def step(self) -> None:
        s = self.scaler
        if self.variant in ("tritonscale", "fold"):
            s.clip_grad_norm_(self.opt, 1.0)
        else:
            s.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        s.step(self.opt)
        s.update()


def runnable(variant: str, dtype: torch.dtype) -> bool:
    return dtype != torch.float16 or variant in ("fold", "copy")


def launches_per_step(fn) -> int | None:
    """Kernel launches of one call of ``fn`` on a GPU (torch.profiler), None on CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def bytes_model(variant: str, unfused: str, numel: int, dtype: torch.dtype) -> int:
    """Bytes read + written per step over gradients, parameters and optimizer state (module docstring)."""
    optimizer = {"torch": unfused, "tritonscale": unfused, "torch-fused": "fused-adamw", "fold": "fused-adamw-fold"}
    passes = GRAD_PASSES[variant] + (OPTIMIZER_PASSES[optimizer[variant]] if variant in optimizer else 0)
    return passes * numel * (torch.finfo(dtype).bits // 8)


def bench_point(numel: int, dtype: torch.dtype, layout: str, device: torch.device, repeats: int, unfused: str) -> dict:
    sizes = [4096] * 2000 if layout == "2000x4K" else split_sizes(numel, min(200, numel))
    numel = sum(sizes)
    torch.manual_seed(0)
    saved = [(torch.randn(s, device=device) * 2.0**16).to(dtype) for s in sizes]
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    variants = [v for v in VARIANTS[:-1] if runnable(v, dtype)]
    flat = layout == "flat"

    if device.type == "cuda":
        import triton.testing

        # One variant's state at a time (1G fp32 elements of AdamW state are 16 GB). Repeated steps
        # without a reset shrink the gradients toward 0; on a GPU the time does not depend on the
        # values. do_bench's warm-up calls fill the autotune cache before the timed calls.
        timed, launches = {}, {}
        for name in [*variants, "copy"]:
            fn = copy if name == "copy" else Setup(name, sizes, dtype, device, saved, flat, unfused).step
            ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
            timed[name] = {"median_ms": ms[0], "q20_ms": ms[1], "q80_ms": ms[2]}
            launches[name] = launches_per_step(fn)
            del fn
            torch.cuda.empty_cache()
    else:
        setups = {v: Setup(v, sizes, dtype, device, saved, flat, unfused) for v in variants}
        fns = {name: setup.step for name, setup in setups.items()} | {"copy": copy}

        def reset(name: str) -> None:
            if name in setups:
                setups[name].reset()

        # Small points are cheap and noisy (host overhead): give them more repeats.
        scaled = int(repeats * (2**24 / numel) ** 0.5)
        timed = interleaved(fns, max(repeats, min(scaled, 9 * repeats, 61)), reset)
        launches = None
    point = {"numel": numel, "dtype": str(dtype).replace("torch.", ""), "layout": layout, "device": str(device)}
    point["unfused_optimizer"] = unfused
    for name, t in timed.items():
        moved = bytes_model(name, unfused, numel, dtype)
        point[name] = {**t, "bytes": moved, "gb_per_s": moved / (t["median_ms"] * 1e-3) / 1e9}
        if launches is not None:
            point[name]["launches"] = launches[name]
    copy_rate = point["copy"]["gb_per_s"]
    for name in timed:
        point[name]["fraction_of_copy_bandwidth"] = point[name]["gb_per_s"] / copy_rate
    if "torch" in timed:
        point["ratio_tritonscale"] = timed["torch"]["median_ms"] / timed["tritonscale"]["median_ms"]
    if "torch-fused" in timed:
        point["ratio_fold"] = timed["torch-fused"]["median_ms"] / timed["fold"]["median_ms"]
    return point


def plot(points: list[dict], path: Path, title: str) -> Path:
    """Per dtype (rows): median time vs size for each layout, and the speed-ups vs size."""
    plt = figures.pyplot()
    dtypes = sorted({p["dtype"] for p in points}, key=list(DTYPES).index)
    layouts = [lay for lay in LAYOUTS if any(p["layout"] == lay for p in points)]
    swept = [lay for lay in layouts if lay != "2000x4K"]  # 2000x4K is one point: speed-up panel only
    cols = len(swept) + 1
    fig, axes = plt.subplots(len(dtypes), cols, figsize=(5.2 * cols, 3.8 * len(dtypes)), squeeze=False)
    for row, dtype in zip(axes, dtypes):
        for ax, layout in zip(row, swept):
            series = sorted(
                (p for p in points if p["dtype"] == dtype and p["layout"] == layout), key=lambda p: p["numel"]
            )
            for name in VARIANTS:
                have = [p for p in series if name in p]
                if have:
                    ax.plot([p["numel"] for p in have], [p[name]["median_ms"] for p in have], marker="o", ms=3,
                            label=name, color=COLORS[name], linestyle="--" if name == "copy" else "-")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, layout {layout}: time per step")
            ax.set_xlabel("gradient elements")
            ax.set_ylabel("ms (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        ax = row[-1]
        drawn = False
        for layout, marker in zip(layouts, "os^"):
            series = sorted(
                (p for p in points if p["dtype"] == dtype and p["layout"] == layout), key=lambda p: p["numel"]
            )
            for key, name in (("ratio_tritonscale", "tritonscale"), ("ratio_fold", "fold")):
                have = [p for p in series if key in p]
                if have:
                    label = f"{'torch / tritonscale' if name == 'tritonscale' else 'torch-fused / fold'} ({layout})"
                    ax.plot([p["numel"] for p in have], [p[key] for p in have], marker=marker, ms=4,
                            color=COLORS[name], linestyle="-" if layout == "flat" else ":", label=label)  # fmt: skip
                    drawn = True
        ax.set_title(f"{dtype}: speed-up (>1: tritonscale faster)")
        if drawn:
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("gradient elements")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        else:  # float16: torch's GradScaler refuses to unscale float16 gradients, so there is no baseline
            ax.text(0.5, 0.5, "no torch baseline:\ntorch.amp.GradScaler refuses\nfloat16 gradients", ha="center",
                    va="center", transform=ax.transAxes)  # fmt: skip
            ax.set_axis_off()
    return figures.save(fig, path, title)


def main(argv=None, progress=None) -> int:
    """Run the sweep; ``progress(done, total)`` is called after every point (run_all's bar)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    info = machine(device)
    plan = [(n, d, lay) for d in args.dtypes for lay in args.layouts
            for n in (sizes_between(args.min_size, args.max_size) if lay != "2000x4K" else [4096 * 2000])]  # fmt: skip
    print(f"sweep on {describe(info)}, "
          f"unfused optimizer {args.unfused}; median ms per step; speed-ups torch/tritonscale and torch-fused/fold; "
          "bytes model in MB; GB/s of the best variant")  # fmt: skip
    header = f"{'dtype':>8} {'layout':>8} {'elements':>10} " + " ".join(f"{v:>11}" for v in VARIANTS)
    print(header + f" {'speed-up':>8} {'fold':>6}  {'MB torch/ours/t-fused/fold':>26} {'GB/s':>6} {'of copy':>7}")
    points = []
    for k, (numel, dtype_name, layout) in enumerate(plan):
        p = bench_point(numel, DTYPES[dtype_name], layout, device, args.repeats, args.unfused)
        points.append(p)
        cells = " ".join(f"{p[v]['median_ms']:>11.3f}" if v in p else f"{'n/a':>11}" for v in VARIANTS)
        ratio = f"{p['ratio_tritonscale']:>8.2f}" if "ratio_tritonscale" in p else f"{'-':>8}"
        fold = f"{p['ratio_fold']:>6.2f}" if "ratio_fold" in p else f"{'-':>6}"
        mb = "/".join(f"{p[v]['bytes'] / 1e6:.3g}" if v in p else "-" for v in VARIANTS[:-1])
        best = max((v for v in VARIANTS[:-1] if v in p), key=lambda v: p[v]["gb_per_s"])
        rate = f"{p[best]['gb_per_s']:>6.1f} {p[best]['fraction_of_copy_bandwidth']:>7.0%}"
        print(f"{dtype_name:>8} {layout:>8} {p['numel']:>10} {cells} {ratio} {fold}  {mb:>26} {rate}")
        if progress is not None:
            progress(k + 1, len(plan))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "sweep.json"
    json_path.write_text(json.dumps({"machine": info, "unfused_optimizer": args.unfused, "points": points}, indent=2))
    png = plot(points, args.out / "sweep.png", f"clip + optimizer step + scale update on {describe(info)}")
    print(f"wrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
