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


def test_a_silent_stage_that_overruns_its_estimate_keeps_moving_and_never_reaches_100():
    # The stall: a stage estimated at 20 s reports nothing for 120 s (the old bar stopped at
    # 90% of its share from 18 s on; then crawled below its share).
    clock = FakeClock()
    bar = progress.ProgressBar({"a": 0.5, "b": 0.5}, stream=io.StringIO(), interval_s=0.0,
                               estimates_s={"a": 20.0, "b": 20.0}, clock=clock)  # fmt: skip
    bar.update("a", 0, 1)
    shown = shown_over(bar, clock, 120.0)
    assert all(later > earlier for earlier, later in zip(shown, shown[1:])), shown  # steadily: every redraw moves
    assert shown[-1] < 1.0  # the shares follow the stages' real lengths (issue 30): past a's first share, never 100%
    assert shown[1] == pytest.approx(10.0 / 20.0 * 0.5)  # on time, the guess is the elapsed share of the estimate
    bar.update("a", 1, 1)
    assert bar.shown == pytest.approx(120.0 / (120.0 + 20.0))  # a's real share: its time over the time spent and left
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


def longest_still(samples: list[tuple[float, float]]) -> float:
    """The longest stretch of fake seconds over which the shown percentage did not change, from
    (time, shown share) samples."""
    longest, since = 0.0, samples[0][0]
    for (_, before), (now, after) in zip(samples, samples[1:]):
        if int(after * 100) > int(before * 100):
            since = now
        longest = max(longest, now - since)
    return longest


def redraws(bar, clock, seconds, step=1.0):
    """(time, shown share) every ``step`` seconds for ``seconds``, with nothing reported."""
    samples = []
    for _ in range(round(seconds / step)):
        clock.now += step
        bar.redraw(timer=True)
        samples.append((clock.now, bar.shown))
    return samples


@pytest.mark.parametrize("reports", [False, True])
def test_a_stage_that_runs_3x_its_estimate_moves_the_bar_every_few_seconds_and_never_to_100(reports):
    # The run: the sweep, estimated at 45 s with the whole-step benchmark's 83 s after it,
    # ran 236 s; the bar sat at ~57% for minutes. Here it runs 135 s, silent or reporting 15 points
    # at a third of the pace the estimate gave.
    clock = FakeClock()
    bar = progress.ProgressBar({"sweep": 0.35, "train_step": 0.65}, stream=io.StringIO(), interval_s=0.0,
                               estimates_s={"sweep": 45.0, "train_step": 83.0}, clock=clock)  # fmt: skip
    bar.update("sweep", 0, 15)
    samples = [(0.0, bar.shown)]
    for point in range(1, 16):
        samples += redraws(bar, clock, 9.0)
        if reports:
            bar.update("sweep", point, 15)
            samples.append((clock.now, bar.shown))
    shown = [value for _, value in samples]
    assert all(later >= earlier for earlier, later in zip(shown, shown[1:])) and shown[-1] < 1.0
    assert longest_still(samples) <= 10.0  # the shown percentage moves at least every 10 s of the overrun
    bar.update("train_step", 0, 1)
    bar.set_estimates({"sweep": 45.0, "train_step": 40.0})  # re-planned smaller: the bar does not go back
    later = [value for _, value in redraws(bar, clock, 40.0)]
    assert all(b >= a for a, b in zip([shown[-1]] + later, later)) and later[-1] < 1.0
    bar.update("train_step", 1, 1)
    assert bar.shown == 1.0
    bar.close()


def test_when_the_stages_before_take_less_than_planned_the_shares_follow_and_the_bar_is_not_near_100():
    # The run that planned 906 s: its first stages took a tenth of their estimates, the last was
    # re-planned at 250 s; the bar stood at 99% with 190 s left (the first stages' shares planned).
    clock = FakeClock()
    estimates = {"a": 400.0, "b": 400.0, "c": 100.0}
    bar = progress.ProgressBar({k: v / 900.0 for k, v in estimates.items()}, stream=io.StringIO(), interval_s=0.0,
                               estimates_s=estimates, clock=clock)  # fmt: skip
    for stage in ("a", "b"):
        bar.update(stage, 0, 1)
        clock.now += 40.0
        bar.update(stage, 1, 1)
    bar.update("c", 0, 10)
    bar.set_estimates({"a": 400.0, "b": 400.0, "c": 250.0})
    for done in range(1, 6):
        clock.now += 25.0
        bar.update("c", done, 10)
    spent, left = clock.now, 125.0  # half of c done at its estimate's pace
    assert bar.shown <= spent / (spent + left) + 0.05  # the time's share, not 80 s of 900 planned plus half of c
    bar.close()


def seconds_left(stream: io.StringIO) -> float:
    """The ``~N s left`` of the bar's last printed line."""
    return float(stream.getvalue().splitlines()[-1].rsplit("~", 1)[1].split(" s left")[0])


def run_stage(bar, clock, stage, first_s, rest_s, total):
    """A stage that reports ``total`` units: the first after ``first_s`` seconds, each other after
    ``rest_s``; yields after every report."""
    bar.update(stage, 0, 1)
    for done in range(1, total + 1):
        clock.now += first_s if done == 1 else rest_s
        bar.update(stage, done, total)
        yield done
    bar.update(stage, 1, 1)


def test_time_left_is_not_the_first_units_warm_up_times_the_units_left():
    # The run (run_all.log's estimates): train_step, re-planned at 53 s, reported 1/63
    # after 20 s (its first round carries the warm-up) and took 45 s; the bar read ~975 s left at
    # 105 s, 96 s before the run ended. Here each stage takes its estimate but train_step, whose
    # 62 rounds after the first take 0.4 s each.
    clock, stream = FakeClock(), io.StringIO()
    estimates = {"kernel_report": 4.0, "collectives": 5.0, "sweep": 50.0, "train_step": 53.0, "experiments": 57.0}
    bar = progress.ProgressBar({k: v / 169.0 for k, v in estimates.items()}, stream=stream, interval_s=0.0,
                               estimates_s=estimates, clock=clock)  # fmt: skip
    for stage in ("kernel_report", "collectives", "sweep"):
        list(run_stage(bar, clock, stage, estimates[stage], 0.0, 1))
    for done in run_stage(bar, clock, "train_step", 20.0, 0.4, 63):
        if done in (1, 2, 11, 40):
            truth = (63 - done) * 0.4 + estimates["experiments"]
            assert seconds_left(stream) == pytest.approx(truth, rel=0.15), (done, stream.getvalue()[-200:])
    assert bar.shown < 1.0
    bar.close()


def test_a_stage_steadily_slower_than_its_estimate_gets_the_time_left_of_its_measured_pace():
    # The other way round: 15 units of 9 s each for a 45 s estimate. Past a few units the time
    # left follows the measured pace (an honest bar does not promise the estimate's end).
    clock, stream = FakeClock(), io.StringIO()
    bar = progress.ProgressBar({"sweep": 1.0}, stream=stream, interval_s=0.0, estimates_s={"sweep": 45.0},
                               clock=clock)  # fmt: skip
    for done in run_stage(bar, clock, "sweep", 9.0, 9.0, 15):
        if 5 <= done < 15:
            assert seconds_left(stream) == pytest.approx((15 - done) * 9.0, rel=0.25), done
    bar.close()
