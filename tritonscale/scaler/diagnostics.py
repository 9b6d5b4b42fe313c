"""Diagnostics: per-step statistics as device tensors and the names of non-finite gradients.

Nothing here runs in the step. ``GradScaler.stats()`` returns device tensors, copies of that step's
values (reading them is the caller's sync, when it wants one; ``tritonscale.StepLog`` in the loop
stage logs them without one); ``nonfinite_grads`` reads device values on purpose, on request.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..kernels import TRITON_FOUND
from ..kernels.interfaces import SLOT_BYTES
from ..policy.counters import CONSECUTIVE_SKIPS, HYSTERESIS_LEFT, LAST_SKIPPED, SKIPPED_STEPS
from ..policy.kernel_form import kernel_runs

#: stats() of a scaler made with enabled=False: what it cannot report, and what to log instead.
NO_STATS_WHEN_DISABLED = (
    "stats() reports the loss scale and its trackers, and this GradScaler was made with enabled=False "
    "(no loss scale, as in a bf16 run): log clip_grad_norm_'s return value and last_skip_flag() instead"
)
#: The entries of stats(), in the order a logged row holds them (tritonscale.StepLog).
STAT_NAMES = (
    "scale",
    "norm",
    "found_inf",
    "skipped",
    "skipped_steps",
    "consecutive_skips",
    "growth_tracker",
    "hysteresis_left",
)

if TRITON_FOUND:  # without triton every stats() takes the torch ops (one_launch says False)
    from ..kernels.loop_state import gather_stats


def one_launch(device: torch.device, backend: str) -> bool:
    """Whether the loop's small gathers (``stats()``, ``SkipAwareLR.step``) run as one Triton launch
    each (``kernels/loop_state.py``): wherever the policy kernel launches (``kernel_form.kernel_runs``:
    a GPU unless the backend is "torch"; the CPU under the interpreter with backend "triton"), and
    not while Dynamo traces (a traced step gets the torch ops, which the compiler fuses). Elsewhere
    the same values come from torch ops. Example: ``one_launch(scale.device, "auto")``."""
    return not torch.compiler.is_compiling() and kernel_runs(device, backend)


def device_stats(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    counters: torch.Tensor,
    last_found_inf: torch.Tensor | None,
    last_norm: torch.Tensor | None,
    *,
    gather: bool = False,
) -> dict[str, torch.Tensor]:
    """``GradScaler.stats()``: copies of the scaler's device state as it is now, nothing read on the
    host. Copies, not views: the next update() writes the state in place, and a caller that keeps
    the dict (an asynchronous logger) must still read this step's values. ``gather``: one launch
    (``one_launch``), the values 0-dim views of one fresh buffer of ``SLOT_BYTES`` per stat, each in
    its own dtype (``StepLog`` copies that buffer to the host as it is); else one clone each."""
    if gather:
        return _gathered(scale, growth_tracker, counters, last_found_inf, last_norm)
    nan = torch.full((), float("nan"), device=scale.device)
    counters = counters.clone()
    return {
        "scale": scale.clone(),
        "growth_tracker": growth_tracker.clone(),
        "norm": last_norm.clone() if last_norm is not None else nan,
        "found_inf": last_found_inf.clone() if last_found_inf is not None else torch.zeros_like(scale),
        "skipped": counters[LAST_SKIPPED],
        "skipped_steps": counters[SKIPPED_STEPS],
        "consecutive_skips": counters[CONSECUTIVE_SKIPS],
        "hysteresis_left": counters[HYSTERESIS_LEFT],
    }


#: The gathered buffer's order (``gather_stats``'s outs); each stat's slot is its index here.
_GATHER_ORDER = ("scale", "growth_tracker", "norm", "found_inf", "skipped", "skipped_steps",
                 "consecutive_skips", "hysteresis_left")  # fmt: skip


def _gathered(scale, growth_tracker, counters, last_found_inf, last_norm) -> dict[str, torch.Tensor]:
    """``device_stats`` in one launch: the same values (dtypes as the clones', the same bits)."""
    dtypes = {
        "scale": scale.dtype,
        "growth_tracker": growth_tracker.dtype,
        "norm": torch.get_default_dtype() if last_norm is None else last_norm.dtype,  # torch.full's, unset
        "found_inf": scale.dtype if last_found_inf is None else last_found_inf.dtype,  # zeros_like(scale)'s
    }
    buffer = torch.empty(SLOT_BYTES * len(_GATHER_ORDER), dtype=torch.uint8, device=scale.device)
    stats = {name: _slot(buffer, i, dtypes.get(name, counters.dtype)) for i, name in enumerate(_GATHER_ORDER)}
    slots = (LAST_SKIPPED, SKIPPED_STEPS, CONSECUTIVE_SKIPS, HYSTERESIS_LEFT)
    gather_stats((scale, growth_tracker, last_norm, last_found_inf, counters), slots, list(stats.values()))
    return {name: stats[name] for name in STAT_NAMES}


def _slot(buffer: torch.Tensor, index: int, dtype: torch.dtype) -> torch.Tensor:
    """The 0-dim ``dtype`` view of slot ``index`` of the uint8 ``buffer``."""
    start = index * SLOT_BYTES
    return buffer[start : start + dtype.itemsize].view(dtype).view(())


def nonfinite_grads(params: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]) -> list[str]:
    """Names of the parameters whose gradient holds inf or NaN (one host sync).

    Accepts a module (names from ``named_parameters``), ``(name, param)`` pairs, or plain
    parameters (named by position). Useful right after a skipped step: with ``clip_grad_norm_``
    the gradients of an overflowed step are left as they came, so the culprits are still visible.
    A sparse gradient counts as its dense form would (``_stored_values``), without making it.

    Example::

        if scaler.last_step_skipped():
            print(tritonscale.nonfinite_grads(model))   # e.g. ['decoder.layers.3.mlp.weight']

    Args:
        params: a module, ``(name, param)`` pairs, or parameters (named by their position, "0", "1" ...).

    Returns:
        the names of the parameters whose gradient holds inf or NaN, in order; empty when none does
        (or none has a gradient).
    """
    if isinstance(params, torch.nn.Module):
        named = list(params.named_parameters())
    else:
        items = list(params)
        named = [(str(i), p) if isinstance(p, torch.Tensor) else p for i, p in enumerate(items)]
    with_grads = [(name, p.grad) for name, p in named if p.grad is not None and p.grad.numel() > 0]
    if not with_grads:
        return []
    # One flag per tensor, gathered into one tensor: a single host read for any number of params.
    flags = [(~torch.isfinite(_stored_values(g))).any().to("cpu", non_blocking=True) for _, g in with_grads]
    return [name for (name, _), bad in zip(with_grads, torch.stack(flags).tolist()) if bad]


def _stored_values(grad: torch.Tensor) -> torch.Tensor:
    """The values whose inf/NaN the dense form of ``grad`` holds: a sparse COO gradient's values
    once coalesced (duplicates summed, as the dense form sums them: two finite halves can overflow
    to inf, inf and -inf make NaN; ``coalesce`` returns a new tensor and leaves ``grad`` as it is),
    a compressed one's values, a strided one itself. Its implicit zeros are finite."""
    if grad.layout is torch.sparse_coo:
        return grad.coalesce().values()
    if grad.layout is not torch.strided:  # sparse CSR / CSC / BSR / BSC
        return grad.values()
    return grad
