"""A dependency-free progress bar for the long benchmark runs (stderr, so stdout stays a clean log)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Stages with weights summing to 1; ``update(stage, done, total)`` redraws.

    On a terminal the bar redraws in place; in a log (not a tty) it prints a line every 10%.

    Example::

        bar = ProgressBar({"experiments": 0.5, "sweep": 0.5})
        bar.update("sweep", 3, 12)
        bar.close()
    """

    def __init__(self, weights: dict[str, float], stream: TextIO | None = None, width: int = 30):
        self.offsets, total = {}, 0.0
        for stage, weight in weights.items():
            self.offsets[stage] = (total, weight)
            total += weight
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.last_logged = -1
        self.tty = self.stream.isatty()

    def update(self, stage: str, done: int, total: int) -> None:
        offset, weight = self.offsets[stage]
        fraction = min(1.0, (offset + weight * done / max(total, 1)) / self.total)
        filled = int(fraction * self.width)
        elapsed = time.perf_counter() - self.start
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {fraction:4.0%} {stage} {done}/{total} {elapsed:5.0f} s"
        if self.tty:
            self.stream.write("\r" + line.ljust(70))
        elif int(fraction * 10) > self.last_logged:
            self.last_logged = int(fraction * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
