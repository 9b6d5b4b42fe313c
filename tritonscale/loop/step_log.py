"""Logging without a sync: each step's ``stats()`` copied to host memory in the background and
handed to the logger a few steps later, with its step number.

A logger that reads ``scaler.stats()`` at once waits for the device every step, which undoes the
overlap the fused pass buys. ``StepLog.record`` packs the stats into one device row (one stack,
float64: the counters stay exact integers and the float32 scale and norm bit-exact; on the paths a
GPU takes ``stats()`` already gathered them into one buffer, one launch, which is copied as it is,
each value in its own dtype), starts a non-blocking copy of it into a slot of a host ring (pinned
memory on an accelerator; on the CPU the copy is a plain synchronous copy) and records an event
after the copy. ``ready`` hands out the rows whose copy has finished (``event.query()``, which
never waits) and that are at least ``delay`` records old; ``flush`` waits for the rest, at the end.

Reading a slot is a host-memory read, not a device read: once the copy's event has completed, the
slot's bytes are in host memory (the ring is a CPU tensor), and ``Tensor.item`` on each value's
bytes waits for nothing. The values handed out are Python numbers, copies: the slot is reused, and
a step's values stay that step's.

The ring is allocated once, at the first record, with ``slots`` rows. It never hands out a slot
still in flight: when every slot is taken, the oldest row is completed first, which on a GPU may
wait for its copy. With ``ready()`` called each step, ``slots > delay`` leaves room; the default
adds a few slots of slack for copies still running.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..host_reads import refuse_in_capture
from ..kernels.interfaces import SLOT_BYTES
from ..scaler.diagnostics import STAT_NAMES
from .scaler_arg import check_scaler

#: stats() entries handed out as Python ints (counters and trackers); the others are floats.
INT_STATS = frozenset({"skipped", "skipped_steps", "consecutive_skips", "growth_tracker", "hysteresis_left"})
SLACK = 4  # default slots beyond ``delay``: copies still running when the row is due
ROW_BYTES = SLOT_BYTES * len(STAT_NAMES)  # a row in the ring: a slot of 8 bytes per stat
#: The dtypes a row's value may have.
_ROW_DTYPES = frozenset({torch.float64, torch.float32, torch.int64, torch.int32})
#: Where each value lies in a row: (name, dtype, byte offset).
Layout = tuple[tuple[str, torch.dtype, int], ...]
STACKED: Layout = tuple((name, torch.float64, SLOT_BYTES * i) for i, name in enumerate(STAT_NAMES))
#: What a captured loop does instead of recording inside the graph.
CAPTURE_FIX = (
    "call it after each graph.replay(), outside the capture: it copies the replayed step's stats() (their "
    "tensors are the graph's outputs, rewritten by each replay)"
)


@dataclass
class _Pending:
    """A row whose copy was started: its step, its host slot, the event after the copy, the
    device row itself, kept until the copy is done (the allocator must not reuse its memory), and
    where each value lies in it."""

    step: int
    slot: int
    event: torch.Event | None  # None on the CPU: the copy was synchronous
    row: torch.Tensor
    layout: Layout

    def done(self) -> bool:
        return self.event is None or self.event.query()


class StepLog:
    """Per-step ``scaler.stats()`` for a logger, with no host read of the device and no wait.

    ``record(scaler, step)`` after ``update()`` never blocks (unless the ring is full, see the
    module docstring); ``ready()`` returns ``[(step, values), ...]`` in step order for rows that
    are ``delay`` records old and copied; ``flush()`` returns every row left (it may wait).
    ``values`` maps each name of ``STAT_NAMES`` to a Python number: ``int`` for the counters,
    ``float`` for ``scale`` (bit-exact float32), ``norm`` and ``found_inf``. ``on_ready(step,
    values)``, if given, is called for each row as ``ready()``/``flush()`` hand it out; if it raises,
    the error propagates and that row and the later ones stay in the log, handed out again (from
    the row that failed, in step order) by the next ``ready()``/``flush()``.

    A scaler made with ``enabled=False`` has no stats: ``record`` raises ``stats()``'s error
    (log ``clip_grad_norm_``'s return value and ``last_skip_flag()`` instead).

    Args:
        delay: how many later records a row waits for before ``ready()`` hands it out, an int >= 0
            (1 by default).
        slots: the rows the host ring holds, an int >= ``delay + 1``; None (the default) for
            ``delay + 4``.
        on_ready: a callable ``(step, values)`` called for each row handed out, or None (the default).

    Raises:
        TypeError: a ``delay`` or ``slots`` that is not an int, or an ``on_ready`` not callable.
        ValueError: a ``delay`` below 0, or ``slots`` below ``delay + 1``.

    Example (a fused optimizer, so no line of the loop reads the device)::

        import torch
        import tritonscale

        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = tritonscale.GradScaler("cpu")
        log = tritonscale.StepLog(delay=2)
        logged = []  # stands for writer.add_scalar("loss_scale", values["scale"], step)
        for step in range(5):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            log.record(scaler, step)  # never waits, never reads the device
            logged += [(s, values["scale"]) for s, values in log.ready()]  # rows 2 records old
        logged += [(s, values["scale"]) for s, values in log.flush()]  # the rest, at the end
        assert [s for s, _ in logged] == [0, 1, 2, 3, 4]
    """

    def __init__(self, delay: int = 1, slots: int | None = None, on_ready: Callable[[int, dict], None] | None = None):
        self.delay = _count("delay", delay, minimum=0, why="how many later records a row waits for")
        why = f"a slot for each of the {delay} rows held back and one for the new row; unset, it is delay + {SLACK}"
        self.slots = _count("slots", delay + SLACK if slots is None else slots, minimum=self.delay + 1, why=why)
        if on_ready is not None and not callable(on_ready):
            raise TypeError(
                f"StepLog(on_ready=...) takes a callable (step, values), called for each row handed out, or None; "
                f"got {type(on_ready).__name__} {on_ready!r}"
            )
        self.on_ready = on_ready
        self._ring: torch.Tensor | None = None  # [slots, len(STAT_NAMES)] float64 on the host
        self._device: torch.device | None = None  # where the rows are stacked (the first record's)
        self._pending: deque[_Pending] = deque()
        self._finished: deque[tuple[int, dict]] = deque()  # completed early: the ring was full
        self._records = 0

    def record(self, scaler, step: int | None = None) -> None:
        """Start copying this step's ``scaler.stats()`` to the host; ``step`` defaults to the
        number of rows recorded so far. Raises before any change on bad input.

        Args:
            scaler: the scaler whose ``stats()`` are recorded.
            step: the row's step, a Python int; None (the default) for the number of rows recorded.

        Raises:
            TypeError: a ``step`` that is not an int (a bool, a float, a tensor), or a scaler
                without ``stats()``.
            RuntimeError: a disabled scaler (``stats()``'s error).
        """
        step = self._records if step is None else _step(step)
        check_scaler(scaler, "StepLog.record", "stats")
        stats = scaler.stats()  # raises NO_STATS_WHEN_DISABLED for a disabled scaler
        # The ring's slot, the event and the pending rows are host state a replay would not advance.
        refuse_in_capture(stats["scale"].device, "StepLog.record", CAPTURE_FIX)
        row, layout = _row_of(stats)
        ring = self._ring_for(row.device)
        if len(self._pending) == self.slots:
            self._finish_oldest(wait=True)
        slot = self._records % self.slots
        ring[slot].copy_(row, non_blocking=True)
        event = None
        if row.device.type != "cpu":
            event = torch.Event(device=row.device)
            event.record()
        self._pending.append(_Pending(step, slot, event, row, layout))
        self._records += 1

    def ready(self) -> list[tuple[int, dict]]:
        """The rows at least ``delay`` records old whose copy has finished, oldest first. Never waits.

        Returns:
            a list of ``(step, values)``, ``values`` a dict from each stat's name to a Python number.
        """
        # The pending rows are the latest records, so the oldest has len(pending) - 1 records after it.
        while len(self._pending) > self.delay and self._pending[0].done():
            self._finish_oldest(wait=False)
        return self._hand_out()

    def flush(self) -> list[tuple[int, dict]]:
        """Every row not yet handed out, oldest first, whatever its age (waits for their copies).

        Returns:
            a list of ``(step, values)``, as :meth:`ready`'s.
        """
        while self._pending:
            self._finish_oldest(wait=True)
        return self._hand_out()

    def __len__(self) -> int:
        """Rows recorded and not yet handed out."""
        return len(self._pending) + len(self._finished)

    def _ring_for(self, device: torch.device) -> torch.Tensor:
        if self._ring is None:
            pin = device.type != "cpu"
            self._ring = torch.empty(self.slots, ROW_BYTES, dtype=torch.uint8, pin_memory=pin)
            self._device = device
        elif device != self._device:
            raise ValueError(
                f"StepLog records rows of {self._device}, and this scaler's stats are on {device}: "
                "use one StepLog per device"
            )
        return self._ring

    def _finish_oldest(self, wait: bool) -> None:
        """Read the oldest pending row into Python values (waiting for its copy if ``wait``)."""
        pending = self._pending.popleft()
        if wait and pending.event is not None:
            pending.event.synchronize()
        self._finished.append((pending.step, self._read(pending.slot, pending.layout)))

    def _read(self, slot: int, layout: Layout) -> dict:
        """The slot's values as Python numbers: a read of host memory after its copy completed (no
        device read: see the module docstring), each value from its bytes in its own dtype."""
        row = self._ring[slot]
        values = {name: row[offset : offset + dtype.itemsize].view(dtype).item() for name, dtype, offset in layout}
        return {name: int(values[name]) if name in INT_STATS else float(values[name]) for name in STAT_NAMES}

    def _hand_out(self) -> list[tuple[int, dict]]:
        """The finished rows, oldest first, each given to ``on_ready`` before it leaves the log: if
        the writer raises, that row and the later ones stay held (counted by ``len``) and the next
        ``ready()``/``flush()`` hands them out from that row on; the rows before it were delivered."""
        rows = []
        while self._finished:
            if self.on_ready is not None:
                self.on_ready(*self._finished[0])
            rows.append(self._finished.popleft())
        return rows


def _row_of(stats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Layout]:
    """``stats`` as one uint8 device row of ``ROW_BYTES`` and where each value lies in it. Gathered
    (every value a view of one buffer of that size, ``scaler/diagnostics.py``): that buffer as it
    is, no launch. Otherwise one stack of the values as float64 (exact for every dtype stats() has)."""
    first = stats[STAT_NAMES[0]]
    storage = first.untyped_storage()
    gathered = storage.nbytes() == ROW_BYTES and all(
        t.untyped_storage().data_ptr() == storage.data_ptr() and t.dtype in _ROW_DTYPES for t in stats.values()
    )
    if not gathered:
        return torch.stack([stats[name].reshape(()).to(torch.float64) for name in STAT_NAMES]).view(
            torch.uint8
        ), STACKED
    row = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (ROW_BYTES,))
    layout = tuple(
        (name, stats[name].dtype, stats[name].storage_offset() * stats[name].element_size()) for name in STAT_NAMES
    )
    return row, layout


def _step(step: object) -> int:
    """``record``'s step as a Python int: an int or any integer ``operator.index`` takes (a numpy
    int), not a bool, a float or a tensor (a device tensor's value is a host read, a sync)."""
    if isinstance(step, torch.Tensor):
        raise TypeError("StepLog.record(scaler, step): step must be a Python int, not a tensor (reading it syncs)")
    if not isinstance(step, bool):  # operator.index takes a bool as 0/1: not a step
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise TypeError(
        "StepLog.record(scaler, step): step takes a Python int (or None for the count of rows recorded), "
        f"got {type(step).__name__} {step!r}"
    )


def _count(name: str, value: int, minimum: int, why: str) -> int:
    """``value`` as an int of at least ``minimum``, or a TypeError/ValueError that says what works."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"StepLog({name}=...) takes an int ({why}), got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"StepLog({name}={value}): {name} must be at least {minimum} ({why})")
    return value
