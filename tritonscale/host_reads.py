"""Where a device value can be read on the host for free.

CPU ops run synchronously on the host, so reading a CPU tensor waits for nothing: there the step
may decide on the host (the torch backend's overflow probe, the policy rule on Python numbers).
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
