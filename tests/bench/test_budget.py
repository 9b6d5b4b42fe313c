"""bench/budget.py's float16 autocast probe: one wild sample does not move it, and a ratio that
cannot be (float16 faster than float32 on a CPU without fast float16) is measured again, then
bounded. The calls advance a fake clock, so nothing here looks at a real time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name

import budget  # noqa: E402


class FakeClock:
    """A clock that only moves when a fake call says how long it took."""

    def __init__(self):
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def call(self, seconds):
        """A matmul call taking ``seconds(k)`` on the clock, ``k`` counting this call's runs."""
        runs = []

        def run():
            self.now += seconds(len(runs))
            runs.append(1)
            self.calls += 1

        return run


def calls_taking(clock: FakeClock, float32, float16, bfloat16=lambda k: 1e-3):
    return {"float32": clock.call(float32), "float16": clock.call(float16), "bfloat16": clock.call(bfloat16)}


def test_one_wild_sample_does_not_move_the_autocast_ratio():
    # float16 takes 30x float32 in every round, but one round's float32 call is stalled 200x by a
    # neighbour (a ratio of 0.15 that round) and another's float16 call 50x (1500).
    steady = 30.0
    for wild in ({"float32": 3}, {"float16": 4}):
        clock = FakeClock()
        wild32, wild16 = wild.get("float32"), wild.get("float16")
        f32 = lambda k, w=wild32: 1e-3 * (200 if k == w else 1)
        f16 = lambda k, w=wild16: steady * 1e-3 * (50 if k == w else 1)
        ratios, notes = budget.matmul_slowdown(calls_taking(clock, f32, f16), rounds=7, clock=clock, fast_float16=False)
        assert ratios["float16"] == pytest.approx(steady, rel=1e-9) and notes == []  # the clock's float sums
        assert ratios["bfloat16"] == pytest.approx(1.0, rel=1e-9)


def test_a_float16_ratio_below_one_without_fast_float16_is_measured_again_then_bounded():
    clock = FakeClock()
    fast_f16 = calls_taking(clock, float32=lambda k: 1e-3, float16=lambda k: 0.2e-3)  # "0.2x", every round
    ratios, notes = budget.matmul_slowdown(fast_f16, rounds=5, clock=clock, fast_float16=False)
    assert ratios["float16"] == 1.0 and len(notes) == 1 and "0.20x" in notes[0]
    assert clock.calls == 3 * (5 + 1) + 3 * (2 * 5 + 1)  # measured twice (with warm-up rounds), the second time longer

    # The first reading was a neighbour's: measured again, the second reading is kept, with a note.
    clock = FakeClock()
    first_rounds = 3 * (5 + 1)
    recovers = calls_taking(clock, float32=lambda k: 1e-3 if k >= 6 else 10e-3, float16=lambda k: 8e-3)
    ratios, notes = budget.matmul_slowdown(recovers, rounds=5, clock=clock, fast_float16=False)
    assert ratios["float16"] == pytest.approx(8.0, rel=1e-9) and len(notes) == 1 and clock.calls > first_rounds

    # On a CPU with fast float16 a ratio below 1 is plausible: kept as measured.
    clock = FakeClock()
    ratios, notes = budget.matmul_slowdown(calls_taking(clock, float32=lambda k: 1e-3, float16=lambda k: 0.2e-3),
                                           rounds=5, clock=clock, fast_float16=True)  # fmt: skip
    assert ratios["float16"] == pytest.approx(0.2, rel=1e-9) and notes == []


def test_the_real_probe_reports_per_matmul_ratios():
    # The calls do different numbers of matmuls (budget.MATMULS_PER_CALL); the ratio is per matmul.
    ratios, notes = budget.matmul_slowdown(rounds=1)
    assert set(ratios) == {"float16", "bfloat16"} and all(r > 0 for r in ratios.values())
    assert ratios["float16"] >= 1.0 or budget.FAST_FLOAT16_FLAGS & budget.cpu_flags()  # the bound


def idle_pilots() -> dict:
    """Pilot figures of an idle machine, in ``budget.measure``'s shape (the committed CPU run's, rounded)."""
    return {
        "unit_ms": 0.7,
        "lm_step_ms": {"float16@64": 82.0, "float16@32": 29.0, "bfloat16@64": 12.0},
        "mlp_float16_step_ms": 10.0,
        "sweep": {"round_overhead_ms": 4.9, "ms_per_mb": 0.023, "setup_ms_per_melement": 48.0},
        "train_step": {"forward_backward_ms": 47.0, "adamw_step_ms": 2.1},
    }


def scaled(figures, factor):
    return {k: scaled(v, factor) if isinstance(v, dict) else v * factor for k, v in figures.items()}


@pytest.mark.parametrize("peak_pass", [0, 1, 2])
def test_a_load_peak_during_the_pilots_does_not_inflate_the_estimate(peak_pass):
    # The run that predicted 989 s and took 143 s: a neighbour's peak made every pilot read
    # 7x. Here the peak covers one of the three passes; the estimate stays within 5% of the idle one.
    passes = []

    def pilot(name):
        def call():
            k = len(passes) // len(names)
            passes.append(name)
            return scaled({name: idle_pilots()[name]}, 7.0 if k == peak_pass else 1.0)[name]

        return call

    names = list(idle_pilots())
    measured = budget.median_of_passes({name: pilot(name) for name in names}, passes=3)
    idle = {**idle_pilots(), "seconds": 1.0}
    estimate = budget.plan({**measured, "seconds": 1.0}, 240.0)["estimate_s"]
    assert estimate <= 1.05 * budget.plan(idle, 240.0)["estimate_s"]
    # One pass inside the peak, as the pilots were taken before, gives the inflated estimate.
    peaked = budget.plan({**scaled(idle_pilots(), 7.0), "seconds": 1.0}, 240.0)["estimate_s"]
    assert peaked > 1.25 * budget.plan(idle, 240.0)["estimate_s"]
