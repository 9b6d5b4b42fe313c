"""What of the scaler a ``torch.compile``d caller traces, and what runs eagerly inside it.

A step keeps what it needs on the host (the per-optimizer stages and flags, Python numbers read
from the device where that is free, the Triton launches on raw addresses), and Dynamo would bake
such things into a graph as constants of the first trace or run them on fake tensors. Dynamo skips
torch.amp.GradScaler (it lives in torch); ``runs_eagerly`` does the same for the tritonscale calls
that need it: a compiled function calling one gets a graph break around the call, the call runs
exactly as in eager mode -- everything it calls too, the optimizer's own ``step`` inside
``scaler.step`` included -- and the code around it still compiles. A ``torch.compile`` made
inside such a call (the policy rule on CUDA) still compiles.

``update()`` is traced instead when the iteration is local (``update_traces``): it is device ops
on the scale state and Python bookkeeping Dynamo replays, and under tracing every host read takes
its device form (``host_reads.are_free``). Anything that talks to other ranks or reads the host on
purpose (a policy's opt-in checks) still runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..grads.grad_sharding import any_marked, is_dtensor

#: Decorator: the function, and all it calls, is never traced by Dynamo (``torch.compiler.disable``).
runs_eagerly = torch.compiler.disable(
    recursive=True, reason="tritonscale runs the scaler's calls eagerly, as torch.amp.GradScaler's"
)


def update_traces(process_group: Any, ranks: Any, policy: Any, records: Iterable[Any]) -> bool:
    """Whether update() may be traced into the caller's graph: no process group on the scaler, no
    record whose flags still need the group's combine, no rank mismatch pending, and a policy that
    reads nothing on the host. Example: ``update_traces(None, RankChecks(), LossScalePolicy(), [])``."""
    return (
        process_group is None
        and ranks.pending is None
        and not policy.needs_host_check()
        and not any(record.has_pending_rank_flags() for record in records)
    )


def clip_traces(process_group: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether clip_grad_norm_ may be traced into the caller's graph: no process group (the call's
    or the scaler's) and gradients local to this rank (no DTensor, nothing mark_replicated), so
    nothing talks to other ranks. Example: ``clip_traces(None, optimizer)``."""
    return (
        process_group is None
        and not any_marked()
        and not any(
            is_dtensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        )
    )
