"""StepLog: each step's stats() reach the logger a few records later, exact, in order, with no host read.

The oracle is the synchronous read: each step's ``scaler.stats()`` read at once (tests/oracles/stats.py)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from support.host_reads import HostReadGuard
from integrations.skip_truth import SKIP_CASES
from oracles.stats import POISONED, STEPS, exact, oracle_rows, read_at_once, run_case

import tritonscale
from tritonscale import StepLog
from tritonscale.scaler.diagnostics import NO_STATS_WHEN_DISABLED, STAT_NAMES


def logged_rows(case: str, log: StepLog, read_each_step: bool, steps: int = STEPS) -> list[tuple[int, dict]]:
    """The rows ``log`` hands out over ``case``'s run: ready() after each record (or never), then flush()."""
    rows = []

    def each_step(step, scaler):
        log.record(scaler, step)
        if read_each_step:
            rows.extend(log.ready())

    run_case(case, each_step, steps)
    return rows + log.flush()


@pytest.mark.parametrize("read_each_step", [True, False], ids=["ready-each-step", "flush-at-the-end"])
@pytest.mark.parametrize("case", SKIP_CASES)
def test_logged_values_are_those_read_at_once_at_their_step(case, read_each_step):
    # 3 slots over 14 steps: every slot is reused four times, and with flush at the end the first
    # rows are handed out 11+ records after their step (a live view would show later values).
    rows = logged_rows(case, StepLog(delay=2, slots=3), read_each_step)
    oracle = oracle_rows(case)
    assert set(oracle[0][1]) == set(STAT_NAMES)  # the row holds every entry of stats()
    assert exact(rows) == exact(oracle)


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_ready_hands_out_rows_delay_records_old_in_order(delay):
    log = StepLog(delay=delay)
    handed_out = []

    def each_step(step, scaler):
        log.record(scaler, 100 + step)
        handed_out.append([s for s, _ in log.ready()])

    run_case("sgd", each_step, steps=6)
    # On the CPU every copy is done at once, so only the delay holds a row back.
    expected = [[100 + k - delay] if k >= delay else [] for k in range(6)]
    assert handed_out == expected
    assert [s for s, _ in log.flush()] == [100 + k for k in range(6 - delay, 6)]
    assert log.flush() == [] and len(log) == 0


def test_flush_returns_every_row_in_order_and_the_callback_sees_each_once():
    seen = []
    log = StepLog(delay=3, slots=4, on_ready=lambda step, values: seen.append((step, values)))
    rows = logged_rows("hysteresis", log, read_each_step=False, steps=9)  # the ring fills twice over
    assert exact(rows) == exact(oracle_rows("hysteresis", steps=9))
    assert seen == rows


def test_no_host_read_in_a_whole_step_record_and_ready(backend, forbid_host_reads):
    # A fused optimizer, so the step itself reads nothing on the GPU paths: the whole loop is armed.
    log, rows = StepLog(delay=1, slots=2), []

    def each_step(step, scaler):
        log.record(scaler, step)
        rows.extend(log.ready())

    with forbid_host_reads.armed():
        run_case("fused_adamw", each_step, backend=backend)
    assert exact(rows + log.flush()) == exact(oracle_rows("fused_adamw", backend=backend))


def test_the_guard_lets_the_log_read_its_ring_and_nothing_else(monkeypatch):
    """The host-read guard allows StepLog's read of its own host ring (host memory, the copy done),
    not a device value read there (what a regression reading the device row would do) nor the ring
    read anywhere else."""
    read, scales = StepLog._read, []

    def reads_a_device_value_too(log, slot, layout):
        scales[-1].item()
        return read(log, slot, layout)

    monkeypatch.setattr(StepLog, "_read", reads_a_device_value_too)
    guard = HostReadGuard(monkeypatch.setattr)  # over the patched read, as over StepLog's own
    log = StepLog(delay=0)

    def each_step(step, scaler):
        log.record(scaler, step)
        scales.append(scaler.stats()["scale"])

    run_case("sgd", each_step, steps=1)
    with guard.armed(), pytest.raises(AssertionError, match="host read Tensor.item inside the step"):
        log.ready()
    with guard.armed(), pytest.raises(AssertionError, match="host read Tensor.tolist inside the step"):
        log._ring.tolist()


def test_a_disabled_scaler_is_refused_and_the_log_is_left_as_it_was():
    log = StepLog(delay=0)
    run_case("sgd", lambda step, scaler: log.record(scaler, step), steps=1)
    disabled = tritonscale.GradScaler("cpu", enabled=False)
    with pytest.raises(RuntimeError) as caught:
        log.record(disabled, 1)
    assert str(caught.value) == NO_STATS_WHEN_DISABLED
    assert exact(log.flush()) == exact(oracle_rows("sgd", steps=1))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"delay": -1}, ValueError, "delay must be at least 0"),
        ({"delay": 1.5}, TypeError, "takes an int"),
        ({"delay": True}, TypeError, "takes an int"),
        ({"delay": 3, "slots": 3}, ValueError, "slots must be at least 4"),
        ({"on_ready": 5}, TypeError, r"on_ready=\.\.\.\) takes a callable \(step, values\).*or None; got int 5"),
        ({"on_ready": "log.txt"}, TypeError, r"on_ready=\.\.\.\) takes a callable"),
    ],
    ids=["negative-delay", "float-delay", "bool-delay", "ring-no-larger-than-delay", "int-writer", "path-writer"],
)
def test_bad_arguments_say_what_works(kwargs, error, words):
    with pytest.raises(error, match=words):
        StepLog(**kwargs)


def test_a_tensor_step_or_torchs_scaler_is_refused_before_any_change():
    log = StepLog(delay=0)

    def each_step(step, scaler):
        with pytest.raises(TypeError, match="Python int, not a tensor"):
            log.record(scaler, torch.tensor(step))
        with pytest.raises(TypeError, match="takes a tritonscale.GradScaler"):
            log.record(torch.amp.GradScaler("cpu"), step)
        log.record(scaler, step)

    run_case("sgd", each_step, steps=3)
    assert exact(log.flush()) == exact(oracle_rows("sgd", steps=3))


class FlakyWriter:
    """A writer (a file on a full disk, a socket) that raises once, when given step ``fail_at``."""

    def __init__(self, fail_at: int):
        self.rows, self.fail_at, self.failed = [], fail_at, False

    def __call__(self, step: int, values: dict) -> None:
        if step == self.fail_at and not self.failed:
            self.failed = True
            raise OSError(28, "No space left on device")
        self.rows.append((step, values))


@pytest.mark.parametrize("read_each_step", [True, False], ids=["ready-each-step", "flush-at-the-end"])
def test_a_writer_that_raises_loses_no_row_and_gets_none_twice(read_each_step):
    writer, returned, steps = FlakyWriter(fail_at=2), [], 6
    log = StepLog(delay=0, on_ready=writer)

    def each_step(step, scaler):
        log.record(scaler, step)
        if read_each_step:
            try:
                returned.extend(log.ready())
            except OSError:
                assert step == 2 and len(log) == 1  # the row that failed is still held

    run_case("hysteresis", each_step, steps)
    if not read_each_step:
        with pytest.raises(OSError, match="No space left"):
            log.flush()
        assert len(log) == steps - 2 and [s for s, _ in writer.rows] == [0, 1]  # 0, 1 delivered; 2.. held
    returned += log.flush()
    # The writer got every step once, in order, with the values read at once at that step.
    assert exact(writer.rows) == exact(oracle_rows("hysteresis", steps=steps))
    delivered_before_the_error = [] if read_each_step else writer.rows[:2]  # the raising flush returned nothing
    assert exact(delivered_before_the_error + returned) == exact(writer.rows)
    assert len(log) == 0 and log.flush() == []


def test_a_step_that_is_not_an_int_is_refused_before_any_change():
    log = StepLog(delay=0)

    def each_step(step, scaler):
        for bad in (step + 0.5, float(step), True, str(step), [step]):
            with pytest.raises(TypeError, match=r"step takes a Python int \(or None for the count of rows"):
                log.record(scaler, bad)
        assert len(log) == 0  # nothing recorded by a refused call
        log.record(scaler, np.int64(step))  # numpy ints are steps (operator.index takes them)
        (row,) = log.ready()
        assert type(row[0]) is int and row[0] == step

    run_case("sgd", each_step, steps=3)
    assert len(log) == 0


def test_the_docstring_example_runs():
    example = textwrap.dedent(StepLog.__doc__.split("::\n", 1)[1])
    exec(compile(example, "StepLog docstring", "exec"), {})


@pytest.mark.gpu
def test_on_a_gpu_rows_come_through_pinned_memory_and_events():
    # Each step's stats are also read at once (a sync, after the record): the oracle.
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = tritonscale.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    log, rows, oracle = StepLog(delay=2, slots=3), [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(4, 64, device="cuda")).sum()).backward()
        if step in POISONED:
            model.weight.grad[0, 0] = float("inf")
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        log.record(scaler, step)
        rows.extend(log.ready())
        oracle.append((step, read_at_once(scaler)))
    assert exact(rows + log.flush()) == exact(oracle)
