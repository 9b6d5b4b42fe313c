"""Launch configuration shared by the kernels: block sizes, program counts, autotune configs.

The passes are memory bound, so a small fixed configuration is a good default; on a real GPU
``triton.autotune`` picks BLOCK/num_warps per size class. Under ``TRITON_INTERPRET=1`` there is no
driver to time anything ("0 active drivers"), so every autotuner is pruned to its first config.
``TRITONSCALE_AUTOTUNE=0`` does the same on a GPU, which also makes norms bit-identical across
processes (within a process they always are: the autotune cache fixes the config).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .jit_helpers import INTERPRETING

#: Elements per chunk row of the pointer table (see tensor_table).
CHUNK = 65536
#: Default block and warps of the streaming passes: the interpreter's, the TABLE apply launch's
#: (never autotuned), and the first autotune candidate.
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
    return not INTERPRETING and os.environ.get("TRITONSCALE_AUTOTUNE", "1") != "0"


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_cap(device: torch.device) -> int:
    """How many persistent programs a pass launches at most on ``device``."""
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _multiprocessors(device)


def size_class(numel: int) -> int:
    """Autotune key: log2 bucket of the element count, so close sizes share a tuned config."""
    return max(int(numel), 1).bit_length()


def _first_config_only(configs, named_args, **kwargs):
    return configs if autotune_enabled() else configs[:1]


def streaming_configs() -> list[triton.Config]:
    """Candidate configs for the streaming passes; the first one is the default."""
    return [
        triton.Config({"BLOCK": DEFAULT_BLOCK}, num_warps=DEFAULT_NUM_WARPS),
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=8),
        triton.Config({"BLOCK": 8192}, num_warps=16),
    ]


PRUNE = {"early_config_prune": _first_config_only}
