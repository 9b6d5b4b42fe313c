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

    python bench/run_all.py                     # CPU: a few minutes, results in out/
    python bench/run_all.py --device cuda       # GPU presets: bigger model, sizes up to 1G elements
    python bench/run_all.py --quick --out /tmp/smoke   # every stage at a tiny size (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import traceback
from pathlib import Path

import collectives
import experiments
import kernel_report
import sweep
import train_step
from progress import ProgressBar

# Share of the progress bar per stage, roughly their share of the CPU run's time.
WEIGHTS = {"experiments": 0.42, "sweep": 0.43, "kernel_report": 0.07, "collectives": 0.03, "train_step": 0.05}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="every stage at a tiny size (a smoke run)")
    return parser.parse_args(argv)


def stage_arguments(args: argparse.Namespace) -> dict[str, list[str]]:
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
    return stages


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bar = ProgressBar(WEIGHTS)
    entry_points = {
        "experiments": experiments.main,
        "sweep": sweep.main,
        "kernel_report": kernel_report.main,
        "collectives": collectives.main,
        "train_step": train_step.main,
    }
    logs, failed = {}, []
    start = time.perf_counter()
    for stage, stage_args in stage_arguments(args).items():
        bar.update(stage, 0, 1)
        progress = lambda done, total, stage=stage: bar.update(stage, done, total)
        log = io.StringIO()
        # The stages' tables go to a log (printed below) so that the bar is not torn by them.
        with contextlib.redirect_stdout(log):
            try:
                code = entry_points[stage](stage_args, progress=progress)
            except Exception:
                traceback.print_exc(file=log)
                code = 1
        bar.update(stage, 1, 1)
        if code != 0:
            failed.append(stage)
        logs[stage] = log.getvalue()
        (args.out / f"{stage}.log").write_text(logs[stage])
    bar.close()
    for stage, text in logs.items():
        print(f"== {stage}{' (FAILED)' if stage in failed else ''}\n{text}")
    written = sorted(p for p in args.out.rglob("*") if p.suffix in (".png", ".json", ".log"))
    print(f"done in {time.perf_counter() - start:.0f} s; results in {args.out.resolve()}:")
    for path in written:
        print(f"  {path}")
    if failed:
        print(f"failed stages: {', '.join(failed)} (see their logs above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
