"""Shared timing helpers for the benchmarks: interleaved repeats, medians, quantiles and ratio spreads.

A ratio of two medians hides how much it moves from round to round. Every benchmark that prints a
ratio (variant against baseline) also prints its spread: the 20% and 80% quantiles of the
per-round ratios of the interleaved rounds (``ratio_spread``), and marks the ratio "within noise"
when that band contains 1.0 (the two variants are not told apart by this run).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")


def quantiles(samples: list[float]) -> dict[str, float]:
    """Median and 20/80% quantiles of samples in seconds, in milliseconds."""
    q20, q80 = band(samples)
    return {"median_ms": statistics.median(samples) * 1e3, "q20_ms": q20 * 1e3, "q80_ms": q80 * 1e3}


def band(samples: list[float]) -> tuple[float, float]:
    """The 20% and 80% quantiles (``statistics.quantiles(n=5, method="inclusive")``: always within
    the samples' range; the default exclusive method extrapolates past the smallest and largest of
    a few samples, down to a negative time); a single sample is its own band. The band holds the
    median: statistics interpolates as a weighted sum, which can land an ulp beyond it (two equal
    rounds of three put p80 an ulp below their own value, the median: a ratio outside its band)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=5, method="inclusive")
    middle = statistics.median(samples)
    return min(q[0], middle), max(q[3], middle)


def ratio_spread(a_samples: list[float], b_samples: list[float]) -> dict[str, object]:
    """The ratio a / b of two interleaved measurements, with its noise band.

    ``a_samples[r]`` and ``b_samples[r]`` are round r of an interleaved measurement (run back to
    back, so drift hits both); round r's ratio is ``a_samples[r] / b_samples[r]``. Returned:
    ``ratio`` (the median of the per-round ratios: the headline figure, inside its own band, which a
    median of a over a median of b need not be), ``q20`` / ``q80`` (the 20% and 80% quantiles of the
    per-round ratios), ``rounds`` and ``within_noise``: True when the band contains
    1.0 (this run does not tell a from b), None with a single round (no spread to judge by).
    """
    if len(a_samples) != len(b_samples) or not a_samples:
        raise ValueError(f"ratio_spread needs paired rounds, got {len(a_samples)} and {len(b_samples)} samples")
    per_round = [a / b for a, b in zip(a_samples, b_samples)]
    q20, q80 = band(per_round)
    within = q20 <= 1.0 <= q80 if len(per_round) > 1 else None
    ratio = statistics.median(per_round)
    return {"ratio": ratio, "q20": q20, "q80": q80, "rounds": len(per_round), "within_noise": within}


def format_ratio(spread: dict[str, object], digits: int = 2) -> str:
    """``1.23 [1.10, 1.35]``: the ratio and its p20-p80 band, with `` within noise`` appended when the
    band contains 1.0."""
    text = f"{spread['ratio']:.{digits}f} [{spread['q20']:.{digits}f}, {spread['q80']:.{digits}f}]"
    if spread["within_noise"] is None:
        return text + " (1 round: no spread)"
    return text + (" within noise" if spread["within_noise"] else "")


def round_order(order: list[T], rep: int) -> list[T]:
    """The order of round ``rep`` of an interleaved measurement: ``order`` rotated by ``rep`` (see
    ``interleaved``)."""
    shift = rep % len(order) if order else 0
    return order[shift:] + order[:shift]


def interleaved(
    variants: dict[str, Callable[[], None]],
    repeats: int,
    reset: Callable[[str], None],
    after: Callable[[str], None] = lambda name: None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, float]]:
    """Time each variant ``repeats`` times, interleaved so that drift hits them all alike.

    Round k runs the variants in their order rotated by k: every variant takes every position
    equally often and none ever runs twice in a row. (ABBA, the order and then its reverse, ran
    the first and the last variant back to back with themselves every other round, their memory
    still in cache: at 4M float32 elements in 200 tensors that gave whichever variant came first
    ~10% on the 2-core development machine.) ``reset(name)`` runs untimed before every call
    (restore the gradients); ``after(name)`` runs untimed after it (e.g. the scaler's update).
    The first round is warm-up. ``clock`` reads the time in seconds (a fake one in tests). Returned
    per variant: ``quantiles`` of its samples and the samples themselves (``samples_ms``, round by
    round, for ``ratio_spread``).
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repeats + 1):
        for name in round_order(list(variants), rep):
            reset(name)
            start = clock()
            variants[name]()
            elapsed = clock() - start
            after(name)
            if rep > 0:
                times[name].append(elapsed)
    return {name: {**quantiles(samples), "samples_ms": [t * 1e3 for t in samples]} for name, samples in times.items()}


def spread_of(timed: dict[str, dict], a: str, b: str) -> dict[str, object]:
    """``ratio_spread`` of variants ``a`` and ``b`` of an ``interleaved`` result."""
    return ratio_spread(timed[a]["samples_ms"], timed[b]["samples_ms"])


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere), e.g. ``avx512_fp16``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine(device: torch.device | None = None) -> dict[str, object]:
    """What a result was measured on: device, CPU, threads and library versions (for the JSON files)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # the torch backend needs no triton
        triton_version = None
    on_gpu = device is not None and device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "processor": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }


def describe(info: dict[str, object]) -> str:
    """One line for titles and table headers: ``cpu (AMD EPYC, 2 threads), torch 2.13.0+cpu``."""
    where = f"{info['device']}" if info["device"] != "cpu" else f"cpu ({info['processor']}, {info['threads']} threads)"
    return f"{where}, torch {info['torch']}" + (f", triton {info['triton']}" if info["triton"] else "")


def split_sizes(numel: int, n_tensors: int) -> list[int]:
    """``numel`` elements in ``n_tensors`` nearly equal tensors."""
    return [numel // n_tensors + (1 if i < numel % n_tensors else 0) for i in range(n_tensors)]


def write_results(out: Path, info: dict, args: object, **results: object) -> None:
    """``{"machine": info, "args": vars(args) (paths as strings), **results}`` as JSON at ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out.write_text(json.dumps({"machine": info, "args": meta, **results}, indent=2))
