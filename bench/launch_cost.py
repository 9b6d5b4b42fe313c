"""Host instructions per phase of a step on the GPU paths, ours beside torch's GradScaler, under callgrind.

A GPU step up to about a billion parameters is bound by the host; wall-clock medians on a shared
CPU swing 3x, instruction counts do not. This counts the instructions (valgrind's callgrind,
``Ir``) each phase of a scaled step runs on the host, through Triton's real launch path: the
level-2 harness of ``tests/launch_path`` (Triton's own ``CudaDriver`` and C launcher, built with
gcc, over a stub ``libcuda.so.1`` whose ``cuLaunchKernelEx`` copies the parameter block instead of
launching). ``ours`` is ``tritonscale.GradScaler(backend="triton")`` on the paths a GPU takes (the
host-read switch off, the Triton backend and the policy kernel chosen as on CUDA; the tensors are
CPU tensors the stub calls device memory), so every Triton launch runs the JIT path or the
pre-bound launcher and Triton's C launcher, as on a GPU host, and nothing else: the kernels do
not run (the values are whatever the stub leaves; none is read on the host). ``torch`` is
``torch.amp.GradScaler("cpu")`` on torch's CPU ops (its CUDA ops' host path is alike at one tensor;
at 148 torch's CPU ``_foreach`` ops loop per tensor, which its CUDA ops do not: compare there with
care). A GPU host adds ~3 us per real ``cuLaunchKernelEx`` to ours and to torch's launches alike.

Phases: ``scale`` (of the loss), ``clip`` (ours ``clip_grad_norm_``; torch's ``unscale_`` +
``torch.nn.utils.clip_grad_norm_``), ``step`` (AdamW(fused=True), a tensor lr), ``update``,
``lr`` (ours ``SkipAwareLR.step``; torch's ``LambdaLR.step``). Cases: 1 tensor of 1024 float32
elements and 148 tensors of 64, ours with the defaults and with ``hysteresis=2,
skip_norm_factor=5.0`` (torch has one policy). Each run: one Python (``--python``, default this
one) with the pre-bound launcher on or off (``TRITONSCALE_BOUND_LAUNCH=0``: every launch through
``kernel[grid]``, Triton's JIT path), one valgrind process for all cases.

Method: the worker (this script with ``--worker``, run under ``valgrind --tool=callgrind
--instr-atstart=no --collect-atstart=no --toggle-collect=tsin_*``) builds every case, runs
``--warmup`` steps (compiles and binds; Triton's cache was filled by a run of the same worker
without valgrind first), starts the instrumentation, then runs ``--calls`` steps per case, each
phase called through a C marker function of its own (``tsmark_<phase>``, a tiny library built with
gcc against valgrind's ``callgrind.h``, called with ctypes; it calls ``tsin_<phase>``, which calls
the phase back, and collection is on only inside a ``tsin_``), the same number of calls of ``tsmark_bare`` with a no-op, and dumps the case
(``CALLGRIND_DUMP_STATS_AT``). A phase's instructions per call are the marker's inclusive cost
minus the bare marker's, over the calls. One torch thread, the garbage collector off while
measuring, ``PYTHONHASHSEED=0``. torch runs in every valgrind process: its figures in two runs are
a repeatability check (printed and recorded).

``--breakdown MODULE:QUALNAME ...`` says where a phase's instructions go: after a case's measured
steps, one round of ``--calls`` steps per named callable, that callable alone replaced (where its
callers look it up) by a wrapper that calls it inside a marker of its own (``tsmark_part<k>``,
which does not toggle collection: it counts only inside a measured phase); its inclusive
instructions per step, the bare marker's cost subtracted per call (within ~1k per call), and its
calls per step, printed after the table and recorded as each case's ``breakdown``.

Printed: per Python, a table of instructions per call (torch, ours for each launcher setting) and
ours/torch. The last line: ``host instructions at 1 tensor, ours/torch: scale A, clip B, step C,
update D``: the largest ratio over the policies and the Pythons run, with the pre-bound launcher
on (off when only off was run). Targets (issue 46): scale, clip, step <= 1.0; update <= 2.0.
Install valgrind with ``apt-get install valgrind`` (Debian's package brings ``callgrind.h``).

    python bench/launch_cost.py --out out/launch_cost.json          # this Python, on and off: 5-10 min on 2 cores
    python bench/launch_cost.py --python /work/venv36/bin/python --python .venv/bin/python --out out/lc.json
    python bench/launch_cost.py --quick --bound on --out /tmp/launch_cost.json   # the smoke run, ~2 min
    python bench/launch_cost.py --bound on --phases update --breakdown tritonscale.policy.runner:PolicyRunner.update_ --out /tmp/lc.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phase_step import PHASES, PhaseStep  # (imports torch only when a step is built)

REPO = Path(__file__).resolve().parents[1]
#: The phases the last line compares, and their targets (ours/torch at one tensor).
TARGETS = {"scale": 1.0, "clip": 1.0, "step": 1.0, "update": 2.0}
POLICIES = {"defaults": {}, "rich": {"hysteresis": 2, "skip_norm_factor": 5.0}}
#: (tensors, elements per tensor)
CASES = ((1, 1024), (148, 64))
SWITCH = "TRITONSCALE_BOUND_LAUNCH"
#: The markers ``--breakdown`` wraps callables in (``tsmark_part0`` ...): at most this many targets.
PARTS = 12
MARKS_SOURCE = r"""
#include <valgrind/callgrind.h>
typedef void (*thunk_t)(void);
static volatile long tsmark_calls;
/* ctypes calls through libffi, whose ffi_call_unix64 callgrind does not see as a call: the exported
   tsmark_<phase> calls tsin_<phase>, an ordinary C call, and collection is toggled on tsin_*. */
#define MARK(phase) \
  __attribute__((noinline)) static void tsin_##phase(thunk_t f) { f(); tsmark_calls++; } \
  void tsmark_##phase(thunk_t f) { tsin_##phase(f); }
MARK(bare) MARK(scale) MARK(clip) MARK(step) MARK(update) MARK(lr)
/* --breakdown's markers inside a phase: tspart_<k> does not toggle collection (a nested toggle
   would switch it off), so it counts only inside a tsin_. */
#define PART(k) \
  __attribute__((noinline)) static void tspart_##k(thunk_t f) { f(); tsmark_calls++; } \
  void tsmark_part##k(thunk_t f) { tspart_##k(f); }
PART(0) PART(1) PART(2) PART(3) PART(4) PART(5) PART(6) PART(7) PART(8) PART(9) PART(10) PART(11)
void tsctl_start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
void tsctl_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
int tsctl_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="interpreter(s) to run, each with its own torch and "
                        "triton (repeatable; default: this one)")  # fmt: skip
    parser.add_argument("--bound", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="pre-bound launcher settings to run (off: TRITONSCALE_BOUND_LAUNCH=0)")  # fmt: skip
    parser.add_argument("--calls", type=int, default=40, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured first steps per case")
    parser.add_argument("--quick", action="store_true", help="1 tensor, defaults, 3 calls (the smoke run)")
    parser.add_argument("--out", type=Path, default=Path("out/launch_cost.json"))
    parser.add_argument("--keep", type=Path, help="keep the callgrind dumps here (for callgrind_annotate)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per valgrind run")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                        help="the phases measured (the others run unmarked): with --keep, a dump of one "
                        "phase for callgrind_annotate")  # fmt: skip
    parser.add_argument("--breakdown", nargs="+", default=[], metavar="MODULE:QUALNAME",
                        help=f"callables (at most {PARTS}) to count inside the measured phases, each where its "
                        "callers look it up (tritonscale.policy.runner:PolicyRunner.update_): their inclusive "
                        "instructions per step, printed and recorded beside the phases")  # fmt: skip
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # the measured process: its JSON
    parser.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=None, help="the cases run, comma-separated labels as the JSON names "
                        "them (torch|1x1024|torch,ours|1x1024|defaults); default: every case")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.warmup = min(args.calls, 3), min(args.warmup, 2)
    if len(args.breakdown) > PARTS:
        parser.error(f"--breakdown takes at most {PARTS} callables, got {len(args.breakdown)}")
    return args


# ----------------------------------------------------------------------------- the markers


def build_marks(directory: Path | None = None) -> Path:
    """The marker library (``MARKS_SOURCE`` built with gcc once per source), its path."""
    digest = hashlib.sha256(MARKS_SOURCE.encode()).hexdigest()[:16]
    folder = directory or Path(tempfile.gettempdir()) / "tritonscale-callgrind-marks" / digest
    library = folder / "tsmark.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        source, partial = folder / "tsmark.c", folder / f"tsmark.so.{os.getpid()}"
        source.write_text(MARKS_SOURCE)
        subprocess.run(["gcc", "-O0", "-shared", "-fPIC", "-o", str(partial), str(source)], check=True)
        partial.replace(library)  # atomic: a concurrent builder never loads half a library
    return library


class Marks:
    """Calls through the marker library: ``run(phase, fn)`` returns ``fn()``, called from inside
    ``tsmark_<phase>`` (where callgrind collects); ``dump(label)`` writes what was collected."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.PyDLL(str(library))  # the GIL stays held: no release and re-take around each call
        thunk_type = ctypes.CFUNCTYPE(None)
        self._fn, self._result, self._error = None, None, None
        self._thunk = thunk_type(self._call)
        self._marks = {}
        for phase in ("bare",) + PHASES + tuple(f"part{k}" for k in range(PARTS)):
            mark = getattr(lib, f"tsmark_{phase}")
            mark.argtypes, mark.restype = [thunk_type], None
            self._marks[phase] = mark
        lib.tsctl_dump.argtypes, lib.tsctl_dump.restype = [ctypes.c_char_p], None
        self._lib = lib
        self.on_valgrind = bool(lib.tsctl_on_valgrind())

    def _call(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as error:  # ctypes would print and drop it: raised again by run()
            self._error = error

    def run(self, phase: str, fn):
        saved = self._fn, self._result, self._error  # a marked callable inside a marked phase: reentrant
        self._fn = fn
        self._marks[phase](self._thunk)
        result, error = self._result, self._error
        self._fn, self._result, self._error = saved
        if error is not None:
            raise error
        return result

    def start_instrumentation(self) -> None:
        self._lib.tsctl_start_instrumentation()

    def dump(self, label: str) -> None:
        self._lib.tsctl_dump(label.encode())


def _noop() -> None:
    return None


# ----------------------------------------------------------------------------- the worker


def gpu_paths() -> None:
    """The paths a GPU takes, on CPU tensors over the stub: no host read, the Triton backend and the
    policy kernel chosen as on CUDA (``TritonBackend.supports`` and ``kernel_form`` ask the device's
    type; the stub answers every pointer as device memory)."""
    from tritonscale import host_reads
    from tritonscale.passes.backends.triton_backend import TritonBackend
    from tritonscale.policy import kernel_form

    host_reads.are_free = lambda device: False
    TritonBackend.supports = staticmethod(lambda device: True)
    kernel_form._kernel_runs = lambda device_type, backend: backend != "torch"
    kernel_form._RUNS.clear()


class Breakdown:
    """``--breakdown``'s callables, each looked up where its callers look it up. ``install(k)``
    replaces callable ``k`` by a wrapper that counts its calls and calls it inside its own marker
    (``tsmark_part<k>``); ``remove(k)`` puts the original back. One callable is wrapped at a time, so
    no figure carries another wrapper's cost."""

    def __init__(self, targets: list[str], marks: Marks) -> None:
        import importlib

        self.targets, self._marks, self._sites = list(targets), marks, []
        self.calls = [0] * len(targets)  # inside a measured phase only, as the instructions
        self.inside = False  # the worker's marked phases set it
        for target in self.targets:
            module_name, _, qualname = target.partition(":")
            owner = importlib.import_module(module_name)
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            if name not in vars(owner):
                raise SystemExit(f"--breakdown {target}: {owner!r} has no attribute {name!r} of its own")
            self._sites.append((owner, name, vars(owner)[name]))

    def install(self, k: int) -> None:
        owner, name, original = self._sites[k]
        kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
        function = original.__func__ if kind else original
        phase, calls, marks = f"part{k}", self.calls, self._marks

        def counted(*args, **kwargs):
            if not self.inside:  # not collected there: not counted
                return function(*args, **kwargs)
            calls[k] += 1
            return marks.run(phase, lambda: function(*args, **kwargs))

        setattr(owner, name, kind(counted) if kind else counted)

    def remove(self, k: int) -> None:
        owner, name, original = self._sites[k]
        setattr(owner, name, original)


def worker_cases(spec: str | None, quick: bool) -> list[tuple[str, int, int, str]]:
    """(variant, tensors, each, policy) of every case the worker runs."""
    cases = [(1, 1024)] if quick else list(CASES)
    policies = ["defaults"] if quick else list(POLICIES)
    out = []
    for tensors, each in cases:
        out.append(("torch", tensors, each, "torch"))
        out += [("ours", tensors, each, policy) for policy in policies]
    if spec:
        wanted = set(spec.split(","))
        out = [c for c in out if f"{c[0]}|{c[1]}x{c[2]}|{c[3]}" in wanted]
    return out


def worker(args) -> int:
    """The measured process (under valgrind, or without it for ``--warm-only``)."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(REPO / "tests"))
    from launch_path import stub

    stub.activate(record_python=False)  # first: before anything builds Triton's CUDA utils
    import torch
    import triton

    import tritonscale  # noqa: F401

    torch.set_num_threads(1)
    gpu_paths()
    marks = Marks(build_marks())
    total = args.warmup + args.calls * (1 + len(args.breakdown)) + 2  # SkipAwareLR's steps, the rounds included
    cases = {
        f"{variant}|{tensors}x{each}|{policy}": PhaseStep(variant, tensors, each, POLICIES.get(policy), total_steps=total)
        for variant, tensors, each, policy in worker_cases(args.cases, args.quick)
    }  # ours on the Triton backend (the GPU paths, gpu_paths()), torch's GradScaler on its CPU ops
    plain = lambda phase, fn: fn()  # noqa: E731
    measured = set(args.phases)
    for case in cases.values():
        for _ in range(args.warmup):
            case.step(plain)
            stub.reset()
    breakdown = Breakdown(args.breakdown, marks) if args.breakdown else None
    try:
        from tritonscale.kernels import bound_launch

        bound = bool(bound_launch.ENABLED)
    except ImportError:  # a library without the pre-bound launcher: every launch is the JIT path
        bound = False
    info = {"python": sys.executable, "python_version": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "bound_launch": bound, "on_valgrind": marks.on_valgrind,
            "calls": args.calls, "warmup": args.warmup, "cases": list(cases)}  # fmt: skip
    if not args.warm_only:
        marks.start_instrumentation()
        gc.collect()
        gc.disable()
        launched = info["stub_launches"] = {}
        info["breakdown_calls"] = {}

        def marked(phase, fn):
            if phase not in measured:
                return fn()
            if breakdown is None:
                return marks.run(phase, fn)
            breakdown.inside = True
            try:
                return marks.run(phase, fn)
            finally:
                breakdown.inside = False

        for label, case in cases.items():
            for k in range(args.calls):
                case.step(marked)
                if k == 0:  # what reached cuLaunchKernelEx in one step
                    launched[label] = [launch.name for launch in stub.launches()]
                stub.reset()  # outside the markers: the stub's records never grow inside a phase
                marks.run("bare", _noop)
            marks.dump(label)
            if breakdown is not None and label.startswith("ours|"):  # then one round per callable, its own dump
                breakdown.calls[:] = [0] * len(breakdown.targets)
                for target in range(len(breakdown.targets)):
                    breakdown.install(target)
                    for _ in range(args.calls):
                        case.step(marked)
                        stub.reset()
                        marks.run("bare", _noop)
                    breakdown.remove(target)
                marks.dump(f"{label}|breakdown")
                info["breakdown_calls"][label] = dict(zip(breakdown.targets, breakdown.calls))
            gc.enable()
            gc.collect()
            gc.disable()
        gc.enable()
    args.worker.write_text(json.dumps(info, indent=2))
    return 0


# ----------------------------------------------------------------------------- callgrind's dumps


def inclusive_costs(path: Path, prefix: str | tuple[str, ...] = "tsin_") -> tuple[str, int, dict[str, int]]:
    """From one callgrind dump: its description (the ``DUMP_STATS_AT`` label), its total ``Ir`` and
    the inclusive ``Ir`` of every function whose name starts with ``prefix`` (its own cost lines
    plus the cost of the calls it makes; the markers are not recursive)."""
    names: dict[str, str] = {}
    label, totals, current = "", None, None
    costs: dict[str, int] = {}
    call_next = False
    for line in path.read_text(errors="replace").splitlines():
        if not line:
            continue
        head = line[0]
        if head.isdigit() or head in "+-*":
            if current is not None and current.startswith(prefix):
                costs[current] = costs.get(current, 0) + int(line.split()[-1])
            call_next = False
            continue
        if line.startswith("fn="):
            current = _name(line[3:], names)
        elif line.startswith("calls="):
            call_next = True
        elif line.startswith("desc: Trigger: Client Request: "):
            label = line.split(": ", 2)[2].removeprefix("Client Request: ").strip()
        elif line.startswith("totals:") or (line.startswith("summary:") and totals is None):
            totals = int(line.split()[1])
        elif line.startswith(("cfn=", "cfi=", "cfl=", "cob=")):
            if line.startswith("cfn="):
                _name(line[4:], names)  # a first mention defines the compressed name
    del call_next
    return label, totals or 0, costs


def _name(text: str, names: dict[str, str]) -> str:
    """A callgrind name: ``(id) name`` defines id, ``(id)`` refers to it, a bare name is itself."""
    match = re.match(r"\((\d+)\)(?: (.*))?", text)
    if not match:
        return text
    key, name = match.groups()
    if name is not None:
        names[key] = name
    return names.get(key, text)


def per_call(costs: dict[str, int], calls: int) -> dict[str, float]:
    """Each phase's instructions per call: its marker's inclusive cost minus the bare marker's, over ``calls``."""
    bare = costs.get("tsin_bare", 0)
    return {phase: (costs[f"tsin_{phase}"] - bare) / calls for phase in PHASES if f"tsin_{phase}" in costs}


def breakdown_per_step(costs: dict[str, int], steps: int, calls: dict[str, int]) -> dict[str, dict[str, float]]:
    """From a case's breakdown dump (one round of ``steps`` steps per callable, a bare marker after
    each step): each callable's calls and inclusive instructions per step, the bare marker's cost
    subtracted per call."""
    bare = costs.get("tsin_bare", 0) / (steps * len(calls))
    return {target: {"calls": n / steps, "per_step": (costs.get(f"tspart_{k}", 0) - n * bare) / steps}
            for k, (target, n) in enumerate(calls.items())}  # fmt: skip


def breakdown_table(runs: list[dict]) -> str:
    """One line per (run, case of ours, callable): calls per step and inclusive instructions per step."""
    lines = ["| triton | pre-bound | case | callable | calls per step | instructions per step |", "|---" * 6 + "|"]
    for run in runs:
        for label, case in run["results"].items():
            for target, figure in case.get("breakdown", {}).items():
                if figure["calls"]:
                    lines.append(f"| {run['triton']} | {run['bound']} | {label} | `{target}` | {figure['calls']:g} | "
                                 f"{figure['per_step'] / 1e3:.1f}k |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the driver


def valgrind_missing() -> str | None:
    """Why callgrind cannot run here, or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (apt-get install valgrind)"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind's callgrind.h is missing (/usr/include/valgrind; Debian's valgrind package has it)"
    if shutil.which("gcc") is None:
        return "gcc is missing (it builds the marker library and the stub libcuda)"
    return None


def worker_env(bound: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", SWITCH)}
    env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))  # fmt: skip
    if bound == "off":
        env[SWITCH] = "0"
    return env


def worker_argv(python: str, args, info_path: Path, *extra: str) -> list[str]:
    argv = [python, str(Path(__file__).resolve()), "--worker", str(info_path), "--calls", str(args.calls),
            "--warmup", str(args.warmup), "--phases", *args.phases] + (["--quick"] if args.quick else [])  # fmt: skip
    argv += ["--breakdown", *args.breakdown] if args.breakdown else []
    argv += ["--cases", args.cases] if args.cases else []
    return argv + list(extra)


def run_once(python: str, bound: str, args, folder: Path) -> dict:
    """One valgrind process: every case for ``python`` with the launcher ``bound``; its per-call figures."""
    folder.mkdir(parents=True, exist_ok=True)
    info_path = folder / "worker.json"
    out_file = folder / "callgrind.out"
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               "--toggle-collect=tsin_*", f"--callgrind-out-file={out_file}"]  # fmt: skip
    command += worker_argv(python, args, info_path)
    load = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(command, env=worker_env(bound), capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the callgrind run ({python}, pre-bound {bound}) failed:\n{done.stdout[-3000:]}"
                           f"{done.stderr[-3000:]}")  # fmt: skip
    info = json.loads(info_path.read_text())
    if not info["on_valgrind"]:
        raise RuntimeError("the worker did not run under valgrind")
    if info["bound_launch"] != (bound == "on"):
        raise RuntimeError(f"asked for the pre-bound launcher {bound}, the library says "
                           f"{'on' if info['bound_launch'] else 'off'}")  # fmt: skip
    cases, breakdowns = {}, {}
    for dump in sorted(folder.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0):
        label, totals, costs = inclusive_costs(dump, ("tsin_", "tspart_"))
        if label.endswith("|breakdown"):
            case = label.removesuffix("|breakdown")
            breakdowns[case] = breakdown_per_step(costs, info["calls"], info["breakdown_calls"][case])
        elif label in info["cases"]:
            marked = sum(v for k, v in costs.items() if k.startswith("tsin_"))
            cases[label] = {"per_call": per_call(costs, info["calls"]), "inclusive": costs, "totals": totals,
                            "unmarked": totals - marked, "stub_launches": info["stub_launches"][label]}  # fmt: skip
    for label, figures in breakdowns.items():
        cases[label]["breakdown"] = figures
    missing = set(info["cases"]) - set(cases)
    if missing:
        raise RuntimeError(f"no callgrind dump for {sorted(missing)} in {folder}")
    return {**info, "bound": bound, "seconds": seconds, "load_before": load, "load_after": os.getloadavg(),
            "results": cases}  # fmt: skip


def warm(python: str, args, folder: Path) -> None:
    """The worker once without valgrind: Triton compiles, builds its launcher and the stub, fills its cache."""
    folder.mkdir(parents=True, exist_ok=True)
    command = worker_argv(python, args, folder / "warm.json", "--warm-only")
    done = subprocess.run(command, env=worker_env("on"), capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the warm-up run ({python}) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def ratio_rows(runs: list[dict]) -> list[dict]:
    """One row per (Python, case of ours, phase): torch's instructions per call, ours per launcher setting, ratios."""
    rows = []
    by_python: dict[str, list[dict]] = {}
    for run in runs:
        by_python.setdefault(run["python"], []).append(run)
    for python, group in by_python.items():
        torch_runs = [r["results"] for r in group]
        for label in group[0]["cases"]:
            variant, shape, policy = label.split("|")
            if variant != "ours":
                continue
            theirs = [r[f"torch|{shape}|torch"]["per_call"] for r in torch_runs if f"torch|{shape}|torch" in r]
            for phase in (p for p in PHASES if p in theirs[0]):
                torch_ir = theirs[0][phase]
                row = {"python": python, "triton": group[0]["triton"], "torch_version": group[0]["torch"],
                       "shape": shape, "policy": policy, "phase": phase, "torch": torch_ir,
                       "torch_spread": (max(t[phase] for t in theirs) - min(t[phase] for t in theirs)) / torch_ir}  # fmt: skip
                for run in group:
                    ours = run["results"][label]["per_call"][phase]
                    row[f"ours {run['bound']}"] = ours
                    row[f"ratio {run['bound']}"] = ours / torch_ir
                rows.append(row)
    return rows


def table(rows: list[dict], bounds: list[str]) -> str:
    head = ["triton", "case", "phase", "torch"] + [f"ours, pre-bound {b}" for b in bounds]
    head += [f"ours/torch, {b}" for b in bounds]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = [row["triton"], f"{row['shape']}, {row['policy']}", row["phase"], f"{row['torch'] / 1e3:.1f}k"]
        cells += [f"{row[f'ours {b}'] / 1e3:.1f}k" for b in bounds]
        cells += [f"{row[f'ratio {b}']:.2f}" for b in bounds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def last_line(rows: list[dict], bounds: list[str]) -> str:
    """The largest ours/torch at one tensor per compared phase, over the policies and Pythons run."""
    bound = "on" if "on" in bounds else "off"
    worst = {}
    for row in rows:
        if row["shape"].startswith("1x") and row["phase"] in TARGETS:
            worst[row["phase"]] = max(worst.get(row["phase"], 0.0), row[f"ratio {bound}"])
    figures = ", ".join(f"{phase} {worst[phase]:.2f}" for phase in TARGETS if phase in worst)
    return f"host instructions at 1 tensor, ours/torch: {figures}"


def machine_info() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import cpu_model

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return {"processor": cpu_model(), "cores": os.cpu_count(), "commit": commit.stdout.strip() or None,
            "valgrind": valgrind.stdout.strip(), "platform": platform.platform()}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    missing = valgrind_missing()
    if missing:
        raise SystemExit(f"bench/launch_cost.py needs callgrind: {missing}")
    pythons = args.python or [sys.executable]
    info = machine_info()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        for k, python in enumerate(pythons):
            print(f"{python}: warming Triton's cache (no valgrind) ...", flush=True)
            warm(python, args, root / f"python{k}")
            for bound in args.bound:
                print(f"{python}: callgrind, pre-bound launcher {bound}, {args.calls} steps per case ...", flush=True)
                run = run_once(python, bound, args, root / f"python{k}" / bound)
                print(f"  triton {run['triton']}, torch {run['torch']}: {run['seconds']:.0f} s, load "
                      f"{run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f}", flush=True)  # fmt: skip
                runs.append(run)
    rows = ratio_rows(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    repeat = ""
    if len(args.bound) > 1:  # torch ran in each run of a Python: its figures' spread is the repeatability
        repeat = f"; torch's figures in two runs differ by at most {max(r['torch_spread'] for r in rows):.2%}"
    print(f"host instructions per call (callgrind Ir), {info['processor']}, {info['cores']} cores{repeat}")
    print(table(rows, args.bound))
    if args.breakdown:
        print("inside the measured phases, per step (inclusive; each callable wrapped alone):")
        print(breakdown_table(runs))
    args.out.write_text(json.dumps({"machine": info, "args": meta, "runs": runs, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    print(last_line(rows, args.bound))
    return 0


if __name__ == "__main__":
    sys.exit(main())
