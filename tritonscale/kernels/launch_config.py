"""Launch configuration shared by the kernels: block sizes, program counts, and who may be tuned.

Numerics never depend on a stopwatch. A pass whose result bits depend on its configuration never
has it chosen by timing, or two DDP ranks computing the norm of the same replicated gradients (and
a run and its resume) could pick different configs and get different norms:

* the check pass reduces: each lane folds every BLOCK-th element of a program's blocks, and the
  block is then summed by a tree whose shape num_warps sets. It launches ``check_config(device,
  numel)``, a pure function of the device and the size;
* ``finalize`` is one program whose block follows the number of partials (``FINALIZE_MAX_BLOCK``);
* the apply pass is elementwise: each element is read, multiplied by the same factor and rounded
  once, and its found_inf is an OR of per-element tests. Every config gives the same bits, so its
  FLAT launch is ``triton.autotune``d over ``streaming_configs()`` on a GPU, keyed on a log2 size
  class (tests/kernels/test_launch_config.py runs every candidate against the others).

Under ``TRITON_INTERPRET=1`` there is no driver to time anything ("0 active drivers"), so the
autotuner is pruned to its first config. ``TRITONSCALE_AUTOTUNE=0`` does the same on a GPU: it
skips the benchmarking at the first launch of each size class and changes no result.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .jit_helpers import INTERPRETING

#: Elements per chunk row of the pointer table (see tensor_table).
CHUNK = 65536
#: Default block and warps of the streaming passes: the check pass's, the TABLE apply launch's
#: (never autotuned), and the first autotune candidate of the FLAT apply launch.
DEFAULT_BLOCK = 4096
DEFAULT_NUM_WARPS = 8
#: finalize is one program over the partials: it loops in blocks of at most this many columns.
FINALIZE_MAX_BLOCK = 4096
FINALIZE_NUM_WARPS = 4
#: Largest number of programs (hence partials) per group under the interpreter, where programs run
#: one after another, each slowly: keeps CPU tests fast.
INTERPRETER_PROGRAMS = 4
#: Persistent programs per streaming multiprocessor on a GPU.
PROGRAMS_PER_SM = 4


def autotune_enabled() -> bool:
    """Whether the elementwise apply pass is timed at its first launch per size class (never
    under the interpreter; ``TRITONSCALE_AUTOTUNE=0`` turns it off on a GPU too)."""
    return not INTERPRETING and os.environ.get("TRITONSCALE_AUTOTUNE", "1") != "0"


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's SM count (asked once per device: every pass's layout reads it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_cap(device: torch.device) -> int:
    """How many persistent programs a pass launches at most on ``device``."""
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _multiprocessors(device)


def size_class(numel: int) -> int:
    """Autotune key: log2 bucket of the element count, so close sizes share a tuned config."""
    return max(int(numel), 1).bit_length()


def check_config(device: torch.device, numel: int) -> triton.Config:
    """The check pass's launch configuration: a pure function of ``device`` and ``numel``.

    Nothing timed, cached or read from the environment enters it, because the partial sums'
    order follows BLOCK and num_warps: ranks and resumed runs that see the same gradients on the
    same kind of device must get the same norm bits. One config serves every device and size
    today; a size table, if measurements ever call for one, goes here and nowhere else.

        >>> check_config(torch.device("cpu"), 10_000).kwargs
        {'BLOCK': 4096}

    (The one config is made once: a ``triton.Config`` costs more to build than the launch's guard.)
    """
    return _CHECK_CONFIG


_CHECK_CONFIG = triton.Config({"BLOCK": DEFAULT_BLOCK}, num_warps=DEFAULT_NUM_WARPS)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` >= 1, as ``triton.next_power_of_2`` (whose wrapper for use
    inside kernels costs more per call than this whole expression)."""
    return 1 << (n - 1).bit_length()


def _first_config_only(configs, named_args, **kwargs):
    return configs if autotune_enabled() else configs[:1]


def streaming_configs() -> list[triton.Config]:
    """Autotune candidates of the elementwise apply pass; the first one is the default."""
    return [
        triton.Config({"BLOCK": DEFAULT_BLOCK}, num_warps=DEFAULT_NUM_WARPS),
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=16),
    ]


PRUNE = {"early_config_prune": _first_config_only}
