"""The performance issues' headline ratios, from one run, printed one line per ratio.

1. Flat pre-optimizer section against the single-tensor ideal: 2000 gradients of 4096 float32
   elements, a scaled SGD optimizer. ``ours`` = ``scaler.clip_grad_norm_(opt, 1.0)``; ``torch`` =
   ``unscale_`` + ``torch.nn.utils.clip_grad_norm_(foreach=True)``; ``ideal`` = one
   ``torch.linalg.vector_norm(buffer)`` + one ``buffer.mul_(factor)`` over the whole buffer (what
   one hand-written tensor costs). Printed: ``ideal/ours`` (target >= 0.85) and ``torch/ours``, for
   two layouts: views of a ``tritonscale.flatten_grads_`` buffer, and a DDP-like bucket (every
   gradient assigned as ``bucket[a:b].view(shape)``, back to back, no padding, no flatten_grads_);
   then the same elements as one flat parameter whose ``.grad`` is the buffer (what Megatron-style
   flat parameters give an optimizer): the two per-parameter layouts pay for proving, every step,
   that 2000 ``.grad`` are still the buffer's views (``grads/flat_grads.py``); one tensor has
   nothing to prove, so its line is the section's limit on this machine. For those two layouts a
   third line gives the target's reach: ``ideal/(ideal + reads)``, where ``reads`` reads every
   ``.grad`` once (the least any per-step proof reads), i.e. the most ``ideal/ours`` can be while
   the gradients are proved, even if everything else cost what the ideal does.
   The gradients are restored (untimed) before every repeat; the scalers update after (untimed);
   once, untimed, the gradients each leaves are compared with torch's (max relative difference).
2. A tiny whole step against torch: one parameter of 1024 elements, the whole scaled step
   (forward, ``scale(loss).backward()``, clip, step, update, zero_grad) with AdamW(fused=True), and
   again with plain SGD (``torch.optim.SGD``: the optimizer's own time least, the scaler's most);
   torch's GradScaler (``unscale_`` + ``clip_grad_norm_``) against ours (``clip_grad_norm_``):
   ``torch/ours`` (target >= 1.0 off the CPU). Then each policy knob (``hysteresis=2``,
   ``skip_norm_factor=5.0``, ``max_consecutive_skips=10``) against ours with the defaults (target
   off the CPU: each costs <= 10%). On the CPU bar 2 is host time and has no target: no one trains
   fp16 there, and the rule runs as the tensor ops a GPU's traced step runs. Each sample is 20 steps
   (host overhead: per-step times are ~0.1 ms).
3. 16M float32 elements in 200 tensors, AdamW(fused=True), the full scaled step without forward
   and backward: torch (``unscale_`` + clip + step + update) against ours (the fold: clip + step +
   update): ``torch/ours`` (the issue quoted 1.49x).
4. (CPU only) Host time per phase on the GPU paths against torch's GradScaler: ``bench/host_time.py``
   in its own process (it needs Triton's interpreter for ``backend="triton"``, every launch replaced
   by a no-op that counts): ``ours/torch`` per phase (target <= 1.0) with our Triton launches beside
   it, at 1 and 148 tensors, defaults and ``hysteresis=2, skip_norm_factor=5.0``.

All variants of a bar run interleaved (``timing.interleaved``), medians of ``--repeats`` repeats (bar 2: 10x as many
samples) after one warm-up round. Every ratio is printed with its spread, the 20% and 80% quantiles
of the per-round ratios, and marked "within noise" when the spread contains 1.0. JSON with the
machine, every quantile, the raw samples and each ratio's spread goes to ``--out``.

    python bench/bars.py                      # CPU, ~1 minute
    python bench/bars.py --quick --out /tmp/bars.json   # tiny sizes (the smoke test)
    python bench/bars.py --bars 2 --threads 1 --out /tmp/bar2.json   # bar 2 alone, one thread (a shared machine)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import torch
from timing import describe, format_ratio, interleaved, machine, quantiles, split_sizes, spread_of, write_results

import tritonscale

MAX_NORM = 1.0
SCALE = 2.0**16
KNOBS = {"hysteresis=2": dict(hysteresis=2), "skip_norm_factor=5.0": dict(skip_norm_factor=5.0),
         "max_consecutive_skips=10": dict(max_consecutive_skips=10)}  # fmt: skip
TINY_STEPS_PER_SAMPLE = 20
_GRAD = attrgetter("grad")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed repeats per variant (bar 2: 10x samples)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats (the smoke test)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto", help="tritonscale's")
    parser.add_argument("--out", type=Path, default=Path("out/bars.json"))
    parser.add_argument("--bars", type=int, nargs="+", choices=[1, 2, 3, 4], default=[1, 2, 3, 4], help="which bars")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    # (tensors, elements per tensor) of bar 1, elements of bar 2's parameter, (elements, tensors) of bar 3
    args.bar1 = (16, 256) if args.quick else (2000, 4096)
    args.bar2 = 1024
    args.bar3 = (2**16, 8) if args.quick else (2**24, 200)
    return args


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """``fn`` followed by a device synchronize on CUDA (so the host clock sees the kernels' end)."""
    if device.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(device))


def scaler(kind: str, device: torch.device, backend: str, **knobs):
    kw = dict(init_scale=SCALE, growth_interval=10**9)
    if kind == "torch":
        s = torch.amp.GradScaler(device.type, **kw)
    else:
        s = tritonscale.GradScaler(device.type, backend=backend, **kw, **knobs)
    s.scale(torch.ones((), device=device))  # makes the scale tensor
    return s


def target_verdict(spread: dict, target: str) -> bool | None:
    """Whether a ratio meets ``target`` (``">= 0.85"``, ``"<= 1.10"``) beyond this run's noise: True
    when its whole p20-p80 band is on the target's side, False when the whole band misses it, None
    when the band straddles it (the median alone cannot tell). ``target_verdict({"q20": 0.9,
    "q80": 1.2}, ">= 1.0") is None``."""
    op, value = target.split()
    low, high = (spread["q20"], spread["q80"]) if op == ">=" else (-spread["q80"], -spread["q20"])
    bound = float(value) if op == ">=" else -float(value)
    return True if low >= bound else False if high < bound else None


def ratio_line(bar: str, what: str, num: str, den: str, timed: dict, target: str | None = None, note: str = "") -> dict:
    """One printed line (and its JSON record): the median of the per-round ratios with their p20-p80
    spread over the interleaved rounds (``timing.ratio_spread``; "within noise" when the spread contains 1.0),
    and the medians."""
    a, b = timed[num]["median_ms"], timed[den]["median_ms"]
    spread = spread_of(timed, num, den)
    ratio = spread["ratio"]
    ok = None if target is None else target_verdict(spread, target)
    shown = {True: "met", False: "MISSED", None: "not clear: its p20-p80 straddles it"}
    verdict = note if target is None else f" (target {target}: {shown[ok]})"
    print(f"{bar} {what}: {num}/{den} = {format_ratio(spread, 3)}{verdict}  [median ms: {num} {a:.4g}, {den} {b:.4g}]")
    return {"bar": bar, "what": what, "ratio": f"{num}/{den}", "value": ratio, "spread": spread, "target": target,
            "met": ok, "numerator": timed[num], "denominator": timed[den]}  # fmt: skip


# ----------------------------------------------------------------------------- bar 1


def bar1(args, device: torch.device) -> list[dict]:
    n_tensors, each = args.bar1
    torch.manual_seed(0)
    saved = torch.randn(n_tensors * each, device=device).mul_(SCALE)  # scaled gradients, back to back
    layouts = ("flatten_grads_", "DDP-like bucket", "one flat parameter")
    return [line for layout in layouts for line in bar1_layout(args, device, saved, layout)]


def bar1_layout(args, device: torch.device, saved: torch.Tensor, layout: str) -> list[dict]:
    n_tensors, each = args.bar1
    params = [torch.nn.Parameter(torch.zeros(64, each // 64, device=device)) for _ in range(n_tensors)]
    if layout == "one flat parameter":  # the optimizer holds one tensor: its .grad is the buffer
        params = [torch.nn.Parameter(torch.zeros(n_tensors * each, device=device))]
        buffer = params[0].grad = torch.zeros(n_tensors * each, device=device)
    elif layout == "flatten_grads_":
        (buffer,) = tritonscale.flatten_grads_(params)
    else:  # a DDP-like bucket: views back to back in one storage, no padding, no flatten_grads_
        buffer = torch.empty(n_tensors * each, device=device)
        for k, p in enumerate(params):
            p.grad = buffer[k * each : (k + 1) * each].view(p.shape)
    assert buffer.numel() == saved.numel()  # 4096 is a multiple of 16: flatten_grads_ pads nothing
    opt = torch.optim.SGD(params, lr=0.0)
    theirs, ours = scaler("torch", device, args.backend), scaler("ours", device, args.backend)
    inv = 1.0 / SCALE

    def torch_section():
        theirs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)

    def ideal():
        norm = torch.linalg.vector_norm(buffer)
        buffer.mul_(torch.clamp(MAX_NORM / (norm * inv + 1e-6), max=1.0) * inv)

    variants = {"ideal": ideal, "ours": lambda: ours.clip_grad_norm_(opt, MAX_NORM), "torch": torch_section}
    updates = {"torch": theirs.update, "ours": ours.update, "ideal": lambda: None, "reads": lambda: None}
    if len(params) > 1:  # the least any per-step proof of the views does: read every .grad once
        variants["reads"] = lambda: list(map(_GRAD, params))
    timed = interleaved(
        {name: synced(fn, device) for name, fn in variants.items()},
        args.repeats,
        reset=lambda name: buffer.copy_(saved),
        after=lambda name: updates[name](),
    )
    # Untimed: how far each variant's gradients (unscaled, clipped) are from torch's. One float32 norm
    # over the whole buffer accumulates more rounding than torch's per-tensor norms.
    results = {}
    for name, fn in variants.items():
        if name == "reads":
            continue
        buffer.copy_(saved)
        fn()
        updates[name]()
        results[name] = buffer.clone()
    reference = results["torch"]
    diff = {name: ((g - reference).abs().max() / reference.abs().max()).item() for name, g in results.items()}
    what = f"pre-optimizer section, {n_tensors}x{each} float32 grads, {layout}"
    lines = [ratio_line("1", what, "ideal", "ours", timed, ">= 0.85"), ratio_line("1", what, "torch", "ours", timed)]
    for line in lines:
        line["max_rel_diff_vs_torch"] = diff
    if "reads" in timed:
        lines.append(reach_line(what, timed))
    print(f"1 {what}: gradients' max relative difference from torch's: ours {diff['ours']:.1e}, "
          f"ideal {diff['ideal']:.1e}")  # fmt: skip
    return lines


def reach_line(what: str, timed: dict) -> dict:
    """Bar 1's reach with per-parameter gradients: ``ideal/(ideal + reads)``, round by round, where
    ``reads`` is reading every parameter's ``.grad`` once (what any proof that the views are still
    the gradients reads at least, every step). It is the most ``ideal/ours`` can be if all else ours
    does cost what the ideal does; below the target, the target is out of reach of any such proof."""
    summed = [a + b for a, b in zip(timed["ideal"]["samples_ms"], timed["reads"]["samples_ms"])]
    timed["(ideal + reads)"] = {**quantiles([t / 1e3 for t in summed]), "samples_ms": summed}
    reads = timed["reads"]["median_ms"]
    return ratio_line("1", f"{what}, its reach: ideal with every .grad read once ({reads:.3g} ms)",
                      "ideal", "(ideal + reads)", timed, ">= 0.85")  # fmt: skip


# ----------------------------------------------------------------------------- bar 2


#: bar 2's optimizers: the fused AdamW, and plain SGD (no foreach, no fused: the optimizer's own cost least)
TINY_OPTIMIZERS = {"AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                   "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3)}  # fmt: skip


class TinyStep:
    """One 1024-element parameter, an optimizer of ``TINY_OPTIMIZERS``, the whole scaled step."""

    def __init__(self, kind: str, numel: int, device: torch.device, backend: str, optimizer: str, **knobs):
        torch.manual_seed(0)
        self.kind = kind
        self.p = torch.nn.Parameter(torch.randn(numel, device=device))
        self.x = torch.randn(numel, device=device)
        self.opt = TINY_OPTIMIZERS[optimizer]([self.p])
        self.scaler = scaler(kind, device, backend, **knobs)

    def step(self) -> None:
        s = self.scaler
        loss = (self.p * self.x).sum()
        s.scale(loss).backward()
        if self.kind == "torch":
            s.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_([self.p], MAX_NORM)
        else:
            s.clip_grad_norm_(self.opt, MAX_NORM)
        s.step(self.opt)
        s.update()
        self.opt.zero_grad()

    def steps(self) -> None:
        for _ in range(TINY_STEPS_PER_SAMPLE):
            self.step()


def scaled_timing(timed: dict, factor: float) -> dict:
    """An ``interleaved`` entry (quantiles and ``samples_ms``) with every time multiplied by ``factor``."""
    return {k: [t * factor for t in v] if isinstance(v, list) else v * factor for k, v in timed.items()}


def bar2(args, device: torch.device) -> list[dict]:
    fused, sgd = TINY_OPTIMIZERS
    setups = {"torch": TinyStep("torch", args.bar2, device, args.backend, fused),
              "ours": TinyStep("ours", args.bar2, device, args.backend, fused),
              "torch, SGD": TinyStep("torch", args.bar2, device, args.backend, sgd),
              "ours, SGD": TinyStep("ours", args.bar2, device, args.backend, sgd)}  # fmt: skip
    for knob, kw in KNOBS.items():
        setups[f"ours+{knob}"] = TinyStep("ours", args.bar2, device, args.backend, fused, **kw)
    timed = interleaved(
        {name: synced(s.steps, device) for name, s in setups.items()}, 10 * args.repeats, reset=lambda name: None
    )
    per_step = {name: scaled_timing(t, 1 / TINY_STEPS_PER_SAMPLE) for name, t in timed.items()}
    what = f"tiny whole step, 1 parameter of {args.bar2} elements, {fused}"
    # A tiny step is host time: on the CPU (where no one trains in fp16, and the rule runs as the
    # tensor ops a GPU's traced step runs) the ratios are printed without a target.
    on_cpu = device.type == "cpu"
    note = " (host time on the CPU: no target)" if on_cpu else ""
    step_target, knob_target = (None, None) if on_cpu else (">= 1.0", "<= 1.10")
    sgd_what = what.replace(fused, sgd)
    lines = [
        ratio_line("2", what, "torch", "ours", per_step, step_target, note),
        ratio_line("2", sgd_what, "torch, SGD", "ours, SGD", per_step, step_target, note),
    ]
    for knob in KNOBS:
        lines.append(
            ratio_line("2", f"{what}, {knob} vs defaults", f"ours+{knob}", "ours", per_step, knob_target, note)
        )
    return lines


# ----------------------------------------------------------------------------- bar 3


def bar3(args, device: torch.device) -> list[dict]:
    numel, n_tensors = args.bar3
    sizes = split_sizes(numel, n_tensors)
    torch.manual_seed(0)
    saved = [torch.randn(s, device=device).mul_(SCALE) for s in sizes]
    setups = {}
    for kind in ("torch", "ours"):
        params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in sizes]
        for p, g in zip(params, saved):
            p.grad = g.clone()
        # Learning rate 0: the parameters stay fixed, so every repeat sees the same step.
        opt = torch.optim.AdamW(params, lr=0.0, fused=True)
        setups[kind] = (params, opt, scaler(kind, device, args.backend))

    def step(kind: str) -> None:
        params, opt, s = setups[kind]
        if kind == "torch":
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        else:
            s.clip_grad_norm_(opt, MAX_NORM)
        s.step(opt)
        s.update()

    timed = interleaved(
        {kind: synced(lambda kind=kind: step(kind), device) for kind in setups},
        args.repeats,
        reset=lambda kind: torch._foreach_copy_([p.grad for p in setups[kind][0]], saved),
    )
    what = f"{numel / 2**20:g}M float32 in {n_tensors} tensors, AdamW(fused=True), scaler + step + update"
    return [ratio_line("3", what, "torch", "ours", timed, note=" (the issue measured 1.49x)")]


# ----------------------------------------------------------------------------- bar 4


def bar4(args, device: torch.device) -> list[dict]:
    """``host_time.py`` in its own process (it needs Triton's interpreter, set before triton is
    imported, which would run bars 1-3's "auto" kernels through it): its printed lines, echoed,
    and its ratios."""
    if device.type != "cpu":
        return []  # a proxy for a GPU host's time: on a GPU, bar 2 and train_step.py measure the host itself
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "host_time.json"
        command = [sys.executable, str(Path(__file__).with_name("host_time.py")), "--out", str(out),
                   "--repeats", str(args.repeats)] + (["--quick"] if args.quick else [])  # fmt: skip
        done = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"bench/host_time.py failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        print("\n".join(line for line in done.stdout.splitlines() if line.startswith("4 ")))
        return json.loads(out.read_text())["ratios"]


def main(argv=None, progress=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.threads is not None:  # one thread on a shared machine: no parallel region waits for a busy core
        torch.set_num_threads(args.threads)
    try:
        info = machine(device)
        print(f"bars on {describe(info)}; {args.repeats} interleaved repeats per variant, medians")
        lines = []
        bars = [bar for k, bar in enumerate((bar1, bar2, bar3, bar4), 1) if k in args.bars]
        for k, bar in enumerate(bars):
            lines += bar(args, device)
            if progress is not None:
                progress(k + 1, len(bars))
    finally:
        torch.set_num_threads(threads)
    write_results(args.out, info, args, ratios=lines)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
