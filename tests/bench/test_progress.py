"""bench/progress.py's bar on a fake clock: it moves while a stage reports nothing, never passes the
end of a stage that has not ended, and never goes back."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their shared helpers (bench/timing.py) by name

import progress  # noqa: E402


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def shown_over(bar, clock, seconds, step=5.0):
    """The bar's shown share every ``step`` seconds for ``seconds``, with nothing reported."""
    shown = []
    for _ in range(int(seconds / step)):
        clock.now += step
        bar.redraw(timer=True)
        shown.append(bar.shown)
    return shown


def test_a_silent_stage_that_overruns_its_estimate_keeps_moving_below_its_share():
    # The stall: a stage estimated at 20 s reports nothing for 120 s (the old bar stopped at
    # 90% of its share from 18 s on).
    clock = FakeClock()
    bar = progress.ProgressBar({"a": 0.5, "b": 0.5}, stream=io.StringIO(), interval_s=0.0,
                               estimates_s={"a": 20.0, "b": 20.0}, clock=clock)  # fmt: skip
    bar.update("a", 0, 1)
    shown = shown_over(bar, clock, 120.0)
    assert all(later > earlier for earlier, later in zip(shown, shown[1:])), shown  # steadily: every redraw moves
    assert shown[-1] < 0.5  # never past the end of stage a's share
    assert shown[1] == pytest.approx(10.0 / 20.0 * 0.5)  # on time, the guess is the elapsed share of the estimate
    bar.update("a", 1, 1)
    assert bar.shown == 0.5
    bar.close()


def test_between_reports_the_bar_moves_at_the_stages_pace_and_never_goes_back():
    # A stage that reports 9 of 10 steps, one every 2 s, then nothing for 75 s (the 96%).
    clock = FakeClock()
    bar = progress.ProgressBar({"only": 1.0}, stream=io.StringIO(), interval_s=0.0, clock=clock)
    bar.update("only", 0, 10)
    for done in range(1, 10):
        clock.now += 2.0
        bar.update("only", done, 10)
    at_report = bar.shown
    assert at_report == 0.9
    shown = shown_over(bar, clock, 75.0, step=1.0)
    assert shown[0] == pytest.approx(0.9 + 0.1 * 0.5)  # 1 s of a 2 s pace
    assert all(later > earlier for earlier, later in zip(shown, shown[1:])) and shown[-1] < 1.0
    bar.update("only", 9, 10)  # a report behind the guess: the bar stays where it was
    assert bar.shown == shown[-1]
    bar.close()


def test_ease_is_continuous_increasing_and_below_one():
    xs = [i / 100 for i in range(0, 100_000, 7)]
    values = [progress.ease(x) for x in xs]
    assert all(b > a for a, b in zip(values, values[1:])) and values[-1] < 1.0
    knee = progress.EASE_KNEE
    assert abs(progress.ease(knee + 1e-9) - progress.ease(knee)) < 1e-8  # no jump at the knee
