"""The README's main job: the fused-clip experiments, the benchmark sweep, the compiled-kernel
report, the collectives and the whole training step, end to end, with a progress bar; PNG, JSON
and logs go to one output folder.

Stages (each one a script in bench/ that also runs on its own):

1. ``experiments.py``   small models trained twice from one seed (torch vs tritonscale): loss,
                        scale, gradient norm and skipped steps, max loss difference, step-time ratio
2. ``sweep.py``         the step over sizes x dtypes x layouts for every variant, with the bytes model
3. ``kernel_report.py`` registers, spills and access widths of the kernels compiled for sm_90 and
                        gfx942, with no GPU
4. ``collectives.py``   combining norm and found_inf across 2 gloo ranks: our all-gather against
                        Megatron's two all-reduces and one all-reduce
5. ``train_step.py``    a whole training step of a small transformer, phase by phase (forward,
                        backward, scaler, step, update, zero_grad), torch's variants against ours

On CPU the job first measures this machine (a few seconds: float16 autocast against float32,
the stages' own work at small sizes; ``budget.py``), sizes the slow stages to fit ``--budget``
seconds (fewer steps and a narrower model for the float16 experiments, fewer repeats and sizes for
the sweep, fewer steps for the whole-step benchmark), prints the sizes and how long it expects to
take, then runs them in ``replan.RUN_ORDER`` (the fixed stages first, the experiments, the most
resizable, last) and holds the run to that estimate: before each stage the stages left are
re-sized to the time left and the slowdown seen so far, and the output says when and why
(``replan.py``). A stage cut below its planned size says so in its plot's title (``--cut-note``:
``CUT by the re-planner: 10 of 40 planned steps (the machine 3.1x slower than the pilots, ...)``),
and the end of the job lists every stage cut, planned against run (``cut_summary``).
``run_all.json`` in the output folder records the measurement, the planned sizes, the estimate,
every re-plan, each stage's size, estimate and real time, and the stages cut (``replanning.cuts``).
On a machine where a neighbour holds a core, torch's threads wait for each other at every parallel op (an order of
magnitude slower than one thread; replan.py): before the pilots and before each stage the job
times one parallel op on torch's threads and on one, and goes to one thread for the rest of the run
when that is faster (``replan.threads_for_load``), saying so; ``run_all.json`` records it under
``threads``, and each stage's results name the threads they ran on.

    python bench/run_all.py                     # CPU: sized to about 4 minutes, results in out/
    python bench/run_all.py --budget 600        # CPU: bigger sizes, where they fit 10 minutes
    python bench/run_all.py --device cuda       # GPU presets: bigger model, sizes up to 1G elements
    python bench/run_all.py --quick --out /tmp/smoke   # every stage at a tiny size (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

import budget
import collectives
import experiments
import kernel_report
import sweep
import torch
import train_step
from progress import ProgressBar
from replan import CUT, RUN_ORDER, Replanner, fewer_threads_note, probe_slowdown, shown, threads_for_load
from timing import describe, machine

# Share of the progress bar per stage where nothing was measured (--quick, --device cuda); a
# measured CPU run weighs each stage by its estimate.
WEIGHTS = {"experiments": 0.42, "sweep": 0.43, "kernel_report": 0.07, "collectives": 0.03, "train_step": 0.05}
ENTRY_POINTS = {
    "experiments": experiments.main,
    "sweep": sweep.main,
    "kernel_report": kernel_report.main,
    "collectives": collectives.main,
    "train_step": train_step.main,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder of the PNG, JSON and log files")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the GPU presets, no budget")
    parser.add_argument("--quick", action="store_true", help="every stage at a tiny size (a smoke run)")
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds the CPU run should take; the slow stages are sized to fit (default 240)",
    )
    parser.add_argument("--simulate-slow-fp16", type=float, default=1.0, metavar="FACTOR",
                        help="multiply the measured float16 autocast times by FACTOR before sizing: tries "
                             "the sizing of a CPU without fast float16 on one that has it")  # fmt: skip
    return parser.parse_args(argv)


def stage_arguments(args: argparse.Namespace, sizes: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Each stage's command line: output paths, the device's presets, then ``--quick``'s tiny sizes
    or the budget's ``sizes`` (``budget.stage_arguments``)."""
    out = args.out
    stages = {
        "experiments": ["--out", str(out / "experiments")],
        "sweep": ["--out", str(out / "sweep"), "--device", args.device],
        "kernel_report": ["--out", str(out / "kernel_report.json")],
        "collectives": ["--out", str(out / "collectives")],
        "train_step": ["--out", str(out / "train_step"), "--device", args.device],
    }
    if args.device == "cuda":
        stages["experiments"] += ["--preset", "gpu"]
        stages["sweep"] += ["--max-size", str(2**30)]
        stages["train_step"] += ["--autocast", "float16"]  # the GPU preset (chosen by --device cuda)
    if args.quick:
        stages["experiments"] += ["--steps", "3", "--d-model", "32"]
        stages["sweep"] += ["--min-size", "4096", "--max-size", "4096", "--layouts", "flat", "200", "--repeats", "1"]
        stages["kernel_report"] += ["--targets", "sm90", "--dtypes", "fp32"]
        stages["collectives"] += ["--repeats", "3", "--numel", "4096", "--tensors", "4"]
        stages["train_step"] += ["--quick"]
    for stage, extra in (sizes or {}).items():
        stages[stage] += extra
    return stages


def fit_threads(where: str, threads: dict) -> str | None:
    """Drop torch to one thread for the rest of the run where a neighbour's load makes its threads
    wait for each other (``replan.threads_for_load``), recording it in ``threads`` (run_all.json's
    ``threads``); the line to print when it did, else None. Once one thread, the run stays there."""
    chosen, timings = threads_for_load(torch.get_num_threads())
    if timings is None or chosen == torch.get_num_threads():
        return None
    torch.set_num_threads(chosen)
    threads["changes"].append({"where": where, "threads": chosen, "parallel_op_ms": timings})
    return fewer_threads_note(timings, where)


def size_to_budget(args: argparse.Namespace, threads: dict) -> dict | None:
    """Measure this machine and plan the stages' sizes (CPU runs but ``--quick``); print the plan.
    Under a neighbour's load torch first goes to one thread (``fit_threads``), so that the pilots
    measure what the stages will run on."""
    if args.quick or args.device != "cpu":
        why = "--quick: tiny sizes" if args.quick else "GPU presets"
        print(f"run_all: {why}, not sized to a budget", flush=True)
        return None
    note = fit_threads("before measuring", threads)
    if note:
        print(note, flush=True)
    print(f"run_all: measuring this machine to size the stages for a {args.budget:.0f} s budget ...", flush=True)
    measured = budget.measure(args.simulate_slow_fp16)
    plan = budget.plan(measured, args.budget, experiments.PRESETS["cpu"].steps)
    plan["measurement"] = measured
    slow = measured["matmul_time_vs_float32"]["float16"]
    simulated = f" (simulated: x{args.simulate_slow_fp16:g})" if args.simulate_slow_fp16 != 1.0 else ""
    print(f"run_all: on {describe(machine())}: a float16-autocast matmul takes {slow:.1f}x float32's{simulated}; "
          f"measured in {measured['seconds']:.1f} s")  # fmt: skip
    for note in measured["notes"]:
        print(f"run_all: note: {note}")
    for stage in RUN_ORDER:
        print(f"run_all:   {stage:<14} {shown(plan['sizes'][stage]):<36} ~{plan['stage_estimate_s'][stage]:.0f} s")
    over = " (OVER the budget even at the smallest sizes)" if plan["over_budget"] else ""
    print(f"run_all: expected to take about {plan['estimate_s'] / 60:.1f} min ({plan['estimate_s']:.0f} s){over}; "
          "the stages left are re-sized between stages to hold it", flush=True)  # fmt: skip
    return plan


def run_stages(
    args: argparse.Namespace, plan: dict | None, start: float, threads: dict
) -> tuple[dict, dict, list, dict | None]:
    """Every stage with its stdout to a log file and the bar on stderr: (logs, seconds, failed, the
    re-plans' record). A sized run runs the stages in ``replan.RUN_ORDER``; before each one it goes
    to one torch thread if a neighbour's load calls for it (``fit_threads``), then re-sizes the
    stages left (``replan.Replanner``), saying so; a stage run below its planned size is told so
    (``--cut-note``, which its plot's title shows); ``start`` is when the job began."""
    replanner = Replanner(plan["measurement"], plan, experiments.PRESETS["cpu"].steps) if plan else None
    order = replanner.order if plan else tuple(WEIGHTS)
    estimates = plan["stage_estimate_s"] if plan else None
    weights = {k: estimates[k] / sum(estimates.values()) for k in order} if plan else WEIGHTS
    bar = ProgressBar(weights, estimates_s=estimates)
    bar.start_clock()
    logs, seconds, failed = {}, {}, []
    arguments = stage_arguments(args)
    for stage in order:
        stage_args = arguments[stage]
        if replanner is not None:
            fewer = fit_threads(f"before {stage}", threads)
            if fewer:
                bar.message(fewer)
            note = replanner.before(stage, time.perf_counter() - start, probe_slowdown(plan["measurement"]))
            if note:
                bar.message(note)
            bar.set_estimates(replanner.estimates)
            stage_args = stage_args + budget.stage_arguments(replanner.sizes).get(stage, [])
            cut = replanner.cut(stage)
            if cut:
                stage_args += ["--cut-note", cut]
                bar.message(f"run_all: {stage}: {cut}")
        code, logs[stage], seconds[stage] = run_stage(stage, stage_args, bar)
        if code != 0:
            failed.append(stage)
        (args.out / f"{stage}.log").write_text(logs[stage])
        if replanner is not None:
            replanner.after(stage, seconds[stage])
    bar.close()
    return logs, seconds, failed, replanner.record() if replanner else None


def run_stage(stage: str, stage_args: list[str], bar: ProgressBar) -> tuple[int, str, float]:
    """One stage, its stdout to a log (so that the bar is not torn by its tables): (exit code, log, seconds)."""
    began = time.perf_counter()
    bar.update(stage, 0, 1)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        print(f"$ python bench/{stage}.py {shlex.join(stage_args)}")
        try:
            code = ENTRY_POINTS[stage](stage_args, progress=lambda done, total: bar.update(stage, done, total))
        except Exception:
            traceback.print_exc(file=log)
            code = 1
    bar.update(stage, 1, 1)
    return code, log.getvalue(), time.perf_counter() - began


def drift(plan: dict | None, seconds: dict[str, float], total: float) -> dict[str, float] | None:
    """Real over estimated seconds, per stage and for the whole job (None without a plan): what
    ``budget.FIXED_UNITS`` and the pilots' models are checked against, run after run."""
    if plan is None:
        return None
    ratios = {stage: seconds[stage] / est for stage, est in plan["stage_estimate_s"].items() if stage in seconds}
    return {**ratios, "total": total / plan["estimate_s"]}


def stage_table(replans: dict) -> str:
    """Each stage's planned size and estimate against the size it ran at and its real seconds."""
    lines = [f"run_all: {'stage':<14} {'planned':<32} {'ran at':<32} {'planned':>8} {'re-planned':>10} {'real':>6}"]
    for stage, r in replans["stages"].items():
        if "seconds" in r:
            sizes = f"{shown(r['planned_size']):<32} {shown(r['size']):<32}"
            times = f"{r['planned_estimate_s']:>7.0f}s {r['estimate_s']:>9.0f}s {r['seconds']:>5.0f}s"
            lines.append(f"run_all: {stage:<14} {sizes} {times}")
    return "\n".join(lines)


def cut_summary(replans: dict) -> str:
    """Every stage run below its planned size, planned against run and why (``replan.cut_note``), or
    a line saying none was: the end of the job says it either way, so that a cut is never silent."""
    cuts = replans["cuts"]
    if not cuts:
        return "run_all: no stage cut: every stage ran at its planned size or above"
    lines = [f"run_all: {len(cuts)} stage{'s' * (len(cuts) != 1)} {CUT} (their plots' titles say so too):"]
    lines += [f"run_all:   {stage:<12} {c['note'].removeprefix(CUT + ': ')}" for stage, c in cuts.items()]
    return "\n".join(lines)


def files_written(out: Path, since: float) -> tuple[list[Path], int]:
    """The PNG, JSON and log files under ``out`` modified at or after ``since`` (a ``time.time()``),
    sorted, and how many others are there: a folder used before keeps files this run did not write,
    which its list of results must not claim."""
    found = [p for p in out.rglob("*") if p.suffix in (".png", ".json", ".log")]
    written = sorted(p for p in found if p.stat().st_mtime >= since)
    return written, len(found) - len(written)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start, started_at = time.perf_counter(), time.time()
    threads = {"at_start": torch.get_num_threads(), "changes": []}
    try:
        plan = size_to_budget(args, threads)
        logs, seconds, failed, replans = run_stages(args, plan, start, threads)
    finally:  # run_all.main called in a process that goes on (a test) gets its threads back
        torch.set_num_threads(threads["at_start"])
    for stage, text in logs.items():
        print(f"== {stage}{' (FAILED)' if stage in failed else ''} ({seconds[stage]:.0f} s)\n{text}")
    total = time.perf_counter() - start
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"machine": machine(), "args": arguments, "plan": plan, "stage_seconds": seconds,
              "total_seconds": total, "failed": failed, "stage_drift": drift(plan, seconds, total),
              "replanning": replans, "threads": threads}  # fmt: skip
    (args.out / "run_all.json").write_text(json.dumps(record, indent=2))
    written, older = files_written(args.out, started_at - 1.0)  # file times tick coarser than time.time()
    expected = f" (expected {plan['estimate_s']:.0f} s: {total / plan['estimate_s'] - 1:+.0%})" if plan else ""
    cut = ""
    if replans:
        print(stage_table(replans))
        print(cut_summary(replans))
        cut = f"; {', '.join(replans['cuts'])} {CUT} (above)" if replans["cuts"] else ""
    print(f"done in {total:.0f} s{expected}{cut}; results in {args.out.resolve()}:")
    for path in written:
        print(f"  {path}")
    if older:
        print(f"  ({older} older file{'s' * (older != 1)} there, not written by this run)")
    if failed:
        print(f"failed stages: {', '.join(failed)} (see their logs above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
