"""Shared timing helpers for the CPU benchmarks: interleaved repeats, medians and quantiles."""

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
    """Median and 20/80% quantiles, in milliseconds."""
    q = statistics.quantiles(samples, n=5) if len(samples) > 1 else [samples[0]] * 4
    return {"median_ms": statistics.median(samples) * 1e3, "q20_ms": q[0] * 1e3, "q80_ms": q[3] * 1e3}


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
) -> dict[str, dict[str, float]]:
    """Time each variant ``repeats`` times, interleaved so that drift hits them all alike.

    Round k runs the variants in their order rotated by k: every variant takes every position
    equally often and none ever runs twice in a row. (ABBA, the order and then its reverse, ran
    the first and the last variant back to back with themselves every other round, their memory
    still in cache: at 4M float32 elements in 200 tensors that gave whichever variant came first
    ~10% on the 2-core development machine.) ``reset(name)`` runs untimed before every call
    (restore the gradients); ``after(name)`` runs untimed after it (e.g. the scaler's update).
    The first round is warm-up.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repeats + 1):
        for name in round_order(list(variants), rep):
            reset(name)
            start = time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            after(name)
            if rep > 0:
                times[name].append(elapsed)
    return {name: quantiles(samples) for name, samples in times.items()}


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
