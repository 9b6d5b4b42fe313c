"""What a JIT launch of the per-step kernels spends on module globals, in checks and instructions.

Triton's ``JITFunction.run`` compares every module-level global a kernel reads (on 3.9 also those
its callees read) with the module's current value on each launch before it launches: on 3.9 each
``tl.constexpr`` comparison builds a constexpr, ~9k instructions. This prints, for the running
triton:

* the globals each per-step kernel's launch checks (``JITFunction.used_global_vals``, the dict that
  loop walks), by name;
* with ``--instructions``: instructions per call under valgrind's callgrind (``CALLGRIND_ZERO_STATS``
  / ``CALLGRIND_DUMP_STATS`` around ``CALLS`` calls, a bare loop's subtracted) of the default
  policy's update, through Triton's real launcher over the launch-path tier's stub libcuda
  (tests/launch_path/stub.py): ``policy_update_kernel[(1,)](...)`` (the JIT path) and
  ``update_policy_state_`` (the library's wrapper). Each is measured twice, interleaved; the lower
  count is printed.

Not a test; no GPU needed. Needs gcc; ``--instructions`` needs valgrind and its headers
(Debian: ``apt-get install valgrind``)::

    env -u TRITON_INTERPRET python bench/kernel_globals.py
    env -u TRITON_INTERPRET python bench/kernel_globals.py --instructions
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALLS = 200
KERNELS = (
    "check_pass:check_pass_kernel",
    "apply_pass:apply_kernel",
    "finalize:finalize_kernel",
    "policy_update:policy_update_kernel",
    "loop_state:gather_stats_kernel",
    "loop_state:advance_lr_kernel",
)
MARKS_C = """
#include <valgrind/callgrind.h>
void marks_zero(void) { CALLGRIND_ZERO_STATS; }
void marks_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _kernel(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(f"tritonscale.kernels.{module}"), name)


def checked_globals() -> dict[str, list[str]]:
    """Kernel name -> the globals each of its launches checks."""
    found = {}
    for spec in KERNELS:
        fn = _kernel(spec)
        fn.cache_key  # computes used_global_vals, as the first launch does
        found[fn.__name__] = sorted(name for name, _ in fn.used_global_vals)
    return found


def _marks(folder: Path) -> ctypes.CDLL:
    source, library = folder / "marks.c", folder / "libmarks.so"
    source.write_text(MARKS_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


def measure(folder: Path) -> None:
    """Run under callgrind: the calls between the marks (the dumps' names: jit, wrapper, bare)."""
    import torch

    from tritonscale import LossScalePolicy
    from tritonscale.kernels import policy_update
    from tritonscale.policy.kernel_form import kernel_rule

    marks = _marks(folder)
    policy = LossScalePolicy()
    scale = torch.full((), 2.0**16)
    tracker = torch.zeros((), dtype=torch.int32)
    counters = torch.zeros(7, dtype=torch.int32)
    norm_stats = torch.zeros(2)
    spike_stats = torch.zeros(0, dtype=torch.float64)
    found, skip = torch.zeros(()), torch.zeros(())
    tensors = (scale, tracker, counters, norm_stats, spike_stats)
    rule = kernel_rule(policy)

    def wrapper():
        policy_update.update_policy_state_(tensors, [found], [skip], None, rule)

    kernel = policy_update.policy_update_kernel
    captured = {}
    original = kernel.run

    def capture(*args, **kwargs):
        captured.update(args=args, kwargs=dict(kwargs))  # before run() adds its own keys
        return original(*args, **kwargs)

    kernel.run = capture
    wrapper()  # compiles, and shows the JIT call the wrapper makes
    del kernel.run
    args, kwargs = captured["args"], dict(captured["kwargs"])
    grid = kwargs.pop("grid")
    kwargs.pop("warmup")

    def jit():
        kernel[grid](*args, **kwargs)

    for name, call in (("bare", lambda: None), ("jit", jit), ("wrapper", wrapper)) * 2:  # twice: the lower counts
        for _ in range(20):
            call()
        marks.marks_zero()
        for _ in range(CALLS):
            call()
        marks.marks_dump(name.encode())


def instructions() -> dict[str, float]:
    """Instructions per call of each measured call, the bare loop subtracted."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
        command = [sys.executable, __file__, "--inside", folder]
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        totals = {}
        for dump in Path(folder).glob("callgrind.out.*"):
            text = dump.read_text(errors="replace")
            name = re.search(r"^desc: Trigger: Client Request: (\w+)", text, re.MULTILINE)
            total = re.search(r"^summary: (\d+)", text, re.MULTILINE)
            if name and total:
                per_call = int(total.group(1)) / CALLS
                totals[name.group(1)] = min(per_call, totals.get(name.group(1), per_call))
    bare = totals.pop("bare")
    return {name: value - bare for name, value in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instructions", action="store_true", help="also count instructions (valgrind)")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_globals: unset TRITON_INTERPRET (the JIT path is measured, not the interpreter)")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from launch_path import stub

    stub.activate(record_python=False)
    if options.inside:
        measure(Path(options.inside))
        return
    import triton

    for name, names in checked_globals().items():
        print(f"triton {triton.__version__}: {name}: {len(names)} globals checked per launch {names}")
    if options.instructions:
        for name, value in instructions().items():
            print(f"triton {triton.__version__}: {name}: {value / 1000:.0f}k instructions per call")


if __name__ == "__main__":
    main()
