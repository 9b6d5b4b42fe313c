"""The one GPU check: every GPU measurement of this project in one command, under 8 minutes on one GPU.

Run it the first time a GPU is at hand, from the checkout's root, with the torch the machine has
(no network, nothing to install: the checkout is put on ``PYTHONPATH``). It refuses without a
CUDA/ROCm GPU, saying why. Stages, each a command of its own in its own process with its own
timeout (a stage that fails or hangs is stopped and recorded; the stages after it still run), in
this order:

1. ``gpu_tier``: ``TRITON_INTERPRET=0 python -m pytest -m gpu tests`` (tests/test_gpu.py: training
   against torch without a host sync, the capture recipe's N replays against eager, the
   moved-gradient refusal, the compiled and reduce-overhead steps; the other gpu-marked tests),
   its JUnit XML beside the log; it compiles the kernels the later stages find in Triton's cache;
2. ``phases_bound_on`` and ``phases_bound_off``: ``bench/gpu_phases.py --device cuda --steps 100``,
   host µs and device launches (torch profiler) per phase, ours beside torch's, with the pre-bound
   launcher on and then off (``TRITONSCALE_BOUND_LAUNCH=0``, Triton's JIT path);
3. ``bars``: ``bench/bars.py --device cuda --bars 1 2 3 --repeats 11``;
4. ``train_step``: ``bench/train_step.py --device cuda --autocast float16`` (the GPU preset,
   ~100M parameters, 50 steps per variant).

Everything goes under ``bench/results/<device>/`` (``--out``; ``<device>`` is
``torch.cuda.get_device_name`` slugged, e.g. ``nvidia-h200``): each stage's log and files, and
``gpu_check.json``: the builds (torch, triton, CUDA/HIP, driver, cuDNN, Python, the commit), the
device, and per stage its command, status (passed / failed / timed out / not run), exit code,
seconds and files; ``gpu_check.txt`` is the same summary as the printed table. The stage
timeouts add up to ``--budget`` (450 s by default, 1200 s for a dry run); a stage never gets more
than the time left.

    python bench/gpu_check.py                            # on one GPU: under 8 minutes
    python bench/gpu_check.py --commit 0123abc           # where the checkout has no .git to name its commit
    python bench/gpu_check.py --commit 0123abc --results-root "$OUT"   # a lent machine: $OUT/<device>/ comes back
    python bench/gpu_check.py --dry-run --out /tmp/gc    # on a CPU: every stage at a tiny size (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
#: The pre-bound launcher's switch (tritonscale/kernels/bound_launch.py): "0" turns it off.
SWITCH = "TRITONSCALE_BOUND_LAUNCH"
BUDGET_S, DRY_RUN_BUDGET_S = 450.0, 1200.0
#: Each stage's share of the budget, in the order they run (of 450 s: 150, 45, 45, 99, 110).
SHARES = {"gpu_tier": 1 / 3, "phases_bound_on": 0.1, "phases_bound_off": 0.1, "bars": 0.22, "train_step": 0.245}


@dataclass
class Stage:
    """One command of the check: ``argv`` run from the checkout's root with ``env`` added, stopped
    after ``timeout_s``; ``files`` are what it writes, relative to the results folder."""

    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results folder (default <results-root>/<device>; dry run: "
                        "out/gpu_check)")  # fmt: skip
    parser.add_argument("--results-root", type=Path, default=REPO / "bench" / "results",
                        help="where the <device> folder goes (default bench/results; on a lent machine whose "
                        "$OUT comes back: $OUT)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: every stage at a tiny size, nothing timed")
    parser.add_argument("--budget", type=float, help="seconds all stages may take (default 450; dry run 1200: a "
                        "shared CPU is slow)")  # fmt: skip
    parser.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD of the checkout)")
    parser.add_argument("--stages", nargs="+", choices=list(SHARES), help="run only these stages")
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = DRY_RUN_BUDGET_S if args.dry_run else BUDGET_S
    return args


def slug(name: str) -> str:
    """A device name as a folder name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def why_no_gpu() -> str | None:
    """Why this machine cannot run the check (None when it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    build = torch.version.cuda or torch.version.hip
    if build is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda and torch.version.hip are None); "
                "run it with a CUDA or ROCm build of torch on a machine with a GPU")  # fmt: skip
    return (f"torch.cuda.is_available() is False: torch {torch.__version__} (built for "
            f"{'CUDA' if torch.version.cuda else 'ROCm'} {build}) finds no GPU or driver on this machine")  # fmt: skip


def stages(out: Path, budget: float, dry_run: bool) -> list[Stage]:
    """The check's stages, writing under ``out``; on a dry run each at a tiny size on the CPU."""
    py = sys.executable
    times = {name: budget * share for name, share in SHARES.items()}
    device = ["--device", "cpu"] if dry_run else ["--device", "cuda"]
    tier = [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={out / 'gpu_tier.xml'}"]
    tier += ["tests/test_gpu.py"] if dry_run else ["tests"]  # dry run: collect the GPU tier alone (it skips)
    phases = [py, str(BENCH / "gpu_phases.py")] + device + (["--quick"] if dry_run else ["--steps", "100"])
    bars = [py, str(BENCH / "bars.py")] + device + ["--bars", "1", "2", "3", "--out", str(out / "bars" / "bars.json")]
    bars += ["--quick", "--backend", "torch"] if dry_run else ["--repeats", "11"]
    train = [py, str(BENCH / "train_step.py")] + device + ["--out", str(out / "train_step")]
    train += ["--quick"] if dry_run else ["--autocast", "float16"]
    return [
        Stage("gpu_tier", tier, times["gpu_tier"], {"TRITON_INTERPRET": "0"}, ["gpu_tier.xml"]),
        Stage("phases_bound_on", phases + ["--out", str(out / "phases_bound_on.json")], times["phases_bound_on"],
              {}, ["phases_bound_on.json"]),  # fmt: skip
        Stage("phases_bound_off", phases + ["--out", str(out / "phases_bound_off.json")], times["phases_bound_off"],
              {SWITCH: "0"}, ["phases_bound_off.json"]),  # fmt: skip
        Stage("bars", bars, times["bars"], {}, ["bars/bars.json"]),
        Stage("train_step", train, times["train_step"], {}, [f"train_step/train_step.{x}" for x in ("json", "png")]),
    ]


def stage_env(stage: Stage) -> dict[str, str]:
    """The stage's environment: this one, the checkout first on PYTHONPATH, no pre-bound switch or
    interpreter left over from the caller's shell unless the stage sets them."""
    env = {k: v for k, v in os.environ.items()
           if k not in (SWITCH, "TRITON_INTERPRET") and not k.startswith("PYTEST_")}  # fmt: skip  (an xdist worker's)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default-change warning
    env.setdefault("PYTHONUNBUFFERED", "1")  # a stage stopped at its timeout leaves its log so far
    return {**env, **stage.env}


def run_stage(stage: Stage, out: Path, deadline: float, clock=time.monotonic) -> dict:
    """Run one stage (its output to ``out/<name>.log``), never past ``deadline`` (a ``clock`` time);
    its record for the summary."""
    record = {"name": stage.name, "command": stage.argv, "env": stage.env, "log": f"{stage.name}.log"}
    left = deadline - clock()
    if left < 1.0:
        return {**record, "status": "not run", "returncode": None, "seconds": 0.0, "timeout_s": 0.0,
                "note": "the check's budget was spent before this stage", "files": []}  # fmt: skip
    timeout = min(stage.timeout_s, left)
    log = out / record["log"]
    start = clock()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(stage.argv)}\n")
        sink.flush()
        # Its own session: at the timeout the whole group goes (pytest's and the benchmarks' children too).
        proc = subprocess.Popen(stage.argv, cwd=REPO, env=stage_env(stage), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code, status = None, "timed out"
            sink.write(f"\n[gpu_check: stopped after {timeout:.0f} s]\n")
    files = [f for f in stage.files if (out / f).exists()]
    record.update(status=status, returncode=code, seconds=round(clock() - start, 1), timeout_s=round(timeout, 1),
                  files=files)  # fmt: skip
    if stage.name == "gpu_tier" and (out / "gpu_tier.xml").exists():
        record["tests"] = junit_counts(out / "gpu_tier.xml")
    return record


def junit_counts(path: Path) -> dict:
    """Passed, failed, errors, skipped and the failing tests' ids, from pytest's JUnit XML."""
    root = ElementTree.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failing = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None
               or c.find("error") is not None]  # fmt: skip
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    return {"tests": len(cases), "failed": len(failing), "skipped": skipped,
            "passed": len(cases) - len(failing) - skipped, "failing": failing}  # fmt: skip


def _command_output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def uncommitted_changes() -> bool | None:
    """Whether the checkout's tracked files differ from its commit (None without git)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                              text=True, timeout=30, cwd=REPO)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(done.stdout.strip()) if done.returncode == 0 else None


def builds(commit: str | None) -> dict:
    """What the results were measured with: device, torch, triton, CUDA/HIP, driver, cuDNN, Python, commit."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    on_gpu = torch.cuda.is_available()
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if driver is None and on_gpu and torch.version.cuda:
        code = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()  # e.g. 13000: the CUDA API it supports
        driver = f"CUDA driver API {code // 1000}.{code % 1000 // 10}" if code else None
    sys.path.insert(0, str(BENCH))
    from timing import cpu_model

    return {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "devices": torch.cuda.device_count() if on_gpu else 0,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if on_gpu else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "driver": driver,
        "cudnn": torch.backends.cudnn.version() if on_gpu else None,
        "python": platform.python_version(),
        "host": {"processor": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "commit": commit or _command_output(["git", "rev-parse", "HEAD"]) or "unknown (no --commit, no git)",
        "uncommitted_changes": None if commit else uncommitted_changes(),
    }


def summary_table(records: list[dict]) -> str:
    rows = [f"{'stage':<18} {'status':<10} {'seconds':>8} {'timeout':>8}  detail"]
    for r in records:
        detail = r.get("note", "")
        if "tests" in r:
            t = r["tests"]
            detail = f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped" + (
                f": {', '.join(t['failing'])}" if t["failing"] else "")  # fmt: skip
        rows.append(f"{r['name']:<18} {r['status']:<10} {r['seconds']:>8.1f} {r['timeout_s']:>8.0f}  {detail}")
    return "\n".join(rows)


def run_stages(selected: list[Stage], out: Path, budget: float, clock=time.monotonic) -> list[dict]:
    """Every stage in order within ``budget`` seconds in all, printing each one's outcome."""
    deadline = clock() + budget
    records = []
    for stage in selected:
        print(f"gpu_check: {stage.name} (up to {min(stage.timeout_s, max(deadline - clock(), 0)):.0f} s) ...",
              flush=True)  # fmt: skip
        record = run_stage(stage, out, deadline, clock)
        print(f"gpu_check: {stage.name} {record['status']} in {record['seconds']:.1f} s (log: {out / record['log']})",
              flush=True)  # fmt: skip
        records.append(record)
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        reason = why_no_gpu()
        if reason is not None:
            print(f"bench/gpu_check.py needs a CUDA or ROCm GPU: {reason}. On a CPU, `--dry-run` runs every "
                  "stage at a tiny size.", file=sys.stderr)  # fmt: skip
            return 2
    info = builds(args.commit)
    out = args.out or (REPO / "out" / "gpu_check" if args.dry_run else args.results_root / slug(info["device"]))
    out.mkdir(parents=True, exist_ok=True)
    selected = [s for s in stages(out, args.budget, args.dry_run) if args.stages is None or s.name in args.stages]
    print(f"gpu_check on {info['device']}: torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, "
          f"driver {info['driver']}, commit {info['commit']}; results in {out}", flush=True)  # fmt: skip
    start = time.monotonic()
    records = run_stages(selected, out, args.budget)
    table = summary_table(records)
    total = time.monotonic() - start
    summary = {"builds": info, "dry_run": args.dry_run, "budget_s": args.budget, "seconds": round(total, 1),
               "stages": records, "passed": all(r["status"] == "passed" for r in records)}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (out / "gpu_check.txt").write_text(f"{info['device']}, torch {info['torch']}, triton {info['triton']}, "
                                       f"commit {info['commit']}; {total:.0f} s\n{table}\n")  # fmt: skip
    print(table)
    print(f"gpu_check: {'every stage passed' if summary['passed'] else 'NOT every stage passed'} in {total:.0f} s; "
          f"wrote {out / 'gpu_check.json'}")  # fmt: skip
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
