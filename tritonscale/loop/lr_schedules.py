"""A learning-rate schedule that advances only on applied steps, with no host read.

Megatron-LM's rule (the scheduler steps only when the update succeeded), without the sync that
knowing it on the host costs: the step counter lives on the device and adds the negation of
``scaler.last_skip_flag()`` (the combined flag across ranks). The rate is torch's own for that count,
taken from a table of the wrapped scheduler's rates made once at construction (``lr_tables.py``
says why a table and not a closed form: it is torch's arithmetic, bit for bit).

Optimizers whose ``param_group["lr"]`` is a tensor (torch's fused or capturable Adam/AdamW/SGD built
with ``lr=torch.tensor(...)``) get the rate written into that tensor in place, on the device: no
host read; on the paths a GPU takes, one launch for the whole step() (``kernels/loop_state.py``:
the count, the calls and every group's rate). A group whose ``lr`` is a Python float can only be
set from the host, so there ``step()`` reads the counter once (one host read per step, as the recipe
``if not scaler.last_step_skipped(): scheduler.step()``); pass a tensor lr to avoid it.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..host_reads import refuse_in_capture
from ..kernels import TRITON_FOUND
from ..scaler.diagnostics import one_launch
from ..scaler.grad_scaler import GradScaler, live_skip_counter
from .lr_tables import check_schedulable, check_total_steps, record_lrs
from .scaler_arg import check_scaler

STATE_KEYS = ("applied_steps", "calls")

if TRITON_FOUND:  # without triton step() takes the torch ops (one_launch says False)
    from ..kernels.loop_state import advance_lr


class SkipAwareLR:
    """Wraps a freshly built torch scheduler; ``step()`` after ``scaler.update()`` advances it only if
    the step was applied. The wrapped scheduler itself is never stepped: checkpoint this object's
    ``state_dict()``. ``total_steps``: how many times ``step()`` will be called; construction steps a
    twin of the scheduler that many times on the host (one table entry per step, kept on the lr's
    device), and OneCycleLR's own ``total_steps`` is the default. A tensor lr is set on the device;
    a float lr costs one host read per ``step()`` (pass ``lr=torch.tensor(...)`` to avoid it).

    Args:
        scheduler: a torch lr scheduler, built and not yet stepped (``last_epoch == 0``).
        scaler: the scaler whose ``last_skip_flag()`` tells whether each step was applied.
        total_steps: how many times ``step()`` will be called; None (the default) takes a
            OneCycleLR's own ``total_steps``.

    Raises:
        ValueError: a scheduler already stepped, one that cannot be tabled, or a missing or invalid
            ``total_steps``.
        TypeError: a scheduler that cannot be tabled, or a scaler without ``last_skip_flag()``.

    Example::

        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)  # a tensor lr
        scaler = tritonscale.GradScaler("cpu")
        sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, step_size=2), scaler, total_steps=4)
        for _ in range(4):
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(opt); scaler.update(); sched.step()  # no host read
            opt.zero_grad()
    """

    def __init__(self, scheduler: Any, scaler: GradScaler, *, total_steps: int | None = None) -> None:
        check_schedulable(scheduler)
        if scheduler.last_epoch != 0:
            raise ValueError(
                f"SkipAwareLR: this {type(scheduler).__name__} was already stepped (last_epoch="
                f"{scheduler.last_epoch}); wrap it right after it is built, and resume a run with "
                "SkipAwareLR.load_state_dict"
            )
        check_scaler(scaler, "SkipAwareLR", "last_skip_flag")
        self.total_steps = check_total_steps(scheduler, total_steps)
        self.scheduler, self.optimizer, self._scaler = scheduler, scheduler.optimizer, scaler
        # The wrapped scheduler's last_epoch as step() last accepted it (0: never stepped); a hand
        # step moves it, step() refuses once, and the epoch it reported becomes the accepted one.
        self._scheduler_epoch = scheduler.last_epoch
        rows = record_lrs(scheduler, self.total_steps)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        # Per group: a device table (tensor lr) or a host list of floats (float lr).
        columns = [[row[i] for row in rows] for i in range(len(lrs))]
        self._tables = [
            torch.stack(column).to(lr.device) if isinstance(lr, torch.Tensor) else column
            for lr, column in zip(lrs, columns)
        ]
        tensor_lrs = [lr for lr in lrs if isinstance(lr, torch.Tensor)]
        device = tensor_lrs[0].device if tensor_lrs else _params_device(self.optimizer)
        self._count = torch.zeros((), dtype=torch.int64, device=device)  # applied steps
        # step() calls: counted on the device (a replayed CUDA graph advances it; a Python number
        # would stay at its capture value), and on the host for the eager calls, so the table's end
        # is known without a read. Replays past total_steps keep the last rate (the index is clamped).
        self._calls = torch.zeros((), dtype=torch.int64, device=device)
        self._host_calls = 0
        # The one-launch step's inputs: every group's table in one [groups, total_steps + 1] tensor
        # (all tensor lrs of one dtype on the count's device), and the lrs' addresses (``_lr_addresses``).
        same = len({(t.dtype, t.device) for t in tensor_lrs}) == 1 and len(tensor_lrs) == len(lrs)
        self._stacked = torch.stack(self._tables) if same and tensor_lrs[0].device == device else None
        self._addresses: tuple[tuple[int, ...], torch.Tensor] | None = None

    @property
    def applied_steps(self) -> torch.Tensor:
        """The number of applied steps so far: a 0-dim int64 device tensor (a copy).

        Returns:
            the count, a new 0-dim int64 tensor.
        """
        return self._count.clone()

    def step(self) -> None:
        """After ``scaler.update()``: count the step if it was applied and set each group's rate.

        Raises:
            RuntimeError: past ``total_steps``; the optimizer's param groups changed; the wrapped
                scheduler was stepped by hand since the last ``step()``. Nothing is counted or set.
                After the hand-step refusal, remove that call and call ``step()`` again: it goes on
                from the applied steps counted, and sets their rate over the one the hand step wrote.
        """
        # Traced, the host count is not kept (a Python int Dynamo would guard on and recompile at
        # each call); as in a replayed capture, a call past total_steps keeps the last rate.
        traced = torch.compiler.is_compiling()
        if not traced and self._host_calls >= self.total_steps:
            raise RuntimeError(
                f"SkipAwareLR was built with total_steps={self.total_steps} and step() was called that many "
                "times; build it with a larger total_steps"
            )
        self._check_not_stepped_by_hand()
        self._check_groups()
        if any(not isinstance(t, torch.Tensor) for t in self._tables):
            refuse_in_capture(
                self._count.device,
                "SkipAwareLR.step() with a float lr (set from the host)",
                "build the optimizer with lr=torch.tensor(...) on the parameters' device",
            )
        counter, addresses = self._one_launch_inputs()
        if addresses is not None:
            advance_lr(counter, self._count, self._calls, self._stacked, addresses)
        else:
            self._count_and_write()
        if not traced:
            self._host_calls += 1

    def _count_and_write(self) -> None:
        """``step()`` in torch ops: the count, the calls, each group's rate."""
        skipped = self._scaler.last_skip_flag()
        if skipped is None:  # the scaler has no state yet: nothing was skipped
            self._count.add_(1)
        else:
            self._count.add_((~torch.as_tensor(skipped)).to(device=self._count.device, dtype=torch.int64))
        self._calls.add_(1)
        self._write_lrs()

    def _one_launch_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the scaler's skip counter, the lrs' address table) when ``step()`` is one launch
        (``advance_lr``): the paths a GPU takes, every lr a tensor of one dtype on the count's
        device, and the scaler's ``live_skip_counter`` there; (_, None) otherwise."""
        device = self._count.device
        if self._stacked is None or not one_launch(device, getattr(self._scaler, "backend", "auto")):
            return None, None
        counter = live_skip_counter(self._scaler)  # None for a wrapper: it forwards only the flag
        if counter is None or counter.device != device:
            return None, None
        return counter, self._lr_addresses()

    def _lr_addresses(self) -> torch.Tensor | None:
        """The groups' lr addresses as an int64 device tensor, rebuilt when an lr tensor was
        replaced (checked each call: a group's lr is the optimizer's to change); None when one is
        not a 0-dim tensor of the table's dtype (then step() takes the torch ops)."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        if any(lr.dtype != self._stacked.dtype or lr.device != self._count.device or lr.dim() != 0 for lr in lrs):
            return None
        key = tuple([lr.data_ptr() for lr in lrs])
        if self._addresses is None or self._addresses[0] != key:
            refuse_in_capture(
                self._count.device,
                "SkipAwareLR.step() with a param group's lr tensor new since the warm-up",
                "warm up with the optimizer's lr tensors as the graph will use them",
            )
            self._addresses = (key, torch.tensor(key, dtype=torch.int64).to(self._count.device))
        return self._addresses[1]

    def get_last_lr(self) -> list[torch.Tensor | float]:
        """Each group's current rate: a device tensor (a copy, not the group's lr) for a tensor lr,
        a float for a float lr (that group's value, as torch's get_last_lr).

        Returns:
            a list with one rate per param group.
        """
        return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """``applied_steps`` (a device tensor copy) and ``calls`` (the number of step() calls, replays of a
        captured step() included: read on the host).

        Returns:
            a dict with those two entries.
        """
        return {"applied_steps": self._count.clone(), "calls": int(self._calls)}  # calls: one host read

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the count, the calls, and each group's rate for that count. Reads the count on the
        host once to check it (a load, not a step). Raises, changing nothing, on a malformed state.

        Args:
            state_dict: the dict :meth:`state_dict` returned.

        Raises:
            ValueError: not a dict of those two entries, a non-integer entry, or one outside
                ``0 <= applied_steps <= calls <= total_steps``.
            RuntimeError: the optimizer's param groups changed since construction.
        """
        applied, calls = _checked_state(state_dict, self.total_steps)
        self._check_groups()
        self._count.fill_(applied)
        self._calls.fill_(calls)
        self._host_calls = calls
        self._write_lrs()

    def _write_lrs(self) -> None:
        # Clamped: a replayed capture can count past total_steps, and must not read past the table.
        index = self._count.clamp(max=self.total_steps).view(1)
        host_count = None
        for group, table in zip(self.optimizer.param_groups, self._tables):
            if isinstance(table, torch.Tensor):
                group["lr"].copy_(table.index_select(0, index.to(table.device)).view(()))
            else:
                host_count = int(self._count) if host_count is None else host_count  # the one host read
                group["lr"] = table[host_count]

    def _check_not_stepped_by_hand(self) -> None:
        # Each scheduler.step() rewrites the rate by its own chain: a call left in the loop after
        # wrapping would silently undo or double this object's rate (torch refuses what it can, too).
        # The wrapped scheduler is read nowhere else (the rates come from the table), so once the
        # call is gone its epoch stays where the refusal saw it: noting that epoch lets the next
        # step() go on, and a call still in the loop moves it again, refused again.
        epoch = self.scheduler.last_epoch
        if epoch == self._scheduler_epoch:
            return
        self._scheduler_epoch = epoch  # the hand step is reported; no rate, count or state changes
        name = type(self.scheduler).__name__
        raise RuntimeError(
            f"SkipAwareLR: the wrapped {name} was stepped by hand (last_epoch={epoch}) since the last "
            f"SkipAwareLR.step(); remove the `{name}.step()` call from the loop (SkipAwareLR.step() replaces "
            "it: it sets the rate of each applied step), then call SkipAwareLR.step() again for this "
            "iteration: it sets the applied steps' rate over the one the hand step wrote. This call changed "
            "nothing and counted nothing."
        )

    def _check_groups(self) -> None:
        groups = self.optimizer.param_groups
        kinds = [isinstance(t, torch.Tensor) for t in self._tables]
        if len(groups) != len(self._tables) or [isinstance(g["lr"], torch.Tensor) for g in groups] != kinds:
            raise RuntimeError(
                "SkipAwareLR: the optimizer's param groups (their number, or a float/tensor lr) changed since it "
                "was built; build a new scheduler and SkipAwareLR for them"
            )


def _params_device(optimizer: torch.optim.Optimizer) -> torch.device:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return params[0].device if params else torch.device("cpu")


def _checked_state(state_dict: Any, total_steps: int) -> tuple[int, int]:
    """(applied steps, calls) of a SkipAwareLR state_dict, or ValueError naming what is wrong."""
    if not isinstance(state_dict, dict) or sorted(state_dict) != sorted(STATE_KEYS):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"SkipAwareLR.load_state_dict expects a dict with keys {list(STATE_KEYS)}, got {got}")
    applied, calls = state_dict["applied_steps"], state_dict["calls"]
    integer_tensor = isinstance(applied, torch.Tensor) and not (applied.is_floating_point() or applied.is_complex())
    if integer_tensor and applied.numel() == 1 and applied.dtype != torch.bool:
        applied = int(applied.reshape(()).cpu())
    for name, value in (("applied_steps", applied), ("calls", calls)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"SkipAwareLR.load_state_dict: {name} must be an integer, got {value!r}")
    if not 0 <= applied <= calls <= total_steps:
        raise ValueError(
            f"SkipAwareLR.load_state_dict: need 0 <= applied_steps ({applied}) <= calls ({calls}) <= total_steps "
            f"({total_steps}); a checkpoint of a longer run needs a SkipAwareLR built with a larger total_steps"
        )
    return int(applied), int(calls)


__all__ = ["SkipAwareLR"]
