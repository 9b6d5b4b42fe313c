"""Shared timing helpers for the CPU benchmarks: interleaved repeats, medians and quantiles."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch


def quantiles(samples: list[float]) -> dict[str, float]:
    """Median and 20/80% quantiles, in milliseconds."""
    q = statistics.quantiles(samples, n=5) if len(samples) > 1 else [samples[0]] * 4
    return {"median_ms": statistics.median(samples) * 1e3, "q20_ms": q[0] * 1e3, "q80_ms": q[3] * 1e3}


def interleaved(
    variants: dict[str, Callable[[], None]], repeats: int, reset: Callable[[], None], after: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """Time each variant ``repeats`` times, alternating the order (ABBA) so drift hits both.

    ``reset`` runs untimed before every call (restore the gradients); ``after(name)`` runs
    untimed after it (e.g. the scaler's update). The first round is warm-up.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for rep in range(repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            reset()
            start = time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            after(name)
            if rep > 0:
                times[name].append(elapsed)
    return {name: quantiles(samples) for name, samples in times.items()}


def machine() -> dict[str, object]:
    return {
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def split_sizes(numel: int, n_tensors: int) -> list[int]:
    """``numel`` elements in ``n_tensors`` nearly equal tensors."""
    return [numel // n_tensors + (1 if i < numel % n_tensors else 0) for i in range(n_tensors)]
