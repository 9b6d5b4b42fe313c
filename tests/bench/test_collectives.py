"""bench/collectives.py's method, checked structurally: every timed call starts from a barrier that
comes after the untimed restore, with a warm-up round, and the ranks' medians are reported side by
side with their spread. (A test that two real ranks' medians agree within a factor would not be
robust on a shared 2-core machine, where a neighbour can stall one rank for milliseconds.)"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name

import collectives  # noqa: E402


def test_every_timed_call_starts_from_a_barrier_after_the_restore():
    events = []
    variants = {name: (lambda name=name: events.append(("call", name))) for name in ("a", "b", "c")}
    timed = collectives.lockstep(variants, repeats=4, restore=lambda name: events.append(("restore", name)),
                                 barrier=lambda: events.append(("barrier", None)))  # fmt: skip
    calls = [i for i, (kind, _) in enumerate(events) if kind == "call"]
    assert len(calls) == 3 * (4 + 1)  # a warm-up round, then 4 timed ones
    for i in calls:
        assert events[i - 1] == ("barrier", None) and events[i - 2] == ("restore", events[i][1])
    assert all(len(t["samples_ms"]) == 4 for t in timed.values())


def test_rank_spread_is_the_largest_median_over_the_smallest():
    per_rank = [
        {"x": {"median_ms": 3.47}, "y": {"median_ms": 1.0}},
        {"x": {"median_ms": 0.38}, "y": {"median_ms": 1.0}},
    ]
    spread = collectives.rank_spread(per_rank)
    assert spread["x"] == {"median_ms_per_rank": [3.47, 0.38], "spread": 3.47 / 0.38}
    assert spread["y"]["spread"] == 1.0
