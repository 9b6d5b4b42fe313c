"""Level 1: a fake active CUDA driver that runs Triton's real JIT path on CPU tensors.

Nothing of Triton's runtime is replaced except what asks the machine: the device, stream and
capability queries answer fixed values (device 0, stream ``FAKE_STREAM``, sm_90), ``load_binary``
hands out dummy module/function handles, ``get_device_properties`` plausible H100-like numbers,
and ``launcher_cls`` is a recorder in place of the C launcher. So a ``kernel[grid](...)`` goes
through the binder, the specialization, the cache key, the globals check, ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` (a real cubin, made by the bundled ptxas) and ``CompiledKernel``,
and ends in ``Launch`` records instead of a GPU. Use it in a process WITHOUT ``TRITON_INTERPRET``
(``tests/conftest.py`` sets it; the tier runs its own subprocess, tests/launch_path/__init__.py).

    driver = activate()            # before the first launch; returns the FakeCudaDriver
    kernel[(4,)](x, n, BLOCK=128)  # x a CPU tensor
    call = driver.launches[-1]     # a Launch: grid, stream, function, packed_metadata, args, ...

The autotuner's benchmarker is ``FakeCudaDriver.get_benchmarker``: it launches each candidate once
(recorded like any launch) and reports the n-th candidate timed as n ms, so the first config wins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver

#: What the fake device answers.
TARGET = GPUTarget("cuda", 90, 32)
CAPABILITY = (9, 0)
DEVICE = 0
FAKE_STREAM = 0x5EED
#: H100 SXM-like figures (get_device_properties' keys, as Triton's driver.c returns them).
PROPERTIES = {
    "max_shared_mem": 232448,
    "max_num_regs": 65536,
    "multiprocessor_count": 132,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 5120,
}
#: load_binary's answer besides the handles: registers, spills, max threads per block.
N_REGS, N_SPILLS, MAX_THREADS = 32, 0, 1024


@dataclass
class Launch:
    """One launcher call, as ``CompiledKernel.run`` made it.

    ``args`` are every bound argument in declaration order, constexprs included (Triton's C
    launcher drops those by ``signature``). ``signature`` maps each parameter name to its
    specialized type (``"*fp32"``, ``"i32"``, ``"constexpr"``, ...), ``constants`` the constexpr
    values the kernel was compiled with, ``metadata`` the compiled kernel's metadata (``name``,
    ``num_warps``, ``shared``, ...)."""

    name: str
    grid: tuple[int, int, int]
    stream: int
    function: Any
    packed_metadata: Any
    launch_metadata: Any
    enter_hook: Any
    exit_hook: Any
    args: tuple
    signature: dict
    constants: dict
    metadata: Any
    src: Any = None  # the compiled kernel's ASTSource (src.fn the JITFunction, src.attrs)


class RecordingLauncher:
    """``launcher_cls`` of the fake driver: built per compiled kernel, records each call."""

    def __init__(self, driver: "FakeCudaDriver", src, metadata) -> None:
        self.driver = driver
        self.src = src
        self.metadata = metadata

    def __call__(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        self.driver.launches.append(
            Launch(
                name=self.metadata.name,
                grid=(gx, gy, gz),
                stream=stream,
                function=function,
                packed_metadata=packed_metadata,
                launch_metadata=launch_metadata,
                enter_hook=enter,
                exit_hook=exit_,
                args=args,
                signature=dict(self.src.signature),
                constants=dict(getattr(self.src, "constants", {})),
                metadata=self.metadata,
                src=self.src,
            )
        )


class FakeUtils:
    """The ``utils`` of the fake driver: what ``CompiledKernel`` and ``triton.compile`` call."""

    def __init__(self) -> None:
        self._handles = itertools.count(0x1000)
        self.loaded: list[str] = []

    def load_binary(self, name, kernel, shared, device):
        """Returns (module, function, n_regs, n_spills, n_max_threads), dummy handles."""
        assert isinstance(kernel, bytes) and kernel[:4] == b"\x7fELF", "expected a cubin"
        self.loaded.append(name)
        return next(self._handles), next(self._handles), N_REGS, N_SPILLS, MAX_THREADS

    def unload_module(self, module) -> None:
        pass

    def get_device_properties(self, device):
        return dict(PROPERTIES)

    def set_printf_fifo_size(self, size) -> None:
        pass


class FakeCudaDriver(CudaDriver):
    """A CudaDriver for a CPU-only machine (see the module docstring). Its ``launches`` list holds
    every recorded launch, oldest first; ``benchmarked`` counts the autotuner's timed runs."""

    def __init__(self) -> None:  # not CudaDriver's: that builds driver.c against libcuda
        self.utils = FakeUtils()
        self.launcher_cls = lambda src, metadata: RecordingLauncher(self, src, metadata)
        self.launches: list[Launch] = []
        self.benchmarked = 0

    # The queries GPUDriver would forward to torch.cuda (absent here).
    def get_current_device(self):
        return DEVICE

    def set_current_device(self, device) -> None:
        assert device == DEVICE

    def get_current_stream(self, device=None):
        return FAKE_STREAM

    def get_device_capability(self, device=None):
        return CAPABILITY

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        return counting_benchmarker(self)


def counting_benchmarker(driver):
    """The autotuner's benchmarker for a driver with no device to time: each call runs the
    candidate once (a launch like any other) and reports the n-th candidate as n ms, so the first
    config wins; ``driver.benchmarked`` counts the calls."""

    def bench(fn, quantiles=None, **_):
        fn()
        driver.benchmarked += 1
        ms = float(driver.benchmarked)
        return [ms, ms, ms] if quantiles else ms

    return bench


def activate() -> FakeCudaDriver:
    """Make a fresh FakeCudaDriver Triton's active driver and return it.

    Call it before the first launch, in a process where ``TRITON_INTERPRET`` is unset (the kernels
    must be ``JITFunction``s). Returns:
        the driver; its ``launches`` list receives every launch from now on.
    """
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the fake driver runs the JIT path: unset TRITON_INTERPRET in this process")
    driver = FakeCudaDriver()
    from triton.runtime.driver import driver as config

    config.set_active(driver)
    return driver
