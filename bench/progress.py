"""A dependency-free progress bar for the long benchmark runs (stderr, so stdout stays a clean log)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

EASE_KNEE = 0.8  # share of a guessed stretch filled linearly before the guess slows down (``ease``)
GUESS_CEILING = 0.9  # of a stage's share, what a guess from its estimate approaches (its callbacks fill the rest)


class ProgressBar:
    """Stages with weights summing to 1; ``update(stage, done, total)`` redraws.

    On a terminal the bar redraws in place; in a log (not a tty) it prints a line at every 10% and
    at least every ``interval_s`` seconds, so a log shows the job alive from its first seconds.

    Between a stage's callbacks the bar keeps moving (a ``~`` marks such a guess), and a background
    thread redraws every ``interval_s`` (``start_clock``): toward the next callback at the stage's
    pace so far, and, with ``estimates_s`` (each stage's expected seconds), with the stage's elapsed
    time over its estimate, toward 90% of its share. Either guess slows down as it nears its target
    and never reaches it (``ease``): the bar never passes the end of a stage that has not ended,
    never stalls on one that overruns its estimate, and never moves backwards. The line ends with the time spent and the
    time left (from the estimates, then from the pace so far). ``clock`` reads the time (a fake one
    in tests).

    Example::

        bar = ProgressBar({"experiments": 0.5, "sweep": 0.5})
        bar.update("sweep", 3, 12)
        bar.close()
    """

    def __init__(self, weights: dict[str, float], stream: TextIO | None = None, width: int = 30,
                 estimates_s: dict[str, float] | None = None, interval_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):  # fmt: skip
        self.offsets, total = {}, 0.0
        for stage, weight in weights.items():
            self.offsets[stage] = (total, weight)
            total += weight
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (1.0 if self.tty else 10.0)
        self.estimates_s = estimates_s or {}
        self.clock_fn = clock
        self.start = self.last_printed = clock()
        self.last_logged = -1
        self.state = (None, 0, 1, self.start, self.start)  # stage, done, total, when it began, last report
        self.shown = 0.0
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
            reported = self.state[4] if same and (done, total) == self.state[1:3] else now
            self.state = (stage, done, total, began, reported)
        self.redraw()

    def fraction(self, now: float) -> tuple[float, bool]:
        """The share done: reported by the stages, or guessed from the time (then True)."""
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
        within = max(reported, guessed)
        return min(1.0, (offset + weight * within) / self.total), guessed > reported

    def redraw(self, timer: bool = False) -> None:
        with self.lock:
            now = self.clock_fn()
            fraction, guess = self.fraction(now)
            self.shown = max(self.shown, fraction)
            stage, done, total = self.state[:3]
            if stage is None:
                return
            elapsed = now - self.start
            filled = int(self.shown * self.width)
            line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {'~' if guess else ' '}{self.shown:4.0%} "
                    f"{stage} {done}/{total} {elapsed:5.0f} s{self.left(elapsed)}")  # fmt: skip
            if self.tty:
                self.stream.write("\r" + line.ljust(80))
            elif int(self.shown * 10) > self.last_logged or now - self.last_printed >= self.interval_s:
                self.last_logged = max(self.last_logged, int(self.shown * 10))
                self.last_printed = now
                self.stream.write(line + "\n")
            else:
                return
            self.stream.flush()

    def left(self, elapsed: float) -> str:
        """``, ~N s left``: from the estimates at first, from the pace so far after a fifth of the run."""
        if self.shown >= 1.0:
            return ""
        if self.shown >= 0.2 or not self.estimates_s:
            if self.shown <= 0.0:
                return ""
            remaining = elapsed / self.shown * (1 - self.shown)
        else:
            remaining = max(0.0, sum(self.estimates_s.values()) - elapsed)
        return f", ~{remaining:.0f} s left"

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
