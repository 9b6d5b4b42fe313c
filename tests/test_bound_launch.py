"""Pre-bound launches (``tritonscale/kernels/bound_launch.py``): each per-step launch bound once
through Triton's JIT path and guarded on every call, never a wrong kernel.

The comparisons with the JIT path need Triton's real launch path, which this process (under
``TRITON_INTERPRET``, tests/conftest.py) does not have: ``tests/launch_path/bound_tier.py`` runs
them with pytest in a subprocess, over the launch-path harness at level 1 (the launcher's recorded
call) and level 2 (Triton's C launcher over the stub libcuda: the parameter blocks too). Its tests:
the library's steps (every kernel x policy x gradient layout x dtype) launch as the JIT path
launches; one-argument mutations (another dtype, an unaligned view, ints 0/1/3/16/2**31, None)
launch what the JIT path launches for them; the guard accepts exactly where Triton's own binder and
cache key pick a bound kernel (a property); globals, pre-run hooks and key knobs. Here: when the
bound path is off, and the specialization rule against Triton's native one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonscale
from tritonscale.kernels import TRITON_FOUND

TESTS = Path(__file__).resolve().parent
PACKAGE_ROOT = Path(tritonscale.__file__).resolve().parents[1]

pytestmark = [pytest.mark.launch_path, pytest.mark.skipif(not TRITON_FOUND, reason="needs triton")]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONSCALE_BOUND_LAUNCH")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), str(TESTS), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> Path:
    """One Triton cache for both levels: each specialization compiles once."""
    return tmp_path_factory.mktemp("bound-launch-triton-cache")


# Level 2 launches the same calls through Triton's C launcher; the property and the rule, which
# launch nothing, run at level 1 only.
LEVELS = {1: [], 2: ["-k", "not guard_accepts and not specialization_rule"]}


@pytest.mark.parametrize("level", LEVELS)
def test_bound_launches_equal_the_jit_paths(level, triton_cache):
    if level == 2 and shutil.which("gcc") is None:
        pytest.skip("level 2 needs gcc (the stub libcuda and Triton's launcher)")
    env = _env(TRITONSCALE_LAUNCH_LEVEL=str(level), TRITONSCALE_AUTOTUNE="0", TRITON_CACHE_DIR=str(triton_cache))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
         str(TESTS / "launch_path" / "bound_tier.py"), *LEVELS[level]],
        env=env, cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    output = f"{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"bound_tier.py at level {level}: {summary[0]}\n{output}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]


_SWITCHES = """
import importlib, os, triton
import tritonscale.kernels.bound_launch as b
def enabled(version=triton.__version__, switch=None):
    triton.__version__ = version
    os.environ.pop("TRITONSCALE_BOUND_LAUNCH", None)
    if switch is not None:
        os.environ["TRITONSCALE_BOUND_LAUNCH"] = switch
    return importlib.reload(b).ENABLED
print(enabled(), enabled(switch="0"), enabled(switch="1"), enabled("3.8.0"), enabled("3.10.0"), enabled("3.6.1"),
      enabled("3.9.2"))
"""


def test_off_under_the_interpreter():
    from tritonscale.kernels import bound_launch, policy_update
    from tritonscale.kernels.jit_helpers import INTERPRETING

    if not INTERPRETING:  # .ci/check_gpu_floor runs this file without the interpreter (--noconftest)
        pytest.skip("this process runs the JIT path")
    assert not bound_launch.ENABLED
    assert policy_update._UPDATE.declined == "bound launches are off" and not policy_update._UPDATE.bound


def test_off_by_the_environment_switch_and_on_an_untested_triton():
    """Decided at import: on with the JIT path and a tested triton (3.6.x, 3.9.x), off with
    ``TRITONSCALE_BOUND_LAUNCH=0`` or another triton (a fresh process, without the interpreter)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SWITCHES], env=_env(), cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "True", "False", "False", "True", "True"]


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64,
           torch.uint8, torch.bool]  # fmt: skip
_BUFFERS = {dtype: torch.zeros(64, dtype=dtype) for dtype in _DTYPES}
_EDGES = [2**k + d for k in (4, 31, 32, 63, 64) for d in (-17, -16, -1, 0, 1, 16)]


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.sampled_from([0, 1, 3, 16, -1, -16, *_EDGES, *(-e for e in _EDGES)]),
        st.integers(-(2**64), 2**64 - 1),
        st.booleans(),
        st.floats(),
        st.none(),
        st.builds(lambda dtype, offset: _BUFFERS[dtype][offset:], st.sampled_from(_DTYPES), st.integers(0, 17)),
        st.builds(lambda offset: torch.nn.Parameter(_BUFFERS[torch.float32][offset:]), st.integers(0, 4)),
    )
)
def test_the_specialization_rule_is_tritons_native_one(value):
    """``specialization`` returns what Triton's native binder returns for a runtime argument, and
    leaves to the JIT path what Triton refuses (an int outside 64 bits)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from tritonscale.kernels.bound_launch import Unbindable, specialization

    try:
        triton = tuple(native_specialize_impl(CUDABackend, value, False, True, True))
    except OverflowError:
        with pytest.raises(Unbindable):
            specialization(value)
        return
    assert specialization(value) == triton
