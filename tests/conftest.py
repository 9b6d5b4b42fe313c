"""Test set-up: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is imported (the @triton.jit decorator decides at
import time), so it is set here, before anything imports tritonscale. Compile-only tests run in a
subprocess without it (tests/test_compile_targets.py). On a GPU machine the GPU tier runs with the
compiled kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's default-change warning

import pytest  # noqa: E402
import torch  # noqa: E402

# The one tolerance table for norms, relative to a float64 oracle over the same stored values
# (elementwise unscale/clip results and scale updates are compared exactly).
#
# Kernels: all of the difference is float32 accumulation. In the property tests each of the 4096
# lanes of a program sums at most 48 terms (TABLE: <= 6 tensors of <= 70000 elements are <= 12
# chunk rows, 3 per program, 16 blocks each; FLAT: 70000 elements / 2 programs / 4096 < 16). Every
# term is exact up to one rounding (|g| * 2**k is exact, squaring rounds once), all terms are >= 0,
# and the 4096-lane sum adds ~12 levels of pairwise rounding. Worst case for the 1-norm (no square
# root to halve it): (48 + 12 + 2) * 2**-24 ~= 3.7e-6, plus the final rounding to float32 (6e-8).
# 1e-5 leaves a ~2.5x margin for every dtype; observed differences are ~1e-7. Multi-step runs over
# up to ~1e6 elements in other summation orders stay within it too.
NORM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
# The torch backend, where it differs: bfloat16 on CPU rounds each tensor's norm to bfloat16 once
# (torch's own clip_grad_norm_ precision, <= 2**-9 relative; see backends/torch_backend.py), and
# combining such norms keeps that relative bound. 2**-8: twice torch's own same-dtype error.
TORCH_BACKEND_NORM_RTOL = {**NORM_RTOL, torch.bfloat16: 2.0**-8}

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


SYNCING = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "numpy")


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """Make every Tensor->host read raise while the fixture's flag is on."""
    armed = {"on": False}
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def guard(self, *a, _name=name, _original=original, **k):
            if armed["on"]:
                raise AssertionError(f"host read Tensor.{_name} inside the step")
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, guard)
    return armed


def pytest_collection_modifyitems(config, items):
    # The GPU tier runs compiled kernels on a real device; everything else runs anywhere.
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0":
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
