"""One small least-recently-used cache for the host-side work a step would otherwise redo.

Layouts (``flat_runs``) and the overlap check (``groups.py``) are each found from the
gradients' memory and used again on the next step, when the gradients are usually the same. Each
keeps at most a few entries here. (The kernels' launch tables, a pure function of their key, use
``functools.lru_cache`` in ``kernels/tensor_table.py``: kernels/ imports nothing of the package.)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedCache(Generic[V]):
    """At most ``size`` entries; a hit or a put makes its entry the most recent, and a put past
    ``size`` drops the least recent one.

    Sound only where an entry is proved again from the arguments on every use before it is trusted
    (``flat_runs``' layouts; a pure function of its key needs no such cache: ``functools.lru_cache``,
    as ``groups.py``' overlap check has). Each cache states its own argument beside it. One cache
    serves every thread of the process: a lock keeps another thread's put from evicting, between
    the two dictionary calls of a get or a put, the entry being moved."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        """The entry for ``key`` (now the most recent), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        """Store ``value`` (not None) for ``key`` as the most recent entry, dropping the least
        recent one past ``size``."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
