"""The loop's calls on the paths a GPU takes: ``SkipAwareLR.step`` is one launch, ``StepLog.record``
one launch and the log's copy (issue 41), whatever the policy and the number of param groups, and
the values are those of the torch ops they replace, bit for bit.

Launches are counted on the CPU (tests/support/launches.py): the host-read switch off, the Triton backend.
The oracle of the values is the same run with the torch ops (``one_launch`` switched off), and the
existing oracles beside them (torch's scheduler stepped on applied steps, stats() read at once).
"""

from __future__ import annotations

import pytest
import torch
from integrations.skip_truth import SKIP_CASES, GradInjector, injected_kind, scaler_kwargs
from support.launches import LaunchCounter
from oracles.stats import exact, oracle_rows, run_case

import tritonscale
import tritonscale.loop.lr_schedules as lr_schedules
import tritonscale.scaler.grad_scaler as grad_scaler
from tritonscale import host_reads
from tritonscale.scaler.grad_scaler import live_skip_counter

KNOBS = {"defaults": {}, "rich": {"hysteresis": 2, "skip_norm_factor": 5.0, "growth_interval": 2}}
STEPS = 6


def _loop(knobs: dict, groups: int):
    """A fused AdamW with tensor lrs in ``groups`` groups, its scaler (Triton backend), a SkipAwareLR and a StepLog."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(2)]
    param_groups = (
        [{"params": params}]
        if groups == 1
        else [{"params": params[:1]}, {"params": params[1:], "lr": torch.tensor(0.5)}]
    )
    opt = torch.optim.AdamW(param_groups, lr=torch.tensor(1e-3), fused=True)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **knobs)
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), scaler, total_steps=STEPS)
    return params, opt, scaler, sched, tritonscale.StepLog(delay=0)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("knobs", list(KNOBS))
def test_skip_aware_lr_and_step_log_are_one_launch_each(forbid_host_reads, knobs, groups):
    params, opt, scaler, sched, log = _loop(KNOBS[knobs], groups)
    counter = LaunchCounter()
    for step in range(3):
        for p in params:
            p.grad = None
        scaler.scale(sum((p * p).sum() for p in params) * (float("inf") if step == 1 else 1.0)).backward()
        with forbid_host_reads.armed():
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            with counter.phase(f"SkipAwareLR.step {step}"):
                sched.step()
            with counter.phase(f"StepLog.record {step}"):
                log.record(scaler)
    for step in range(3):  # the first too: the scaler's state exists from scale() on
        assert counter.ops[f"SkipAwareLR.step {step}"] == ["triton.advance_lr_kernel"]
        assert counter.ops[f"StepLog.record {step}"] == ["triton.gather_stats_kernel", "aten.copy_"]  # + the log's copy
    assert [values["skipped"] for _, values in log.flush()] == [0, 1, 0]


def _torch_ops(monkeypatch) -> None:
    """The same paths, with the torch ops in place of the one launch (the oracle)."""
    monkeypatch.setattr(lr_schedules, "one_launch", lambda device, backend: False)
    monkeypatch.setattr(grad_scaler, "one_launch", lambda device, backend: False)


def _lr_run(case: str, groups: int) -> tuple[list, list]:
    """skip_truth's ``case`` with every lr a tensor (``groups`` groups): each step's lrs and applied count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    two = [{"params": [model.weight]}, {"params": [model.bias], "lr": torch.tensor(3e-3)}]
    opt = torch.optim.AdamW(two if groups == 2 else model.parameters(), lr=torch.tensor(1e-2), fused=True)
    scaler = tritonscale.GradScaler("cpu", backend="triton", **scaler_kwargs(case))  # the kernels launch
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 1, 0.7), scaler, total_steps=STEPS)
    GradInjector(model.weight, injected_kind(case), at=(1, 3, 4))
    lrs, counts = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        lrs.append([g["lr"].clone() for g in opt.param_groups])
        counts.append(sched.state_dict())
    return lrs, counts


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("case", SKIP_CASES)
def test_the_one_launch_lr_step_equals_the_torch_ops(monkeypatch, case, groups):
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    launched = []
    monkeypatch.setattr(lr_schedules, "advance_lr", lambda *a, _f=lr_schedules.advance_lr: launched.append(_f(*a)))
    lrs, counts = _lr_run(case, groups)
    assert len(launched) == STEPS  # every step: the scaler has its state from the first scale() on
    _torch_ops(monkeypatch)
    oracle_lrs, oracle_counts = _lr_run(case, groups)
    assert len(launched) == STEPS  # the oracle launched nothing
    for got, expected in zip(lrs, oracle_lrs):
        assert [t.dtype for t in got] == [t.dtype for t in expected] and torch.equal(
            torch.stack(got), torch.stack(expected)
        )
    assert [int(c["applied_steps"]) for c in counts] == [int(c["applied_steps"]) for c in oracle_counts]
    assert [c["calls"] for c in counts] == list(range(1, STEPS + 1))
    assert len({tuple(t.item() for t in step) for step in lrs}) > 2  # the rates moved


@pytest.mark.parametrize("case", SKIP_CASES)
def test_gathered_stats_and_their_rows_are_those_read_at_once(monkeypatch, case):
    """stats() gathered in one launch: each value's dtype and bits are the clones'; StepLog's rows
    from the one copied buffer equal the rows read at once from the torch ops' stats()."""
    oracle = oracle_rows(case)  # the host-read paths: stats() as clones
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    log, gathered = tritonscale.StepLog(delay=2, slots=3), []

    def each_step(step, scaler):
        stats = scaler.stats()
        gathered.append(len({t.untyped_storage().data_ptr() for t in stats.values()}) == 1)
        log.record(scaler, step)

    run_case(case, each_step, backend="triton")  # the kernels launch
    assert all(gathered)
    assert exact(log.flush()) == exact(oracle)
    _torch_ops(monkeypatch)
    assert exact(oracle_rows(case)) == exact(oracle)  # the GPU paths' own torch ops: the same rows


def test_a_replaced_lr_tensor_is_written_and_refused_inside_a_capture(monkeypatch):
    """The address table is proved at each call: a group's lr tensor replaced since the last step
    gets the rate (the table rebuilt), and inside a capture the rebuild is refused, changing nothing."""
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    params, opt, scaler, sched, _ = _loop({}, 2)
    for _ in range(2):
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    opt.param_groups[1]["lr"] = torch.tensor(9.0)
    monkeypatch.setattr(host_reads, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="lr tensor new since the warm-up.*warm up with"):
        sched.step()
    assert sched.state_dict()["calls"] == 2 and float(opt.param_groups[1]["lr"]) == 9.0
    monkeypatch.setattr(host_reads, "capturing", lambda device: False)
    sched.step()
    assert float(opt.param_groups[1]["lr"]) == 0.25  # StepLR(2, 0.5) from 0.5 after 3 applied steps


def test_live_skip_counter_is_what_last_skip_flag_reads():
    """live_skip_counter(scaler): None with no state and for a disabled scaler (use the flag
    there); after each update, > 0 exactly when last_skip_flag() is set."""
    assert live_skip_counter(tritonscale.GradScaler("cpu")) is None
    assert live_skip_counter(tritonscale.GradScaler("cpu", enabled=False)) is None
    params, opt, scaler, _, _ = _loop({}, 1)
    for bad in (False, True, False):
        scaler.scale(sum((p * p).sum() for p in params) * (float("inf") if bad else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        counter = live_skip_counter(scaler)
        assert counter.dtype == torch.int32 and counter.dim() == 0
        assert bool(counter > 0) == bool(scaler.last_skip_flag()) == bad
        opt.zero_grad()
