"""Level 2: Triton's own CudaDriver, CudaUtils and C launcher, over a stub ``libcuda.so.1``.

``stub_libcuda.c`` is built with gcc, against the running Triton's bundled ``cuda.h``, into a
cache folder (``$TRITONSCALE_STUB_DIR``, else ``<tempdir>/tritonscale-stub-libcuda/<hash>``)::

    gcc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -I<triton>/backends/nvidia/include \\
        -o <dir>/libcuda.so.1 tests/launch_path/stub_libcuda.c

``activate()`` points ``TRITON_LIBCUDA_PATH`` (``knobs.nvidia.libcuda_path``) at that folder and
makes a ``StubbedCudaDriver`` active: Triton's ``CudaDriver`` as it is (``CudaUtils`` builds
Triton's driver.c with gcc and links it to the stub; the launcher is Triton's), with only the
device, stream and capability queries (which torch's CPU build cannot answer) fixed. Each
``cuLaunchKernelEx`` lands in the stub as a ``StubLaunch``; ``launches()`` reads them back::

    driver = stub.activate()
    kernel[(4,)](x, n, BLOCK=128)
    launch = stub.launches()[-1]   # .name, .grid, .block, .stream, .params: [bytes per parameter]

The driver's ``python_launches`` holds the same launches as Python saw them (level 1's ``Launch``:
the bound arguments and the specialized signature), so a test can compute the expected block with
``param_block.expected_params`` and compare.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from triton.backends.nvidia.driver import CudaDriver

from .fake_driver import CAPABILITY, DEVICE, FAKE_STREAM, Launch, counting_benchmarker

SOURCE = Path(__file__).with_name("stub_libcuda.c")
MAX_PARAMS, MAX_BYTES = 128, 4096


def _cuda_include() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "include"


def build(directory: str | os.PathLike | None = None) -> Path:
    """Build the stub (once per source and cuda.h) and return the folder holding ``libcuda.so.1``.

    Args:
        directory: where to build; default ``$TRITONSCALE_STUB_DIR`` or a temp-dir cache.
    Returns:
        the folder, for ``TRITON_LIBCUDA_PATH``.
    """
    include = _cuda_include()
    digest = hashlib.sha256(SOURCE.read_bytes() + (include / "cuda.h").read_bytes()).hexdigest()[:16]
    if directory is None:
        cache = Path(tempfile.gettempdir()) / "tritonscale-stub-libcuda" / digest
        directory = os.environ.get("TRITONSCALE_STUB_DIR") or cache
    directory = Path(directory)
    library = directory / "libcuda.so.1"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"libcuda.so.1.{os.getpid()}"
        flags = ["-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", f"-I{include}"]
        subprocess.run(["gcc", *flags, "-o", str(partial), str(SOURCE)], check=True)
        partial.replace(library)  # atomic: concurrent builders never see half a library
    return directory


class _Record(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 256),
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shared", ctypes.c_uint32),
        ("stream", ctypes.c_uint64),
        ("num_attrs", ctypes.c_uint32),
        ("num_params", ctypes.c_int32),
        ("offsets", ctypes.c_uint16 * MAX_PARAMS),
        ("sizes", ctypes.c_uint16 * MAX_PARAMS),
        ("block_size", ctypes.c_uint32),
        ("bytes", ctypes.c_uint8 * MAX_BYTES),
    ]


@dataclass
class StubLaunch:
    """One ``cuLaunchKernelEx`` the stub received: the kernel's name, the launch configuration, and
    ``params``, each kernel parameter's bytes as the cubin lays them out (``offsets``)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    stream: int
    num_attrs: int
    offsets: tuple[int, ...]
    params: list[bytes]


_library: ctypes.CDLL | None = None


def _load(directory: Path) -> ctypes.CDLL:
    global _library
    if _library is None:
        # RTLD_GLOBAL, before Triton builds anything: its modules' libcuda.so.1 resolves to this one.
        _library = ctypes.CDLL(str(directory / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
        _library.stub_launch.restype = ctypes.POINTER(_Record)
        _library.stub_launch.argtypes = [ctypes.c_int64]
        _library.stub_launch_count.restype = ctypes.c_int64
        _library.stub_record_size.restype = ctypes.c_size_t
        assert _library.stub_record_size() == ctypes.sizeof(_Record), "stub_libcuda.c and stub.py disagree"
    return _library


def launches() -> list[StubLaunch]:
    """Every launch the stub has received since the last ``reset()``, oldest first."""
    library = _library
    out = []
    for i in range(library.stub_launch_count()):
        r = library.stub_launch(i).contents
        offsets = tuple(r.offsets[: r.num_params])
        raw = bytes(r.bytes)
        out.append(
            StubLaunch(
                name=r.name.decode(),
                grid=tuple(r.grid),
                block=tuple(r.block),
                shared=r.shared,
                stream=r.stream,
                num_attrs=r.num_attrs,
                offsets=offsets,
                params=[raw[o : o + r.sizes[k]] for k, o in enumerate(offsets)],
            )
        )
    return out


def reset() -> None:
    """Forget the launches received so far (the stub's and the driver's Python-side records)."""
    _library.stub_reset()
    from triton.runtime.driver import driver

    if isinstance(driver.active, StubbedCudaDriver):
        driver.active.python_launches.clear()


class StubbedCudaDriver(CudaDriver):
    """Triton's CudaDriver over the stub; only the torch.cuda queries are replaced. With
    ``record_python`` its launcher also appends each call to ``python_launches`` (level 1's
    ``Launch``) before Triton's C launcher runs it."""

    def __init__(self, record_python: bool = True) -> None:
        super().__init__()
        self.get_current_device = lambda: DEVICE
        self.set_current_device = lambda device: None
        self.get_current_stream = lambda device=None: FAKE_STREAM
        self.get_device_capability = lambda device=None: CAPABILITY
        self.python_launches: list[Launch] = []
        self.benchmarked = 0
        self.triton_launcher_cls = self.launcher_cls  # Triton's CudaLauncher
        if record_python:
            self.launcher_cls = self._recording_launcher

    def _recording_launcher(self, src, metadata):
        run = self.triton_launcher_cls(src, metadata)

        def recorded(gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
            self.python_launches.append(
                Launch(metadata.name, (gx, gy, gz), stream, function, packed, launch_metadata, enter, exit_,
                       args, dict(src.signature), dict(getattr(src, "constants", {})), metadata, src)
            )
            return run(gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args)

        return recorded

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        """Triton's do_bench times with torch.cuda events: fake_driver.counting_benchmarker instead
        (each candidate launched once through the real launcher)."""
        return counting_benchmarker(self)


def activate(directory: str | os.PathLike | None = None, *, record_python: bool = True) -> StubbedCudaDriver:
    """Build the stub, point Triton at it and make a StubbedCudaDriver the active driver.

    Call it first thing in a process without ``TRITON_INTERPRET`` (before anything builds
    Triton's CUDA utils).

    Args:
        directory: where to build the stub (see ``build``).
        record_python: also record each launcher call on the Python side (``python_launches``);
            off when measuring the launcher's own cost.
    Returns:
        the active driver.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the stubbed driver runs the JIT path: unset TRITON_INTERPRET in this process")
    folder = build(directory)
    os.environ["TRITON_LIBCUDA_PATH"] = str(folder)
    _load(folder)
    from triton.runtime.driver import driver as config

    active = StubbedCudaDriver(record_python)
    config.set_active(active)
    return active
