"""Host time and device launches per phase of a step on a GPU, ours beside torch's GradScaler.

The GPU counterpart of ``host_time.py`` (which stands in for a GPU host on the CPU): the real
kernels on the device, each phase of the scaled step timed on the host (the time until the call
returns, its launches queued, not run), and its device launches counted by torch's profiler
(kernels, copies and memsets: what the GPU runs). Phases: ``scale`` (of the loss), ``clip`` (ours
``clip_grad_norm_``; torch's ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``), ``step``
(AdamW(fused=True), a tensor lr), ``update``, ``lr`` (ours ``SkipAwareLR.step``; torch's
``LambdaLR.step``). Cases: 1 tensor of 1024 float32 elements and 148 tensors of 64 (GPT-2 small's
tensor count), each with the default policy and ``hysteresis=2, skip_norm_factor=5.0``.

Whether our launches go through Triton's JIT path or the pre-bound launcher is the process's
environment (``SWITCH``, read by ``tritonscale.kernels``): ``gpu_check.py`` runs this script once
with it and once without, and the results name which (``bound_launch``). The device is synchronized
before every timed phase (untimed), so each starts with an idle queue; a sample is one step, the
first ``--warmup`` not recorded; medians with the 20/80% quantiles, in microseconds.

    python bench/gpu_phases.py --device cuda --out out/gpu_phases.json   # ~20 s on a GPU
    python bench/gpu_phases.py --quick --out /tmp/gpu_phases.json        # the CPU dry run (torch backend)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from phase_step import PHASES, PhaseStep
from timing import describe, machine, quantiles, write_results

from tritonscale import host_reads

POLICIES = {"defaults": {}, "rich": {"hysteresis": 2, "skip_norm_factor": 5.0}}
#: (tensors, elements per tensor)
CASES = ((1, 1024), (148, 64))
VARIANTS = ("torch", "ours")
#: The environment switch that turns the pre-bound launcher off ("0").
SWITCH = "TRITONSCALE_BOUND_LAUNCH"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cuda: the real kernels; cpu: the dry run (torch backend)")
    parser.add_argument("--steps", type=int, default=200, help="recorded steps per variant and case")
    parser.add_argument("--warmup", type=int, default=20, help="unrecorded first steps (compiles, caches)")
    parser.add_argument("--quick", action="store_true", help="3 steps after 2 warm-up (the smoke run)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu_phases.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 2
    return args


def bound_launch() -> str:
    """What the environment says of the pre-bound launcher: ``"off"`` when the switch is "0", else ``"on"``."""
    return "off" if os.environ.get(SWITCH) == "0" else "on"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(setup: PhaseStep, steps: int, seconds: dict[str, list[float]]) -> None:
    """``steps`` steps, each phase's host time appended to ``seconds[phase]``."""
    clock, device = time.perf_counter, setup.device

    def around(name, call):
        sync(device)
        start = clock()
        result = call()
        seconds[name].append(clock() - start)
        return result

    for _ in range(steps):
        setup.step(around)
    sync(device)


def launches_per_phase(setup: PhaseStep) -> dict[str, dict]:
    """Each phase's device events (kernels, copies, memsets) under torch's profiler, one step per
    phase with only that phase profiled: ``{phase: {"launches": n, "kernels": [names]}}`` (on a CPU
    there are none: ``launches`` is None)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    counts = {}
    for profiled in PHASES:

        def around(name, call, profiled=profiled):
            if name != profiled:
                return call()
            sync(setup.device)
            with profile(activities=activities) as prof:
                result = call()
                sync(setup.device)
            device_events = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
            counts[name] = {"launches": len(device_events) if on_gpu else None,
                            "kernels": [e.name for e in device_events]}  # fmt: skip
            return result

        setup.step(around)
    return counts


def run_case(args, device: torch.device, tensors: int, each: int, policy: str) -> dict:
    """Per variant: each phase's host µs (quantiles) and launches. The variants alternate step by step."""
    total = args.warmup + args.steps + len(PHASES) + 1
    backend = "triton" if device.type == "cuda" else "torch"
    setups = {v: PhaseStep(v, tensors, each, POLICIES[policy], device=device, backend=backend, total_steps=total)
              for v in VARIANTS}  # fmt: skip
    seconds = {v: {name: [] for name in PHASES} for v in VARIANTS}
    warm = {v: {name: [] for name in PHASES} for v in VARIANTS}
    for _ in range(args.warmup):
        for v in VARIANTS:
            timed_steps(setups[v], 1, warm[v])
    for k in range(args.steps):
        for v in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
            timed_steps(setups[v], 1, seconds[v])
    result = {}
    for v in VARIANTS:
        launches = launches_per_phase(setups[v])
        result[v] = {name: {**{key.replace("_ms", "_us"): t * 1e3 for key, t in quantiles(seconds[v][name]).items()},
                            **launches[name]} for name in PHASES}  # fmt: skip
    return result


def table(cases: dict[str, dict]) -> str:
    """The printed table: per case and phase, torch's and our host µs (medians) and launches, ours/torch."""
    rows = [f"{'case':<28} {'phase':<7} {'torch us':>9} {'ours us':>9} {'ours/torch':>10} {'launches torch/ours':>20}"]
    for case, result in cases.items():
        for name in PHASES:
            t, o = result["torch"][name], result["ours"][name]
            launches = f"{t['launches']}/{o['launches']}" if t["launches"] is not None else "-"
            ratio = o["median_us"] / t["median_us"]
            rows.append(f"{case:<28} {name:<7} {t['median_us']:>9.1f} {o['median_us']:>9.1f} {ratio:>10.2f} "
                        f"{launches:>20}")  # fmt: skip
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_phases.py --device cuda: torch.cuda.is_available() is False (no GPU)")
    info = {**machine(device), "bound_launch": bound_launch()}
    are_free, threads = host_reads.are_free, torch.get_num_threads()
    if device.type == "cpu":  # the dry run: no parallel region waiting for a core a neighbour holds
        torch.set_num_threads(1)
    # The paths a GPU takes on a CPU too (the dry run): nothing read back on the host.
    host_reads.are_free = lambda device: False
    try:
        print(f"host time and launches per phase, {describe(info)}, pre-bound launcher {info['bound_launch']}; "
              f"{args.steps} steps after {args.warmup}, medians in us")  # fmt: skip
        cases = {}
        for tensors, each in CASES:
            for policy in POLICIES:
                cases[f"{tensors} x {each}, {policy}"] = run_case(args, device, tensors, each, policy)
    finally:
        host_reads.are_free = are_free
        torch.set_num_threads(threads)
    print(table(cases))
    write_results(args.out, info, args, cases=cases)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
