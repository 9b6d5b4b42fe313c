"""A dependency-free progress bar for the long benchmark runs (stderr, so stdout stays a clean log)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

OVERRUN_LEFT = 0.25  # of a stage's time so far, what is taken as left once it overruns its estimate and pace
# Of the pace that would reach 100% when the time left runs out, what the bar keeps while a stage
# overruns (``advance``): enough to move, and slower as the overrun makes the time left grow.
CREEP = 0.5
EASE_KNEE = 0.8  # share of a guessed stretch filled linearly before the guess slows down (``ease``)
GUESS_CEILING = 0.9  # of a stage's share, what a guess from its estimate approaches (its callbacks fill the rest)
# How many measured units the estimate's pace counts as (``stage_left``): one unit's time is noisy,
# so after two units past the first report the measured pace weighs as much as the plan's.
PLAN_UNITS = 2.0


class ProgressBar:
    """Stages with weights summing to 1; ``update(stage, done, total)`` redraws.

    On a terminal the bar redraws in place; in a log (not a tty) it prints a line at every 10% and
    at least every ``interval_s`` seconds, so a log shows the job alive from its first seconds.

    Between a stage's callbacks the bar keeps moving (a ``~`` marks such a guess), and a background
    thread redraws every ``interval_s`` (``start_clock``). Without estimates, toward the next callback
    at the stage's pace so far, slowing down near it (``ease``), never past the end of the stage's
    share. With ``estimates_s`` (each stage's expected seconds; ``set_estimates`` re-plans them) it
    also guesses toward 90% of the stage's share with its time over its estimate, and shows the
    time spent over the time spent and left where that is further (``time_left``: the stage's
    units left at its pace, the estimate's blended with the one measured since its first report,
    or, once it overruns that, a quarter of its time so far; then the later stages' estimates): the
    shares follow the stages' real lengths. When a stage overruns, the bar does not
    wait for that fraction to catch up but keeps covering part of the rest (``advance``). Either way
    it never moves backwards and reaches 100% only when the last stage ends. The line ends with the
    time spent and left. ``clock`` reads the time (a fake one in tests).

    Example::

        bar = ProgressBar({"experiments": 0.5, "sweep": 0.5})
        bar.update("sweep", 3, 12)
        bar.close()
    """

    def __init__(self, weights: dict[str, float], stream: TextIO | None = None, width: int = 30,
                 estimates_s: dict[str, float] | None = None, interval_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):  # fmt: skip
        self.set_weights(weights)
        self.took: dict[str, float] = {}  # seconds of each stage done
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (1.0 if self.tty else 10.0)
        self.estimates_s = estimates_s or {}
        self.clock_fn = clock
        self.start = self.last_printed = clock()
        self.last_logged = -1
        self.state = (None, 0, 1, self.start, self.start)  # stage, done, total, when it began, last report
        self.first: tuple[int, float] | None = None  # the stage's first report of some units done: (done, when)
        self.shown, self.drawn_at = 0.0, self.start
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.clock: threading.Thread | None = None

    def start_clock(self) -> None:
        """Redraw every ``interval_s`` in a daemon thread until ``close``."""

        def run():
            while not self.stop.wait(self.interval_s):
                self.redraw(timer=True)

        self.clock = threading.Thread(target=run, daemon=True)
        self.clock.start()

    def update(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            now = self.clock_fn()
            same = self.state[0] == stage
            began = self.state[3] if same else now
            if not same and self.state[0] is not None and self.state[0] not in self.took:
                self.took[self.state[0]] = now - self.state[3]
            if done >= total:
                self.took[stage] = now - began
            if self.estimates_s and self.took:
                self.reweigh()
            reported = self.state[4] if same and (done, total) == self.state[1:3] else now
            if not same or total != self.state[2]:
                self.first = None
            if self.first is None and done > 0:
                self.first = (done, now)
            self.state = (stage, done, total, began, reported)
        self.redraw()

    def set_weights(self, weights: dict[str, float]) -> None:
        """Each stage's share: where it starts and how much of the bar it takes."""
        self.offsets, total = {}, 0.0
        for stage, weight in weights.items():
            self.offsets[stage] = (total, weight)
            total += weight
        self.total = total

    def set_estimates(self, estimates_s: dict[str, float]) -> None:
        """Each stage's expected seconds, as re-planned. With estimates, the shares follow the seconds
        (``reweigh``, also when a stage ends): else stages done early leave the later ones' shares
        too small, and the bar near 100% with minutes left."""
        with self.lock:
            self.estimates_s = dict(estimates_s)
            self.reweigh()

    def reweigh(self) -> None:
        """The shares from the seconds: the stages done's real ones, the others' estimates."""
        self.set_weights({s: self.took.get(s, self.estimates_s.get(s, 0.0)) for s in self.offsets})

    def message(self, text: str, out: TextIO | None = None) -> None:
        """Print ``text`` (to stdout) on a line of its own, off the bar's line on a terminal."""
        with self.lock:
            if self.tty:
                self.stream.write("\r" + " " * 80 + "\r")
                self.stream.flush()
            print(text, file=out or sys.stdout, flush=True)

    def time_left(self, now: float) -> float:
        """Seconds left: the current stage's (``stage_left``), then the later stages' estimates."""
        later = list(self.offsets)[list(self.offsets).index(self.state[0]) + 1 :]
        return self.stage_left(now) + sum(self.estimates_s.get(s, 0.0) for s in later)

    def stage_left(self, now: float) -> float:
        """The current stage's seconds left: its units left at its pace, less the time since its last
        report; at least ``OVERRUN_LEFT`` of its time so far times the share left.

        The pace is measured from the stage's first report on, not from its start: the first unit
        carries the stage's one-off costs (allocations, warm-up, first calls), and extrapolating it
        over 62 more steps read ``~975 s left`` in a run that ended 96 s later. Until enough units
        are measured the pace leans on the estimate's: what the estimate leaves after the first
        report, per unit left then, counting as ``PLAN_UNITS`` measured units."""
        stage, done, total, began, reported_at = self.state
        in_stage = now - began
        floor = OVERRUN_LEFT * in_stage * (1.0 - min(1.0, done / max(total, 1)))
        estimate = self.estimates_s.get(stage, 0.0)
        if self.first is None:
            return max(estimate - in_stage, floor)
        first_done, first_at = self.first
        measured = done - first_done
        planned_pace = max(estimate - (first_at - began), 0.0) / max(total - first_done, 1)
        measured_pace = (reported_at - first_at) / measured if measured > 0 else 0.0
        plan_units = PLAN_UNITS if estimate else 0.0
        if plan_units + measured == 0:
            return floor
        pace = (plan_units * planned_pace + measured * measured_pace) / (plan_units + measured)
        return max(pace * (total - done) - (now - reported_at), floor)

    def advance(self, now: float) -> tuple[float, bool]:
        """The share done from the time (with estimates): spent over spent and left, or, when that
        falls behind what is shown (a stage overruns: the time left grows), what is shown plus
        ``CREEP`` of the pace that would reach 100% when the time left runs out. Never back, never
        100% while time is left."""
        elapsed, left = now - self.start, self.time_left(now)
        if left <= 0.0:
            return 1.0, False
        dt = max(0.0, now - self.drawn_at)
        creep = self.shown + CREEP * (1.0 - self.shown) * dt / (left + dt)
        return max(elapsed / (elapsed + left), creep), self.state[1] < self.state[2]

    def fraction(self, now: float) -> tuple[float, bool]:
        """The share done: reported by the stages, or guessed from the time (then True); with
        estimates, or the time's share (``advance``) when it is further."""
        stage, done, total, began, reported_at = self.state
        if stage is None:
            return 0.0, False
        offset, weight = self.offsets[stage]
        reported = min(1.0, done / max(total, 1))
        guessed = 0.0
        if reported < 1.0:
            if done > 0:  # toward the next callback, at this stage's pace so far
                pace = (reported_at - began) / done
                step = min(1.0 / max(total, 1), 1.0 - reported)
                guessed = reported + step * ease((now - reported_at) / pace) if pace > 0 else reported
            estimate = self.estimates_s.get(stage)
            if estimate:
                guessed = max(guessed, GUESS_CEILING * ease((now - began) / estimate / GUESS_CEILING))
        shares = min(1.0, (offset + weight * max(reported, guessed)) / self.total)
        timed, timed_guess = self.advance(now) if self.estimates_s else (0.0, False)
        return max(shares, timed), (timed_guess if timed > shares else guessed > reported)

    def redraw(self, timer: bool = False) -> None:
        with self.lock:
            now = self.clock_fn()
            fraction, guess = self.fraction(now)
            self.shown, self.drawn_at = max(self.shown, fraction), now
            stage, done, total = self.state[:3]
            if stage is None:
                return
            elapsed = now - self.start
            filled = int(self.shown * self.width)
            line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {'~' if guess else ' '}{self.shown:4.0%} "
                    f"{stage} {done}/{total} {elapsed:5.0f} s{self.left(elapsed, now)}")  # fmt: skip
            if self.tty:
                self.stream.write("\r" + line.ljust(80))
            elif int(self.shown * 10) > self.last_logged or now - self.last_printed >= self.interval_s:
                self.last_logged = max(self.last_logged, int(self.shown * 10))
                self.last_printed = now
                self.stream.write(line + "\n")
            else:
                return
            self.stream.flush()

    def left(self, elapsed: float, now: float) -> str:
        """``, ~N s left``: ``time_left`` with estimates, else from the pace so far."""
        if self.shown >= 1.0:
            return ""
        if self.estimates_s:
            return f", ~{self.time_left(now):.0f} s left"
        if self.shown <= 0.0:
            return ""
        return f", ~{elapsed / self.shown * (1 - self.shown):.0f} s left"

    def close(self) -> None:
        self.stop.set()
        if self.clock is not None:
            self.clock.join()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def ease(x: float) -> float:
    """How much of a guessed stretch is done after ``x`` of its expected time: ``x`` up to 0.8, then
    ever slower toward 1, never reaching it (a hyperbola with the same slope at 0.8, so the bar
    does not jump; an exponential would round to 1.0 within ten estimates).

    Example: ``ease(0.5) == 0.5``; ``ease(1.0) == 0.9``; ``ease(100.0)`` is about 0.9996.
    """
    if x <= EASE_KNEE:
        return max(0.0, x)
    rest = 1.0 - EASE_KNEE
    return 1.0 - rest * rest / (rest + x - EASE_KNEE)
