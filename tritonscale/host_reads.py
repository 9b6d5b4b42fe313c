"""Where a device value can be read on the host for free.

CPU ops run synchronously on the host, so reading a CPU tensor waits for nothing. The policy rule,
the skip rule, the clip's finalize, ``stats()`` and ``SkipAwareLR.step`` never read, on any device;
a few paths still read where it is free: a rank mismatch raised at once (``passes/rank_validation.py``),
the torch backend's float64 norm fallback decided by one read, a tensor ``max_norm`` checked.
Anywhere else a read would stall the stream, so those paths never read. This is the one switch:
tests turn it off to run the GPU paths on the CPU (``tests/conftest.py``, ``forbid_host_reads``).
"""

from __future__ import annotations

import torch


def are_free(device: torch.device) -> bool:
    """True where reading a value of ``device`` on the host costs no synchronization (the CPU),
    and not while Dynamo traces: a compiled step takes the device paths, so no host read (and no
    Python number that would become a constant of the graph) gets into it."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def capturing(device: torch.device) -> bool:
    """True while ``device``'s current stream captures a CUDA graph. A replay runs no Python, so
    a host read, a host decision or a Python counter inside the captured code would be frozen at
    its capture-time value: such steps refuse (``refuse_in_capture``). The one switch: tests turn
    it on to check the refusals on the CPU (``monkeypatch.setattr(host_reads, "capturing", ...)``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_in_capture(device: torch.device, what: str, fix: str) -> None:
    """Raise a RuntimeError naming ``what`` cannot be captured and the ``fix``, while ``device``
    captures a CUDA graph (``capturing``); nothing otherwise. Call it before anything changes.
    Example: ``refuse_in_capture(scale.device, "update() with max_consecutive_skips", "set it to None")``."""
    if capturing(device):
        raise RuntimeError(
            f"tritonscale: {what} cannot be captured in a CUDA graph (a replay runs no Python, so it would "
            f"never advance or check again); {fix}"
        )
