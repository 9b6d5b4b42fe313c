"""Benchmark sweep: torch's step against tritonscale's over sizes, dtypes and layouts.

Question answered: at equal results, how much faster is a step's gradient handling, and how close
to the memory-bandwidth limit is it?

Variants (one optimizer step each, clipping at max_norm=1):

* ``torch``        unscale_ + clip_grad_norm_(foreach=True) + AdamW(foreach) step + update
* ``tritonscale``  clip_grad_norm_ (check -> finalize -> apply) + AdamW(foreach) step + update
* ``torch-fused``  as ``torch`` with AdamW(fused=True)
* ``fold``         tritonscale's clip_grad_norm_ folded into AdamW(fused=True) + step + update
* ``copy``         one copy of the gradient bytes: the device's bandwidth, as the limit

Gradient bytes per step (N elements of b bytes; the ``bytes_model`` field of each point):
torch 5Nb + Nb (AdamW reads the gradient) = 6Nb; tritonscale 3Nb + Nb = 4Nb; torch-fused 6Nb;
fold Nb + 2Nb (fused AdamW reads and writes back the unscaled gradient) = 3Nb; copy 2Nb. AdamW's own
parameter and moment traffic is the same for every variant and is not counted.

Layouts: ``flat`` (gradients as views of one buffer, tritonscale.flatten_grads_), ``200`` (200
tensors), ``2000x4K`` (2000 tensors of 4096 elements, whatever the size). float16 gradients:
torch refuses to unscale them, so only ``fold`` and ``copy`` run there.

On CPU (the default) the torch backend is timed in one process, interleaved, after a warm-up,
median of repeats. On a GPU (``--device cuda``) the Triton kernels run, autotuned, timed with
triton.testing.do_bench, and the kernel launches of one step are counted with torch.profiler.

    python bench/sweep.py --out out/sweep                       # CPU: 64K..64M elements
    python bench/sweep.py --device cuda --max-size 1073741824   # GPU: up to 1G elements
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from timing import interleaved, machine, split_sizes

import tritonscale

VARIANTS = ("torch", "tritonscale", "torch-fused", "fold", "copy")
GRAD_BYTES = {"torch": 6, "tritonscale": 4, "torch-fused": 6, "fold": 3, "copy": 2}  # x N * b
LAYOUTS = ("flat", "200", "2000x4K")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-size", type=int, default=2**16)
    parser.add_argument("--max-size", type=int, default=2**26)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=7)
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

    def __init__(self, variant: str, sizes: list[int], dtype, device, saved: list[torch.Tensor], flat: bool):
        self.variant = variant
        self.params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype, device=device)) for s in sizes]
        if flat:
            tritonscale.flatten_grads_(self.params)
        else:
            for p in self.params:
                p.grad = torch.empty_like(p)
        self.grads = [p.grad for p in self.params]
        self.saved = saved
        fused = variant in ("torch-fused", "fold")
        self.opt = torch.optim.AdamW(self.params, lr=0.0, fused=fused, foreach=None if fused else True)
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


def bench_point(numel: int, dtype: torch.dtype, layout: str, device: torch.device, repeats: int) -> dict:
    sizes = [4096] * 2000 if layout == "2000x4K" else split_sizes(numel, min(200, numel))
    numel = sum(sizes)
    torch.manual_seed(0)
    saved = [(torch.randn(s, device=device) * 2.0**16).to(dtype) for s in sizes]
    setups = {v: Setup(v, sizes, dtype, device, saved, layout == "flat") for v in VARIANTS[:-1] if runnable(v, dtype)}
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    fns = {name: setup.step for name, setup in setups.items()}
    fns["copy"] = lambda: dst.copy_(src)

    if device.type == "cuda":
        import triton.testing

        timed = {}
        for name, fn in fns.items():
            ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
            timed[name] = {"median_ms": ms[0], "q20_ms": ms[1], "q80_ms": ms[2]}
        launches = {name: launches_per_step(fn) for name, fn in fns.items()}
    else:

        def reset():
            for setup in setups.values():
                setup.reset()

        timed = interleaved(fns, repeats, reset, after=lambda name: None)
        launches = None
    bytes_per = torch.finfo(dtype).bits // 8
    point = {"numel": numel, "dtype": str(dtype).replace("torch.", ""), "layout": layout, "device": str(device)}
    for name, t in timed.items():
        grad_bytes = GRAD_BYTES[name] * numel * bytes_per
        point[name] = {**t, "grad_bytes": grad_bytes, "gb_per_s": grad_bytes / (t["median_ms"] * 1e-3) / 1e9}
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({p["dtype"] for p in points}, key=list(DTYPES).index)
    layouts = [lay for lay in LAYOUTS if any(p["layout"] == lay for p in points) and lay != "2000x4K"]
    fig, axes = plt.subplots(len(dtypes), len(layouts), figsize=(5 * len(layouts), 3.6 * len(dtypes)), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, layout in enumerate(layouts):
            ax = axes[i][j]
            series = sorted(
                (p for p in points if p["dtype"] == dtype and p["layout"] == layout), key=lambda p: p["numel"]
            )
            for name in VARIANTS:
                xs = [p["numel"] for p in series if name in p]
                if xs:
                    ax.plot(xs, [p[name]["median_ms"] for p in series if name in p], marker="o", label=name,
                            linestyle="--" if name == "copy" else "-")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, layout {layout}")
            ax.set_xlabel("gradient elements")
            ax.set_ylabel("ms per step (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None, progress=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    info = {**machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    plan = [(n, d, lay) for d in args.dtypes for lay in args.layouts
            for n in (sizes_between(args.min_size, args.max_size) if lay != "2000x4K" else [4096 * 2000])]  # fmt: skip
    print(f"sweep on {info['device']} ({info['processor']}, {info['threads']} threads, torch {info['torch']}); "
          "median ms per step; ratios: torch/tritonscale and torch-fused/fold")  # fmt: skip
    header = f"{'dtype':>8} {'layout':>8} {'elements':>10} " + " ".join(f"{v:>11}" for v in VARIANTS)
    print(header + f" {'ratio':>6} {'fold':>6}  grad MiB (torch/ours/fold)")
    points = []
    for k, (numel, dtype_name, layout) in enumerate(plan):
        p = bench_point(numel, DTYPES[dtype_name], layout, device, args.repeats)
        points.append(p)
        cells = " ".join(f"{p[v]['median_ms']:>11.3f}" if v in p else f"{'n/a':>11}" for v in VARIANTS)
        ratio = f"{p['ratio_tritonscale']:>6.2f}" if "ratio_tritonscale" in p else f"{'-':>6}"
        fold = f"{p['ratio_fold']:>6.2f}" if "ratio_fold" in p else f"{'-':>6}"
        mib = "/".join(f"{p[v]['grad_bytes'] / 2**20:.0f}" for v in ("torch", "tritonscale", "fold") if v in p)
        print(f"{dtype_name:>8} {layout:>8} {p['numel']:>10} {cells} {ratio} {fold}  {mib}")
        if progress is not None:
            progress(k + 1, len(plan))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps({"machine": info, "points": points}, indent=2))
    png = plot(points, args.out / "sweep.png", f"gradient handling per step on {info['device']}")
    print(f"wrote {args.out / 'sweep.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
