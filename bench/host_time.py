"""Host time per phase of a step on the GPU paths against torch's GradScaler, on the CPU (issue 41's proxy bar).

A GPU step up to about a billion parameters is bound by the host: the Python of each phase and the
launches it makes. This measures that Python on the CPU. ``ours`` runs the paths a GPU takes
(``tritonscale.host_reads.are_free`` returns False, as the tests' ``forbid_host_reads`` makes it)
with ``backend="triton"``, ``compile_policy=False``, and every Triton launch replaced by a no-op that
only counts (``launch_count.no_op_launches``): the interpreter's run time stands for device time,
which a GPU host does not pay; a pre-bound launch costs ~2-6 us of host time on a GPU host, so the
Triton launches per phase are printed beside the time for the reader to add. ``ours (torch
backend)`` runs the same GPU paths with ``backend="torch"`` (torch's foreach/amp ops instead of the
kernels: their dispatch is in the time). ``torch`` is torch's GradScaler on the same step, its clip
being ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``.

Phases: ``scale`` (of the loss), ``clip``, ``step`` (AdamW(fused=True)), ``update``. Cases: 1 tensor
of 1024 float32 elements and 148 tensors of 64 (GPT-2 small's tensor count), each with the default
policy and a rich one (``hysteresis=2, skip_norm_factor=5.0``). All variants of a case run
interleaved in one process (``timing.interleaved``); each sample is ``STEPS_PER_SAMPLE`` steps,
each phase timed on its own (forward and backward untimed). Printed per case and phase: ours/torch
with its p20-p80 band (target <= 1.0) and our Triton launches per step. With the kernels not run
the gradients, the scale and the optimizer's values are whatever the no-op leaves: none is read on
the host, so the Python and the launches are those of a real step (the timings of 0-dim ops and of
the optimizer do not depend on the values).

    python bench/host_time.py                      # ~2 minutes on 2 cores
    python bench/host_time.py --quick --out /tmp/host_time.json   # the smoke test
    python bench/host_time.py --summarize run1.json run2.json      # docs/performance.md's table
"""

from __future__ import annotations

import os

# backend="triton" on CPU tensors runs the kernels built for Triton's interpreter, which
# @triton.jit builds only when this is set before triton is imported (here: before tritonscale).
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default-change warning

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from bars import ratio_line  # noqa: E402
from launch_count import no_op_launches  # noqa: E402
from phase_step import PHASES as STEP_PHASES  # noqa: E402
from phase_step import PhaseStep  # noqa: E402
from timing import describe, interleaved, machine, quantiles, write_results  # noqa: E402

from tritonscale import host_reads  # noqa: E402
from tritonscale.kernels.jit_helpers import INTERPRETING  # noqa: E402

PHASES = STEP_PHASES[:-1]  # no LR schedule here: no "lr" phase
POLICIES = {"defaults": {}, "rich": {"hysteresis": 2, "skip_norm_factor": 5.0}}
#: (tensors, elements per tensor): one tensor, and GPT-2 small's 148 tensors at a size the host dominates
CASES = ((1, 1024), (148, 64))
VARIANTS = ("torch", "ours", "ours (torch backend)")
STEPS_PER_SAMPLE = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed samples per variant, interleaved")
    parser.add_argument("--quick", action="store_true", help="2 repeats of 2 steps (the smoke test)")
    parser.add_argument("--out", type=Path, default=Path("out/host_time.json"))
    parser.add_argument("--summarize", type=Path, nargs="+", help="print earlier runs' ratios as a markdown table")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    args.steps = 2 if args.quick else STEPS_PER_SAMPLE
    return args


def _setup(variant: str, tensors: int, each: int, knobs: dict) -> PhaseStep:
    """A variant's step: torch's GradScaler, ours on the kernels, or ours on torch's ops; the policy
    eager (``compile_policy=False``), no LR schedule (a float lr)."""
    backend = "triton" if variant == "ours" else "torch"
    return PhaseStep(variant, tensors, each, knobs, backend=backend, compile_policy=False)


def timed_steps(setup: PhaseStep, n: int) -> dict[str, float]:
    """``n`` steps; each phase's host seconds, summed over them."""
    clock, seconds = time.perf_counter, dict.fromkeys(PHASES, 0.0)

    def around(name, call):
        start = clock()
        result = call()
        seconds[name] += clock() - start
        return result

    for _ in range(n):
        setup.step(around)
    return seconds


def count_launches(setup: PhaseStep) -> dict[str, int]:
    """Our Triton launches in each phase of one step (the no-op launcher's count around each)."""
    counts = {}
    with no_op_launches() as launched:

        def around(name, call):
            before = sum(launched.values())
            result = call()
            counts[name] = sum(launched.values()) - before
            return result

        setup.step(around)
    return counts


def run_case(args, tensors: int, each: int, policy: str) -> tuple[dict, dict]:
    """The interleaved per-phase timings (per step, ``"<variant> <phase>"`` keys) and our launches."""
    setups = {v: _setup(v, tensors, each, POLICIES[policy]) for v in VARIANTS}
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}

    def sample(variant: str) -> None:
        samples[variant].append(timed_steps(setups[variant], args.steps))

    with no_op_launches():
        interleaved({v: (lambda v=v: sample(v)) for v in VARIANTS}, args.repeats, reset=lambda v: None)
    timed = {}
    for variant, rounds in samples.items():
        for name in PHASES + ("total",):
            per_step = [sum(r.values()) if name == "total" else r[name] for r in rounds[1:]]  # round 0: warm-up
            per_step = [t / args.steps for t in per_step]
            timed[f"{variant} {name}"] = {**quantiles(per_step), "samples_ms": [t * 1e3 for t in per_step]}
    return timed, count_launches(setups["ours"])


def summary_table(runs: dict[str, dict]) -> str:
    """Earlier runs (``{name: its JSON}``) as one markdown table: a row per case and phase, our
    Triton launches, then each run's ours/torch for each of our backends (median, ``*`` where the
    run's p20-p80 band straddles 1.0)."""
    names = list(runs)
    head = ["case", "phase", "Triton launches"] + [f"{n}: {b}" for n in names for b in ("triton", "torch backend")]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    first = runs[names[0]]["ratios"]
    for k in range(0, len(first), 2):
        case, phase = first[k]["what"].split(", ")[1:3], first[k]["ratio"].split("/")[0].split()[-1]
        cells = [", ".join(case[:1] + [case[1]]), phase, str(first[k]["triton_launches"])]
        for name in names:
            for line in runs[name]["ratios"][k : k + 2]:
                cells.append(f"{line['value']:.2f}" + ("*" if line["spread"]["within_noise"] else ""))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summary_table({path.stem: json.loads(path.read_text()) for path in args.summarize}))
        return 0
    if not INTERPRETING:
        raise RuntimeError("bench/host_time.py needs TRITON_INTERPRET=1 before triton is imported; run it as a script")
    info = machine(torch.device("cpu"))
    threads, are_free = torch.get_num_threads(), host_reads.are_free
    # One intra-op thread: host time is the question, and a parallel region waiting for a second
    # core another process holds cost the 148-tensor fused step up to ~1000x on the shared machine.
    torch.set_num_threads(1)
    host_reads.are_free = lambda device: False  # the paths a GPU takes, as the tests' forbid_host_reads
    try:
        print(f"host time per phase on the GPU paths, {describe(info)}, 1 thread; {args.repeats} interleaved "
              f"samples of {args.steps} steps per variant, medians per step")  # fmt: skip
        lines, launches = all_cases(args)
    finally:
        torch.set_num_threads(threads)
        host_reads.are_free = are_free
    write_results(args.out, info, args, ratios=lines, triton_launches=launches)
    print(f"wrote {args.out}")
    return 0


def all_cases(args) -> tuple[list[dict], dict]:
    """Every case's printed ratios (ours/torch per phase, each of our backends) and our launches."""
    lines, launches = [], {}
    for tensors, each in CASES:
        for policy in POLICIES:
            case = f"{tensors} x {each} float32, {policy}"
            timed, ours_launches = run_case(args, tensors, each, policy)
            launches[case] = ours_launches
            for name in PHASES + ("total",):
                n = sum(ours_launches.values()) if name == "total" else ours_launches[name]
                what = f"host time, {case}, {name} (ours: {n} Triton launches, ~2-6 us each on a GPU host)"
                for ours in VARIANTS[1:]:
                    line = ratio_line("4", what, f"{ours} {name}", f"torch {name}", timed, "<= 1.0")
                    line["triton_launches"] = n if ours == "ours" else 0
                    lines.append(line)
    return lines, launches


if __name__ == "__main__":
    sys.exit(main())
