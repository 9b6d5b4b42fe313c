"""A dependency-free progress bar for the long benchmark runs (stderr, so stdout stays a clean log)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class ProgressBar:
    """Stages with weights summing to 1; ``update(stage, done, total)`` redraws.

    On a terminal the bar redraws in place; in a log (not a tty) it prints a line at every 10% and
    at least every ``interval_s`` seconds, so a log shows the job alive from its first seconds.

    With ``estimates_s`` (each stage's expected seconds) the bar also moves inside a stage that
    reports rarely (a compile, a spawn): between its callbacks the stage's share fills with its
    elapsed time over its estimate, up to 90% of the share (a ``~`` marks such a guess), and a
    background thread redraws every ``interval_s`` (``start_clock``). The line ends with the time
    spent and the time left (from the estimate, then from the pace so far).

    Example::

        bar = ProgressBar({"experiments": 0.5, "sweep": 0.5})
        bar.update("sweep", 3, 12)
        bar.close()
    """

    def __init__(self, weights: dict[str, float], stream: TextIO | None = None, width: int = 30,
                 estimates_s: dict[str, float] | None = None, interval_s: float | None = None):  # fmt: skip
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
        self.start = self.last_printed = time.perf_counter()
        self.last_logged = -1
        self.state = (None, 0, 1, self.start)  # stage, done, total, when the stage began
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
            began = self.state[3] if self.state[0] == stage else time.perf_counter()
            self.state = (stage, done, total, began)
        self.redraw()

    def fraction(self, now: float) -> tuple[float, bool]:
        """The share done: reported by the stages, or guessed from a stage's estimate (then True)."""
        stage, done, total, began = self.state
        if stage is None:
            return 0.0, False
        offset, weight = self.offsets[stage]
        reported = done / max(total, 1)
        estimate = self.estimates_s.get(stage)
        guessed = min(0.9, (now - began) / estimate) if estimate else 0.0
        within = max(reported, guessed)
        return min(1.0, (offset + weight * within) / self.total), guessed > reported

    def redraw(self, timer: bool = False) -> None:
        with self.lock:
            now = time.perf_counter()
            fraction, guess = self.fraction(now)
            self.shown = max(self.shown, fraction)
            stage, done, total, _ = self.state
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
