"""What the ranks of a process group must agree on before a combined step goes ahead.

A collective pairs the calls of the ranks by order alone: nothing in it says that the ranks divide
by the same loss scale, that they are at the same call of the same iteration, or (for the
``Updater``'s all-reduce) that they sum the same gradients. Each of these can differ without an
error -- a scaler checkpoint loaded on one rank, a ``clip_grad_norm_`` called twice on one rank, a
parameter unused on one rank -- and the replicas then drift apart, silently. So every collective
the step already issues also carries, from every rank, the values that must agree (``CHECKED``:
the scale's exact float32 value, the call's place in the sequence below, the gradient layout),
and every rank compares all ranks' values. No second collective: the row of the one all-gather
(``rank_combine.combine_check``) is wider, and the all-reduce carries a small header.

**The sequence** (``RankChecks``, one per scaler; the one place that counts): ``iteration`` is the
number of iterations this scaler has ended -- its ``update()`` calls, and for a disabled scaler
(a bf16 loop may never call ``update()``) its ``step()`` calls -- and ``call`` is the number of
combines this scaler issued on that process group in the current iteration. Two ranks whose calls
differ by an extra ``clip_grad_norm_`` pair it with the other rank's next iteration's first call:
(iteration i, call 1) against (i + 1, call 0), a mismatch at the first mismatched call. Every rank
gathers every rank's row, so every rank that reaches the mismatched collective sees it.

**Where the error is raised.** Deciding to raise is a host read. On the CPU reads cost nothing
(``host_reads.py``): every rank raises :class:`RankMismatchError` right after the collective,
before anything is written, naming the ranks and their values. On a GPU the step reads nothing on
the host, and a collective across ranks must not make it start (it would stall every step to
catch a misuse). There the mismatch becomes a device flag that (1) counts as an overflow in the
combine, so the clip writes nothing and a fused optimizer skips, (2) forces the step's skip flag,
and (3) makes ``update()`` keep the scale and its trackers as they were (it saves and restores
them on the device: a few small ops per ``update()`` once a process group is in use); a
mismatched step changes nothing. The error is raised at the next call that reads the host anyway:
``get_scale()``, ``state_dict()``, ``last_step_skipped()``, or the ``step()`` of an optimizer
that does not take ``found_inf`` (which reads the skip flag). Until then every step is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from .. import host_reads
from ..errors import RankMismatchError

_UNUSED = (
    "the ranks hold gradients for different parameters (a parameter unused in some rank's loss), and "
    "the all-reduce sums the same gradients on every rank: make each parameter take part in every "
    "rank's loss (times 0 will do), or use DistributedDataParallel(find_unused_parameters=True)"
)
#: Each checked column: what it is, and what to do when the ranks disagree on it.
CHECKED = {
    "scale": (
        "the loss scale",
        "every rank must divide by the same scale (a scaler state_dict loaded on some ranks only, or "
        "per-rank checkpoints): load the same scaler state_dict on every rank",
    ),
    "iteration": (
        "the scaler's iteration",
        "every rank must call update() (and, when disabled, step()) the same number of times",
    ),
    "call": (
        "the combine's index in the iteration",
        "the ranks called unscale_/clip_grad_norm_/step on this process group a different number of "
        "times in an iteration: every rank must make the same scaler calls",
    ),
    "gradients": ("the number of gradients", _UNUSED),
    "layout": ("which parameters have a gradient (a hash)", _UNUSED),
}
#: The columns a scaler's all-gather row carries after [norm, found_inf].
STAMP = ("scale", "iteration", "call")


class RankChecks:
    """One scaler's call sequence on its process groups, and a mismatch not raised yet (GPU)."""

    def __init__(self) -> None:
        #: 0-dim int64 tensor, on the device of the scale once an update() ran there: a device
        #: value, so that a compiled update() counts without a guard on it (a Python int would be
        #: a constant of the graph, recompiled at every iteration) and without a host read.
        self.iteration = torch.zeros((), dtype=torch.int64)
        self._calls: dict[Any, int] = {}  # process group -> combines issued on it this iteration
        #: 0-dim float32 device flag, 1 once a combine saw a mismatch not raised yet (GPU paths).
        self.pending: torch.Tensor | None = None
        self._seen: tuple[torch.Tensor, tuple[str, ...]] | None = None  # what the first one showed

    def next_iteration(self, device: torch.device | None = None) -> None:
        """The scaler ended an iteration (update(); a disabled scaler's step()). ``device``: where
        the count is to live from now on (the scale's); None keeps it where it is."""
        if device is not None and self.iteration.device != device:
            self.iteration = self.iteration.to(device)
        self.iteration.add_(1)
        self._calls = {}

    def stamp(self, group: Any, scale: torch.Tensor) -> torch.Tensor:
        """This rank's ``STAMP`` columns for the next combine on ``group`` (float64; a float32
        scale is exact in it), counting the combine."""
        call = self._calls.get(group, 0)
        self._calls[group] = call + 1
        iteration = self.iteration.to(scale.device, torch.float64, non_blocking=True).reshape(1)
        return torch.cat([scale.detach().reshape(1).double(), iteration, on_device([call], scale.device)])

    def judge(self, checked: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor | None:
        """``checked``: [world, len(names)], every rank's values in rank order (the same on every
        rank). Where reads are free, raise if any column differs; else return the device flag
        (1.0: mismatch) that the caller folds into the step's found_inf, also kept in ``pending``."""
        if host_reads.are_free(checked.device):
            values = checked.tolist()
            if any(row != values[0] for row in values):
                raise RankMismatchError(describe(values, names))
            return None
        flag = (checked != checked[:1]).any().float()
        if self.pending is None:
            self.pending, self._seen = flag, (checked, names)
        else:
            seen, seen_names = self._seen
            if seen_names == names and seen.shape == checked.shape:  # keep the first mismatch's values
                self._seen = (torch.where(self.pending > 0, seen, checked), names)
            self.pending = torch.maximum(self.pending, flag)
        return flag

    def raise_if_flagged(self) -> None:
        """Raise the mismatch a GPU-path combine flagged (a host read); called only where the
        scaler reads the host anyway. Clears it."""
        if self.pending is None:
            return
        pending, (checked, names) = self.pending, self._seen
        self.pending = self._seen = None
        if pending.item():
            raise RankMismatchError(describe(checked.tolist(), names))

    def read_skip(self, skip: torch.Tensor) -> bool:
        """Read a step's skip flag on the host (a step that reads it anyway); a skip that was a
        pending mismatch raises it."""
        if not skip.item():
            return False
        self.raise_if_flagged()
        return True

    def skip(self, skip: torch.Tensor) -> torch.Tensor:
        """A step's skip flag, forced on while a mismatch is pending."""
        if self.pending is None:
            return skip
        return torch.maximum(skip, self.pending.to(skip.device, non_blocking=True).to(skip.dtype))

    @contextlib.contextmanager
    def unchanged_if_mismatched(self, state: Any) -> Iterator[None]:
        """Around update(): where a mismatch is pending, the device state (a ``DeviceState``) ends
        as it began, on the device (no host read). Nothing to do without a pending flag."""
        if self.pending is None or state is None:
            yield
            return
        tensors = [getattr(state, f.name) for f in dataclasses.fields(state)]
        saved = [t.clone() for t in tensors]
        try:
            yield
        finally:
            keep = self.pending > 0
            for tensor, old in zip(tensors, saved):
                tensor.copy_(torch.where(keep.to(tensor.device), old, tensor))

    def __getstate__(self) -> dict[str, Any]:
        # Process groups and device flags do not travel; the count does (on the CPU).
        return {"iteration": self.iteration.cpu(), "_calls": {}, "pending": None, "_seen": None}


def on_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Host numbers as a tensor on ``device``, copied without waiting for the device's queue (a
    ``torch.tensor(..., device=cuda)`` copy waits for the stream)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def describe(values: list[list[float]], names: tuple[str, ...]) -> str:
    """The error message: each column the ranks disagree on, every rank's value, what to do."""
    lines = []
    for column, name in enumerate(names):
        seen = [row[column] for row in values]
        if any(v != seen[0] for v in seen):
            shown = ", ".join(f"rank {r}: {_shown(name, v)}" for r, v in enumerate(seen))
            label, advice = CHECKED[name]
            lines.append(f"{label} differs between the ranks ({shown}); {advice}")
    return (
        f"tritonscale: the {len(values)} ranks of the process group disagree, so the combined step "
        "would be wrong on some of them; nothing of this step was applied. " + ". ".join(lines)
    )


def _shown(name: str, value: float) -> str:
    if name == "scale":
        return repr(value)
    if name == "layout":
        return f"{int(value):08x}"
    return str(int(value))
