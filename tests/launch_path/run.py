"""Run the tier's scenarios through one harness level and write what each launch did, as JSON.

Not a test module: ``tests/test_launch_path.py`` runs it in a subprocess without
``TRITON_INTERPRET``, with ``tests/`` and the package root on ``PYTHONPATH``::

    env -u TRITON_INTERPRET PYTHONPATH=$PWD:$PWD/tests python -m launch_path.run --level 2 --out launches.json

For every launch: the scenario, the kernel and its variant constexprs, the grid, Triton's
specialized signature and divisible parameters beside the ones ``specialization`` derives from the
arguments, and at level 2 whether the parameter block the stub's ``cuLaunchKernelEx`` received
equals ``param_block.expected_params`` (both in hex where they differ), with the block and grid
dimensions the C launcher passed. Per kernel: the module globals its launches check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


#: The constexprs that tell a kernel's variants apart in the report.
VARIANT = ("FLAT", "CHECK", "INVERT", "ALIGNED", "NORM", "HAS_CLIP", "FOLD", "DECIDE", "BLOCK", "COUNT_ONLY")
#: The policy rule's fields the report names (the default policy and the scenarios' rich one differ there).
RULE = ("HYSTERESIS", "AVERAGE_NORM")


def _variant(launch) -> dict:
    variant = {}
    for name, value in zip(launch.signature, launch.args):
        if name in VARIANT:
            variant[name] = value
        elif name == "R":
            variant.update({f"R.{field}": getattr(value, field) for field in RULE})
    return variant


def _describe(scenario: str, launch, jit_fn) -> dict:
    from launch_path.specialization import expected_specialization, triton_divisible

    signature, divisible = expected_specialization(jit_fn.arg_names, set(jit_fn.constexprs), launch.args)
    return {
        "scenario": scenario,
        "kernel": launch.name,
        "variant": _variant(launch),
        "grid": list(launch.grid),
        "stream": launch.stream,
        "num_warps": launch.metadata.num_warps,
        "shared": launch.metadata.shared,
        "signature": launch.signature,
        "expected_signature": signature,
        "divisible": sorted(triton_divisible(launch.src)),
        "expected_divisible": sorted(divisible),
    }


def _swapping(launcher_cls):
    import torch

    def make(src, metadata):
        run = launcher_cls(src, metadata)

        def swapped(*call):
            head, args = call[:9], list(call[9:])
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            if len(tensors) >= 2:
                i, j = tensors[:2]
                args[i], args[j] = args[j], args[i]
            return run(*head, *args)

        return swapped

    return make


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", type=int, choices=(1, 2), required=True)
    parser.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--canary",
        action="store_true",
        help="level 2: hand Triton's C launcher each launch's first two tensor arguments swapped "
        "(the Python-side record keeps the right order): every such block must then differ",
    )
    options = parser.parse_args(argv)

    if options.level == 1:
        from launch_path import fake_driver

        driver = fake_driver.activate()
        recorded = driver.launches
    else:
        from launch_path import stub

        driver = stub.activate()
        recorded = driver.python_launches
        if options.canary:
            driver.triton_launcher_cls = _swapping(driver.triton_launcher_cls)
    import triton

    from launch_path.param_block import expected_params
    from launch_path.scenarios import SCENARIOS, gpu_paths_on_cpu

    names = [n for n in options.scenarios.split(",") if n] or list(SCENARIOS)
    report = {"triton": triton.__version__, "level": options.level, "launches": [], "seconds": {}}
    for name in names:
        start, first = time.perf_counter(), len(recorded)
        first_stub = len(stub.launches()) if options.level == 2 else 0
        with gpu_paths_on_cpu():
            SCENARIOS[name]()
        report["seconds"][name] = round(time.perf_counter() - start, 2)
        received = stub.launches()[first_stub:] if options.level == 2 else None
        mine = recorded[first:]
        if received is not None and len(received) != len(mine):
            report["error"] = f"{name}: {len(mine)} launcher calls but {len(received)} cuLaunchKernelEx"
        for k, launch in enumerate(mine):
            entry = _describe(name, launch, launch.src.fn)
            expected = expected_params(launch.signature, launch.args)
            entry["num_params"] = len(expected)
            if received is not None and k < len(received):
                got = received[k]
                entry["stub"] = {
                    "name": got.name,
                    "grid": list(got.grid),
                    "block": list(got.block),
                    "stream": got.stream,
                    "shared": got.shared,
                    "num_params": len(got.params),
                }
                entry["params_equal"] = got.params == expected
                if not entry["params_equal"]:
                    entry["params"] = [p.hex() for p in got.params]
                    entry["expected_params"] = [p.hex() for p in expected]
            report["launches"].append(entry)
    report["benchmarked"] = getattr(driver, "benchmarked", 0)
    # The module globals each launched kernel checks on every launch (JITFunction.run compares each
    # entry of used_global_vals with the module's current value before it launches).
    functions = {launch.src.fn.__name__: launch.src.fn for launch in recorded}
    report["globals_checked"] = {name: sorted(n for n, _ in fn.used_global_vals) for name, fn in functions.items()}
    with open(options.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
