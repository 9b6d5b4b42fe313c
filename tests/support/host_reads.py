"""A switch that makes every Tensor -> host read raise: the step must never wait on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tritonscale import StepLog

SYNCING = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "numpy")


class HostRingReads:
    """The reads that are no read of a device value: StepLog's of its own host ring, inside
    ``StepLog._read`` (rows whose copy finished; on a GPU pinned host memory). On the CPU, where the
    GPU paths run, the ring is as much a CPU tensor as the device values, so it is told apart by the
    read it is in and its memory: only the ring's storage, and only while its own log reads it."""

    def __init__(self, setattr_=setattr) -> None:
        self.storage: int | None = None  # the address of the ring being read, or None
        read = StepLog._read

        def reading_the_ring(log, *args, **kwargs):
            outer, self.storage = self.storage, log._ring.untyped_storage().data_ptr()
            try:
                return read(log, *args, **kwargs)
            finally:
                self.storage = outer

        setattr_(StepLog, "_read", reading_the_ring)

    def allows(self, tensor: torch.Tensor) -> bool:
        """True for a read of the ring StepLog is reading now."""
        return self.storage is not None and tensor.untyped_storage().data_ptr() == self.storage


class HostReadGuard:
    """While ``on``, each Tensor method in SYNCING raises AssertionError naming itself, except on
    host memory (``HostRingReads``)."""

    def __init__(self, setattr_=setattr) -> None:
        self.on = False
        self.host_memory = HostRingReads(setattr_)
        for name in SYNCING:
            original = getattr(torch.Tensor, name)

            def guard(tensor, *a, _name=name, _original=original, **k):
                if self.on and not self.host_memory.allows(tensor):
                    raise AssertionError(f"host read Tensor.{_name} inside the step")
                return _original(tensor, *a, **k)

            setattr_(torch.Tensor, name, guard)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False
