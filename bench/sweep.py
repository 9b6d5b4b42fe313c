"""Benchmark sweep: torch's step against tritonscale's over sizes, dtypes and layouts.

Question answered: at equal results, how much faster is a whole step's gradient handling (clip +
optimizer step + scale update), and how close to the memory-bandwidth limit does it run?

Variants (one optimizer step each, clipping at max_norm=1, a power-of-two scale):

* ``torch``        unscale_ + clip_grad_norm_(foreach=True) + unfused-optimizer step + update
* ``tritonscale``  clip_grad_norm_ (check -> finalize -> apply) + unfused-optimizer step + update
* ``torch-fused``  as ``torch`` with AdamW(fused=True)
* ``fold``         tritonscale's clip_grad_norm_ folded into AdamW(fused=True) + step + update
* ``copy``         one copy of the gradient bytes: the device's bandwidth, as the limit (on a GPU;
                   on a CPU, see below)

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

Every timed step is an applied step: the saved gradients are ``randn`` times a scale chosen per
dtype (``grad_scale``: 2**16, float16 2**9), finite, and each scaler starts at that scale. After
timing, a point whose scale backed off (a skipped step: no optimizer work timed) is marked
``invalid``, printed as such instead of its rate, left out of the plot, and makes the script exit
with 1. On a GPU so is a variant above the copy's bandwidth (its bytes model counts bytes not
moved). On a CPU that is no defect: the copy moves its bytes once, out of place, while a step's
passes re-read buffers a CPU's caches partly hold (the gradients, just restored, among them), so
at sizes near the caches' a step can beat the copy's rate. Such a rate is printed with a ``*``
and listed in the point's ``above_copy``; it is a measurement, not a bound broken.

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
import math
import sys
from pathlib import Path

import torch
from sweep_plot import figure_title, plot
from timing import describe, format_ratio, interleaved, machine, split_sizes, spread_of

import tritonscale

VARIANTS = ("torch", "tritonscale", "torch-fused", "fold", "copy")
GRAD_PASSES = {"torch": 5, "tritonscale": 3, "torch-fused": 5, "fold": 1, "copy": 2}  # bytes / (N * b)
OPTIMIZER_PASSES = {"sgd": 5, "adamw": 7, "fused-adamw": 7, "fused-adamw-fold": 8}
LAYOUTS = ("flat", "200", "2000x4K")
LAYOUT_NAMES = {  # what the layout names in the table, the JSON and the plot stand for
    "flat": "one flat buffer (flatten_grads_)",
    "200": "200 tensors",
    "2000x4K": "2000 tensors of 4096 elements",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADROOM = 64  # |randn| of the saved gradients stays below 8; the scaled ones stay 8x more below the dtype's max


def grad_scale(dtype: torch.dtype) -> float:
    """The loss scale of a dtype's saved gradients (``randn * scale``) and of every variant's scaler:
    torch's 2**16 where that stays finite, else the largest power of two leaving ``HEADROOM`` below
    the dtype's max (float16: 2**9). An overflowed gradient would make every timed step a skipped
    one, which does no optimizer work (float16's max is 65504: ``randn * 2**16`` is inf there).

        >>> grad_scale(torch.float16), grad_scale(torch.bfloat16)
        (512.0, 65536.0)
    """
    return min(2.0**16, 2.0 ** math.floor(math.log2(torch.finfo(dtype).max / HEADROOM)))


def saved_grads(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The scaled gradients every variant's step starts from: ``randn * grad_scale(dtype)``, finite."""
    torch.manual_seed(0)
    return [(torch.randn(s, device=device) * grad_scale(dtype)).to(dtype) for s in sizes]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (interleaved medians) or cuda (do_bench, Triton kernels)")
    parser.add_argument("--min-size", type=int, default=2**16, help="smallest swept point, in elements")
    parser.add_argument("--max-size", type=int, default=2**26, help="largest swept point, in elements (sizes x4)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="gradient dtypes")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=LAYOUTS,
        default=list(LAYOUTS),
        help="flat: one flat buffer; 200: 200 tensors; 2000x4K: 2000 tensors of 4096 elements",
    )
    parser.add_argument(
        "--unfused", choices=["sgd", "adamw"], default="sgd", help="optimizer of the first two variants"
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per point (small points get more)")
    parser.add_argument("--out", type=Path, default=Path("out/sweep"), help="folder of sweep.json and sweep.png")
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)  # set by run_all
    parser.add_argument("--cut-note", help="run_all's line saying its re-planner cut this run below the planned "
                        "size: the plot's title ends with it")  # fmt: skip
    return parser.parse_args(argv)


def rounds_for(numel: int, repeats: int) -> int:
    """Timed rounds of a CPU point: small points are cheap and noisy (host overhead), so they get
    more than ``repeats``, up to 9x (at most 61)."""
    scaled = int(repeats * (2**24 / numel) ** 0.5)
    return max(repeats, min(scaled, 9 * repeats, 61))


def sizes_between(low: int, high: int) -> list[int]:
    """Powers of 4 times ``low`` up to ``high``: the sizes of the swept layouts."""
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
        self.init_scale = grad_scale(dtype)  # the saved gradients' scale: they unscale to randn
        kw = dict(init_scale=self.init_scale, growth_interval=10**9)
        ours = variant in ("tritonscale", "fold")
        self.scaler = tritonscale.GradScaler(device.type, **kw) if ours else torch.amp.GradScaler(device.type, **kw)
        self.scaler.scale(torch.ones((), device=device))
        self.reset()

    def reset(self) -> None:
        torch._foreach_copy_(self.grads, self.saved)

    def applied_every_step(self) -> bool:
        """True when no step so far was skipped: the scale never grows (``growth_interval``) and a
        skip backs it off (hysteresis 1), so any skip leaves it below ``init_scale``. Reads the host."""
        return self.scaler.get_scale() == self.init_scale

    def step(self) -> None:
        s = self.scaler
        if self.variant in ("tritonscale", "fold"):
            s.clip_grad_norm_(self.opt, 1.0)
        else:
            s.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        s.step(self.opt)
        s.update()


def runnable(variant: str, dtype: torch.dtype, device: torch.device) -> bool:
    """float16 gradients: only the fold (and the copy) take them; torch's GradScaler refuses to
    unscale them. bfloat16 on CUDA: torch's unscale kernel has no bfloat16 version there."""
    if dtype == torch.float16:
        return variant in ("fold", "copy")
    torch_unscales = variant in ("torch", "torch-fused")
    return not (dtype == torch.bfloat16 and device.type == "cuda" and torch_unscales)


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
    """One swept point: every runnable variant's step timed, its bytes model, GB/s and fraction of the
    copy's bandwidth, the speed-ups, and ``steps_applied`` / ``invalid`` (``check_point``)."""
    sizes = [4096] * 2000 if layout == "2000x4K" else split_sizes(numel, min(200, numel))
    numel = sum(sizes)
    saved = saved_grads(sizes, dtype, device)
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    variants = [v for v in VARIANTS[:-1] if runnable(v, dtype, device)]
    make = lambda name: Setup(name, sizes, dtype, device, saved, layout == "flat", unfused)
    timer = time_on_gpu if device.type == "cuda" else time_on_cpu
    timed, launches, applied = timer(variants, make, copy, repeats, numel)
    point = {"numel": numel, "dtype": str(dtype).replace("torch.", ""), "layout": layout, "device": str(device)}
    point["unfused_optimizer"] = unfused
    point["grad_scale"] = grad_scale(dtype)
    for name, t in timed.items():
        moved = bytes_model(name, unfused, numel, dtype)
        point[name] = {**t, "bytes": moved, "gb_per_s": moved / (t["median_ms"] * 1e-3) / 1e9}
        if launches is not None:
            point[name]["launches"] = launches[name]
    copy_rate = point["copy"]["gb_per_s"]
    for name in timed:
        point[name]["fraction_of_copy_bandwidth"] = point[name]["gb_per_s"] / copy_rate
    for key, base, ours in (("ratio_tritonscale", "torch", "tritonscale"), ("ratio_fold", "torch-fused", "fold")):
        if base not in timed:
            continue
        if "samples_ms" in timed[base]:  # the CPU's interleaved rounds: the speed-up is the spread's own
            point[f"{key}_spread"] = spread_of(timed, base, ours)  # median, inside the band drawn around it
            point[key] = point[f"{key}_spread"]["ratio"]
        else:  # do_bench on a GPU keeps no rounds: the medians' ratio, with no band
            point[key] = timed[base]["median_ms"] / timed[ours]["median_ms"]
    return check_point(point, applied, device)


def time_on_cpu(variants: list[str], make, copy, repeats: int, numel: int) -> tuple[dict, None, dict]:
    """Interleaved rounds in one process, the gradients restored before every call; (timed, None,
    steps_applied per variant)."""
    setups = {v: make(v) for v in variants}
    fns = {name: setup.step for name, setup in setups.items()} | {"copy": copy}

    def reset(name: str) -> None:
        if name in setups:
            setups[name].reset()

    timed = interleaved(fns, rounds_for(numel, repeats), reset)
    return timed, None, {name: setup.applied_every_step() for name, setup in setups.items()}


def time_on_gpu(variants: list[str], make, copy, repeats: int, numel: int) -> tuple[dict, dict, dict]:
    """triton.testing.do_bench per variant, one variant's state at a time (1G float32 elements of
    AdamW state are 16 GB); (timed, kernel launches, steps_applied per variant). Repeated steps
    without a reset shrink the gradients toward 0 (they stay finite); on a GPU the time does not
    depend on the values. do_bench's warm-up calls fill the autotune cache before the timed calls."""
    import triton.testing

    timed, launches, applied = {}, {}, {}
    for name in [*variants, "copy"]:
        setup = None if name == "copy" else make(name)
        fn = copy if setup is None else setup.step
        ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        timed[name] = {"median_ms": ms[0], "q20_ms": ms[1], "q80_ms": ms[2]}
        launches[name] = launches_per_step(fn)
        if setup is not None:
            applied[name] = setup.applied_every_step()
        del fn, setup
        torch.cuda.empty_cache()
    return timed, launches, applied


def check_point(point: dict, applied: dict[str, bool], device: torch.device) -> dict:
    """Record ``steps_applied`` (variant -> no timed step skipped) and, in ``invalid``, every reason
    the point cannot be trusted: a skipped step (timed without its optimizer work), or, on a GPU, a
    variant above the copy's bandwidth (its bytes model counts bytes it did not move: a bug, not a
    result). On a CPU such variants go to ``above_copy``: its caches hold part of what the passes
    re-read, which the one out-of-place copy cannot use (the module's docstring)."""
    point["steps_applied"] = applied
    invalid = [f"{name} skipped a timed step (its scale backed off from {point['grad_scale']:g})"
               for name, ok in applied.items() if not ok]  # fmt: skip
    above = [name for name in applied if point[name]["fraction_of_copy_bandwidth"] > 1.0]
    if device.type != "cpu":
        invalid += [f"{name} would run at {point[name]['fraction_of_copy_bandwidth']:.0%} of the copy's bandwidth: "
                    "its bytes model is wrong" for name in above]  # fmt: skip
        above = []
    point["invalid"], point["above_copy"] = invalid, above
    return point


def shown_rate(point: dict) -> str:
    """GB/s and fraction of the copy's bandwidth of the best variant, as printed; "INVALID" for a
    point ``check_point`` rejected (a skipped step, or a fraction above 100%: a bug, not a result)."""
    if point["invalid"]:
        return f"{'INVALID':>14}"
    best = max((v for v in VARIANTS[:-1] if v in point), key=lambda v: point[v]["gb_per_s"])
    mark = "*" if best in point.get("above_copy", ()) else " "
    return f"{point[best]['gb_per_s']:>6.1f} {point[best]['fraction_of_copy_bandwidth']:>7.0%}{mark}"


def shown_ratio(point: dict, key: str) -> str:
    """A speed-up as printed: with its p20-p80 spread and "within noise" where measured, '-' where none."""
    if f"{key}_spread" in point:
        return format_ratio(point[f"{key}_spread"])
    return f"{point[key]:.2f}" if key in point else "-"


def main(argv=None, progress=None) -> int:
    """Run the sweep; ``progress(done, total)`` is called after every point (run_all's bar)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    info = machine(device)
    plan = [(n, d, lay) for d in args.dtypes for lay in args.layouts
            for n in (sizes_between(args.min_size, args.max_size) if lay != "2000x4K" else [4096 * 2000])]  # fmt: skip
    print(f"sweep on {describe(info)}, unfused optimizer {args.unfused}, {args.repeats} repeats, sizes "
          f"{args.min_size}..{args.max_size}; median ms per step; speed-ups torch/tritonscale and torch-fused/fold "
          "with the p20-p80 of the per-round ratios; bytes model in MB; GB/s of the best variant")  # fmt: skip
    print("layouts: " + "; ".join(f"{k} = {v}" for k, v in LAYOUT_NAMES.items() if k in args.layouts))
    header = f"{'dtype':>8} {'layout':>8} {'elements':>10} " + " ".join(f"{v:>11}" for v in VARIANTS)
    print(header + f" {'speed-up [p20, p80]':>30} {'fold [p20, p80]':>30}  {'MB torch/ours/t-fused/fold':>26} "
          f"{'GB/s':>6} {'of copy':>7}")  # fmt: skip
    points = []
    for k, (numel, dtype_name, layout) in enumerate(plan):
        p = bench_point(numel, DTYPES[dtype_name], layout, device, args.repeats, args.unfused)
        points.append(p)
        cells = " ".join(f"{p[v]['median_ms']:>11.3f}" if v in p else f"{'n/a':>11}" for v in VARIANTS)
        ratio, fold = (f"{shown_ratio(p, key):>30}" for key in ("ratio_tritonscale", "ratio_fold"))
        mb = "/".join(f"{p[v]['bytes'] / 1e6:.3g}" if v in p else "-" for v in VARIANTS[:-1])
        print(f"{dtype_name:>8} {layout:>8} {p['numel']:>10} {cells} {ratio} {fold}  {mb:>26} {shown_rate(p)}")
        for reason in p["invalid"]:
            print(f"    INVALID POINT: {reason}")
        if progress is not None:
            progress(k + 1, len(plan))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "sweep.json"
    sizes = {"min_size": args.min_size, "max_size": args.max_size, "repeats": args.repeats, "dtypes": args.dtypes,
             "layouts": args.layouts}  # fmt: skip
    json_path.write_text(json.dumps({"machine": info, "unfused_optimizer": args.unfused, "sizes": sizes,
                                     "cut_note": args.cut_note, "layouts": LAYOUT_NAMES, "points": points},
                                    indent=2))  # fmt: skip
    png = plot(points, args.out / "sweep.png", figure_title(info, args.cut_note), VARIANTS, LAYOUT_NAMES)
    print(f"wrote {json_path} and {png}")
    if any(p.get("above_copy") for p in points):
        print(
            "* above the copy's rate: on a CPU a step's passes re-read buffers its caches partly hold, which the "
            "one out-of-place copy cannot use (a measurement, not a bound broken: bench/sweep.py's docstring)"
        )
    invalid = [p for p in points if p["invalid"]]
    for p in invalid:
        print(f"sweep: INVALID {p['dtype']} {p['layout']} {p['numel']}: {'; '.join(p['invalid'])}", file=sys.stderr)
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
