"""grads/bounded_cache.py: least-recently-used eviction, against a plain-list model of it."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict

import pytest

from tritonscale.grads.bounded_cache import BoundedCache


class _ListModel:
    """The same contract written the obvious way: most recent last, the first dropped past size."""

    def __init__(self, size: int) -> None:
        self.size, self.items = size, []

    def get(self, key):
        for i, (k, v) in enumerate(self.items):
            if k == key:
                self.items.append(self.items.pop(i))
                return v
        return None

    def put(self, key, value) -> None:
        self.items = [(k, v) for k, v in self.items if k != key] + [(key, value)]
        if len(self.items) > self.size:
            self.items.pop(0)


@pytest.mark.parametrize("size", [1, 3, 16])
def test_gets_and_puts_match_the_list_model(size):
    rng = random.Random(size)
    cache, model = BoundedCache(size), _ListModel(size)
    for step in range(2000):
        key = rng.randrange(2 * size + 2)
        if rng.random() < 0.5:
            assert cache.get(key) == model.get(key), step
        else:
            cache.put(key, (key, step))
            model.put(key, (key, step))
        assert len(cache) == len(model.items) <= size


def test_a_hit_keeps_an_entry_from_eviction():
    cache = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3


def test_a_put_from_another_thread_between_a_lookup_and_its_move_is_safe():
    """The layouts cache is one per process, shared by every thread's scaler: a put in another
    thread that evicts the entry a get just found (the GIL may switch between the two dictionary
    calls) must neither raise nor leave the cache over its size. The other thread's put runs
    exactly there; it may have to wait for the get to finish."""
    cache = BoundedCache(1)
    cache.put("a", 1)
    worker = threading.Thread(target=cache.put, args=("b", 2))

    class EvictedMidGet(OrderedDict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if key == "a" and not worker.is_alive() and worker.ident is None:
                worker.start()
                worker.join(timeout=0.2)  # returns at once without a lock; waits 0.2 s with one
            return value

    cache._entries = EvictedMidGet(cache._entries)
    assert cache.get("a") == 1
    worker.join()
    assert len(cache) == 1 and cache.get("b") == 2 and cache.get("a") is None
