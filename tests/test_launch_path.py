"""The launch-path tier: every per-step kernel launched through Triton's real launch path, on a CPU.

The rest of the suite runs the kernels through Triton's interpreter, which never reaches the path a
GPU step's host time goes through (``JITFunction.run`` -> ``triton.compile`` -> ``CompiledKernel``
-> the C launcher). Here the library's own steps run on the GPU paths (backend "triton", the host
read switch off, tests/launch_path/scenarios.py) in a subprocess without ``TRITON_INTERPRET``,
over the harness of ``tests/launch_path`` (its docstring): level 2, Triton's own driver and C
launcher over a stub ``libcuda.so.1`` whose ``cuLaunchKernelEx`` copies the parameter block, for
the checks of what a GPU would receive; level 1, a fake driver recording the launcher's calls.

Oracles, independent of Triton's launcher: the parameter block computed from the launch's
arguments and the compiled signature (``launch_path/param_block.py``), laid out by the cubin's own
parameter table; the specialization restated from Triton's documented rules
(``launch_path/specialization.py``); the launch configuration from the compiled metadata.

Compiles go to one Triton cache per session, so each specialization compiles once. Runs on the
installed triton (the CI's) and, through ``.ci/check_gpu_floor``, on triton 3.6.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import tritonscale
from tritonscale.kernels import TRITON_FOUND

TESTS = Path(__file__).resolve().parent
PACKAGE_ROOT = Path(tritonscale.__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.launch_path,
    pytest.mark.skipif(not TRITON_FOUND, reason="needs triton"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the stub libcuda and Triton's launcher)"),
]

#: Every per-step kernel the library launches, by the name the launcher reports.
KERNELS = (
    "check_pass_kernel",
    "finalize_kernel",
    "apply_kernel",
    "policy_update_kernel",
    "gather_stats_kernel",
    "advance_lr_kernel",
)


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launch-path-triton-cache")


def run_tier(tmp_path: Path, cache: Path, *args: str) -> dict:
    """Run ``python -m launch_path.run`` in a subprocess without TRITON_INTERPRET; its report."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["TRITON_CACHE_DIR"] = str(cache)
    # Every launch through Triton's JIT path, whose launcher gets the tensors themselves: their
    # specialization and blocks are checked here against the arguments. The pre-bound launches
    # (which pass the tensors' addresses) are checked against the JIT path's, block for block, by
    # tests/test_bound_launch.py.
    env["TRITONSCALE_BOUND_LAUNCH"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), str(TESTS), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "launch_path.run", *args, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"launch_path.run {' '.join(args)} failed:\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"]
    return report


@pytest.fixture(scope="module")
def level2(tmp_path_factory, triton_cache) -> dict:
    return run_tier(tmp_path_factory.mktemp("level2"), triton_cache, "--level", "2")


def launches_of(report: dict, kernel: str) -> list[dict]:
    return [launch for launch in report["launches"] if launch["kernel"] == kernel]


def label(launch: dict) -> str:
    return f"{launch['scenario']}: {launch['kernel']} {launch['variant']}"


def test_every_per_step_kernel_runs_through_the_real_launcher(level2):
    launched = defaultdict(set)
    for launch in level2["launches"]:
        variant = launch["variant"]
        launched[launch["kernel"]].add(tuple(sorted((k, v) for k, v in variant.items() if k != "BLOCK")))
    assert set(launched) == set(KERNELS)

    def seen(kernel, **constexprs):
        return any(all(dict(v).get(k) == want for k, want in constexprs.items()) for v in launched[kernel])

    assert seen("check_pass_kernel", FLAT=True) and seen("check_pass_kernel", FLAT=False)
    assert seen("apply_kernel", FLAT=False, CHECK=True) and seen("apply_kernel", FLAT=False, CHECK=False)
    assert seen("apply_kernel", FLAT=True, CHECK=True) and seen("apply_kernel", FLAT=True, CHECK=False)
    assert seen("finalize_kernel", FOLD=True) and seen("finalize_kernel", FOLD=False)
    # The default policy and hysteresis=2, skip_norm_factor=5.0; the update and update(new_scale).
    assert seen("policy_update_kernel", **{"R.HYSTERESIS": 1, "R.AVERAGE_NORM": False})
    assert seen("policy_update_kernel", **{"R.HYSTERESIS": 2, "R.AVERAGE_NORM": True})
    assert seen("policy_update_kernel", COUNT_ONLY=True) and seen("policy_update_kernel", COUNT_ONLY=False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_parameter_block_is_the_arguments(level2, kernel):
    """What cuLaunchKernelEx receives, laid out by the cubin, equals the block computed from the
    launch's arguments: every pointer its tensor's address, every scalar packed by its type."""
    launches = launches_of(level2, kernel)
    assert launches
    for launch in launches:
        assert launch["stub"]["num_params"] == launch["num_params"], label(launch)
        assert launch["params_equal"], (
            f"{label(launch)}: cuLaunchKernelEx got {launch['params']}, the arguments give {launch['expected_params']}"
        )


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_specialization_follows_the_arguments(level2, kernel):
    for launch in launches_of(level2, kernel):
        assert launch["signature"] == launch["expected_signature"], label(launch)
        assert launch["divisible"] == launch["expected_divisible"], label(launch)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_launch_configuration_is_the_compiled_one(level2, kernel):
    from launch_path.fake_driver import FAKE_STREAM

    for launch in launches_of(level2, kernel):
        stub = launch["stub"]
        assert stub["name"] == kernel, label(launch)
        assert stub["grid"] == launch["grid"], label(launch)
        assert stub["block"] == [32 * launch["num_warps"], 1, 1], label(launch)
        assert stub["shared"] == launch["shared"] and stub["stream"] == launch["stream"] == FAKE_STREAM


def test_the_flat_apply_autotuner_benchmarks_every_candidate_once_per_key(level2):
    from tritonscale.kernels.launch_config import DEFAULT_BLOCK, streaming_configs

    configs = streaming_configs()
    flat = [launch for launch in launches_of(level2, "apply_kernel") if launch["variant"]["FLAT"]]
    for check in (True, False):
        keyed = [launch for launch in flat if launch["variant"]["CHECK"] is check]
        tuned = [(launch["variant"]["BLOCK"], launch["num_warps"]) for launch in keyed]
        # Each candidate once under the benchmarker, then the launch itself with the winner (the
        # first config: the fake benchmarker times the n-th candidate n ms); later launches reuse it.
        assert tuned[: len(configs)] == [(c.kwargs["BLOCK"], c.num_warps) for c in configs]
        assert set(tuned[len(configs) :]) == {(DEFAULT_BLOCK, configs[0].num_warps)}
    assert level2["benchmarked"] == 2 * len(configs)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_launch_checks_no_module_global(level2, kernel):
    """Triton's JIT path compares every module-level global a kernel (3.9: and its callees) reads
    with its current value on each launch, ~9k instructions each; the kernels take their constants
    as a defaulted constexpr parameter instead (kernels/interfaces.py, KernelConstants)."""
    assert level2["globals_checked"][kernel] == []


def test_a_swapped_argument_is_caught(tmp_path, triton_cache):
    """The check can fail: with the first two tensor arguments swapped on the way to Triton's C
    launcher (a wrong argument order, which would compute garbage silently on a GPU), every block
    with two distinct tensors differs from the one the arguments give."""
    report = run_tier(tmp_path, triton_cache, "--level", "2", "--scenarios", "fused_flat_default", "--canary")
    pointers = [sum(ty.startswith("*") for ty in launch["signature"].values()) for launch in report["launches"]]
    swapped = [launch for launch, count in zip(report["launches"], pointers) if count >= 2]
    assert swapped and not any(launch["params_equal"] for launch in swapped)


def test_level_1_records_the_launches_level_2_makes(tmp_path, triton_cache, level2):
    """The fake driver (level 1) sees the same launches as Triton's own driver over the stub."""
    report = run_tier(tmp_path, triton_cache, "--level", "1", "--scenarios", "fused_flat_default")

    def seen(r):
        keys = ("kernel", "variant", "grid", "signature", "divisible", "num_warps")
        launches = [launch for launch in r["launches"] if launch["scenario"] == "fused_flat_default"]
        return [tuple(json.dumps(launch[k], sort_keys=True) for k in keys) for launch in launches]

    assert seen(report) == seen(level2) and seen(report)


# ---------------------------------------------------------------- the oracles themselves
def test_expected_params_packs_by_the_specialized_type():
    import torch
    from launch_path.param_block import expected_params

    x = torch.zeros(4)
    signature = {"x": "*fp32", "n": "i32", "big": "i64", "f": "fp32", "d": "fp64", "h": "bf16", "K": "constexpr"}
    block = expected_params(signature, (x, -3, 2**40, 0.1, 0.1, 1.5, 7))
    assert block[0] == struct.pack("<Q", x.data_ptr())
    assert block[1] == struct.pack("<i", -3) and block[2] == struct.pack("<q", 2**40)
    assert block[3] == struct.pack("<f", 0.1) and block[4] == struct.pack("<d", 0.1)
    assert block[5] == struct.pack("<f", 1.5)[2:]
    assert block[6:] == [bytes(8), bytes(8)]  # the global and profile scratch, none needed
    with pytest.raises(ValueError, match="3 arguments for a signature of 7"):
        expected_params(signature, (x, 1, 2))


def test_specialization_rules():
    import torch
    from launch_path.specialization import arg_type

    x = torch.zeros(8)
    assert arg_type(x, False) == ("*fp32", True) and arg_type(x[1:], False) == ("*fp32", False)
    assert arg_type(1, False) == ("constexpr", False) and arg_type(None, False) == ("constexpr", False)
    assert arg_type(0, False) == ("i32", True) and arg_type(3, False) == ("i32", False)
    assert arg_type(2**31, False) == ("i64", True) and arg_type(True, False) == ("i1", False)
    assert arg_type(0.5, False) == ("fp32", False) and arg_type(5, True) == ("constexpr", False)
