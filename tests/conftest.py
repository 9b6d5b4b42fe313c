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
from host_reads import HostReadGuard  # noqa: E402

from tritonscale.kernels import TRITON_FOUND  # noqa: E402
from tritonscale.passes.backends import BACKENDS as BACKEND_CHOICES  # noqa: E402

# Every concrete backend ("auto" picks one of them); without triton installed (a CPU install, where
# the tests that need no interpreter still run) only torch's.
BACKENDS = [name for name in BACKEND_CHOICES if name != "auto" and (TRITON_FOUND or name != "triton")]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """Make every Tensor->host read raise while the fixture's flag is on.

    On the CPU the step reads values where that waits for nothing (the CPU is the host: the torch
    backend's overflow probe, the policy rule on Python numbers); here it takes the paths it takes
    on a GPU instead, which must read nothing."""
    from tritonscale import host_reads

    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    return HostReadGuard(monkeypatch.setattr)


def pytest_collection_modifyitems(config, items):
    # The GPU tier runs compiled kernels on a real device; everything else runs anywhere.
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0":
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
