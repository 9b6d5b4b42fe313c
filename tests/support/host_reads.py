"""A switch that makes every Tensor -> host read raise: the step must never wait on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SYNCING = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "numpy")


class HostReadGuard:
    """While ``on``, each Tensor method in SYNCING raises AssertionError naming itself."""

    def __init__(self, setattr_=setattr) -> None:
        self.on = False
        for name in SYNCING:
            original = getattr(torch.Tensor, name)

            def guard(tensor, *a, _name=name, _original=original, **k):
                if self.on:
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
