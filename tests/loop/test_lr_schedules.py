"""SkipAwareLR against its oracle: the same torch scheduler, built with the same arguments on a twin
optimizer, stepped on the host only on applied steps (Megatron-LM's rule). Every step's learning
rate must be equal, bitwise: the wrapped rates are torch's own arithmetic (lr_tables.py).

Real runs of tritonscale.GradScaler take the skip cases of tests/integrations/skip_truth.py
(overflow, fused AdamW, hysteresis, norm spike) with the truth read from whether the parameters
moved; the property test draws skip patterns and scheduler arguments over every wrapped class.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from integrations.skip_truth import (
    INJECTED,
    SKIP_CASES,
    STEPS,
    GradInjector,
    Truth,
    injected_kind,
    scaler_kwargs,
)
from torch.optim import lr_scheduler as S

import tritonscale

LRS = (1e-2, 3e-3)  # two param groups with different rates


def _warmup_cosine(opt, start_factor=0.25, warmup=3, t_max=6):
    warm = S.LinearLR(opt, start_factor=start_factor, total_iters=warmup)
    return S.SequentialLR(opt, [warm, S.CosineAnnealingLR(opt, T_max=t_max)], milestones=[warmup])


def _three_phases(opt, factor=0.5, first=2, second=5, gamma=0.9):
    """torch's documented SequentialLR example with a third phase: ConstantLR, then ExponentialLR
    restarted at ``first``, then CosineAnnealingLR restarted at ``second`` (its closed form, torch's quirk)."""
    constant = S.ConstantLR(opt, factor=factor, total_iters=first)
    phases = [constant, S.ExponentialLR(opt, gamma), S.CosineAnnealingLR(opt, 4)]
    return S.SequentialLR(opt, phases, milestones=[first, second])


# name -> (strategy of the keyword arguments, build(optimizer, **kwargs)): every class SkipAwareLR wraps.
unit = st.floats(0.05, 0.95)
SCHEDULES = {
    "lambda": (
        st.fixed_dictionaries({"k": st.floats(0.0, 2.0)}),
        lambda o, k: S.LambdaLR(o, lambda e: 1 / (1 + k * e)),
    ),
    "multiplicative": (st.fixed_dictionaries({"f": unit}), lambda o, f: S.MultiplicativeLR(o, lambda e: f)),
    "step": (
        st.fixed_dictionaries({"step_size": st.integers(1, 4), "gamma": unit}),
        lambda o, **k: S.StepLR(o, **k),
    ),
    "multistep": (
        st.fixed_dictionaries({"milestones": st.lists(st.integers(1, 10), min_size=1, max_size=3), "gamma": unit}),
        lambda o, milestones, gamma: S.MultiStepLR(o, sorted(milestones), gamma),
    ),
    "constant": (
        st.fixed_dictionaries({"factor": unit, "total_iters": st.integers(0, 6)}),
        lambda o, **k: S.ConstantLR(o, **k),
    ),
    "linear": (
        st.fixed_dictionaries({"start_factor": unit, "end_factor": unit, "total_iters": st.integers(1, 8)}),
        lambda o, **k: S.LinearLR(o, **k),
    ),
    "exponential": (st.fixed_dictionaries({"gamma": unit}), lambda o, **k: S.ExponentialLR(o, **k)),
    "polynomial": (
        st.fixed_dictionaries({"total_iters": st.integers(1, 8), "power": st.floats(0.5, 3.0)}),
        lambda o, **k: S.PolynomialLR(o, **k),
    ),
    "cosine": (
        st.fixed_dictionaries({"T_max": st.integers(1, 10), "eta_min": st.floats(0.0, 1e-3)}),
        lambda o, **k: S.CosineAnnealingLR(o, **k),
    ),
    "warmup_cosine": (
        st.fixed_dictionaries({"start_factor": unit, "warmup": st.integers(1, 5), "t_max": st.integers(1, 10)}),
        _warmup_cosine,
    ),
    "three_phases": (
        st.fixed_dictionaries({"factor": unit, "first": st.integers(1, 4), "second": st.integers(5, 9), "gamma": unit}),
        _three_phases,
    ),
    "onecycle": (
        st.fixed_dictionaries(
            {
                "max_lr": st.floats(1e-3, 1.0),
                "total_steps": st.integers(12, 20),
                "pct_start": st.floats(0.1, 0.9),
                "anneal_strategy": st.sampled_from(["cos", "linear"]),
                "three_phase": st.booleans(),
            }
        ),
        lambda o, **k: S.OneCycleLR(o, cycle_momentum=False, **k),
    ),
}


def _optimizer(lr_kind: str, params=None, fused: bool = False) -> torch.optim.Optimizer:
    """Two param groups (LRS); lr a float or a 0-dim tensor. Fused AdamW for ``fused``, else SGD."""
    params = params or [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": [p], "lr": torch.tensor(lr) if lr_kind == "tensor" else lr} for p, lr in zip(params, LRS)]
    if fused:
        return torch.optim.AdamW(groups, lr=groups[0]["lr"], fused=True)
    return torch.optim.SGD(groups, lr=groups[0]["lr"])


def _lrs(opt: torch.optim.Optimizer) -> list:
    return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in opt.param_groups]


def _same(a: list, b: list) -> bool:
    """Bitwise: same types, same dtypes, same bits."""
    pairs = zip(a, b, strict=True)
    return all(
        (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else (type(x) is type(y) and x == y)
        for x, y in pairs
    )


class FlagScaler:
    """A scaler reduced to what SkipAwareLR reads: ``last_skip_flag()``, a 0-dim bool tensor."""

    def __init__(self) -> None:
        self.flag = torch.zeros((), dtype=torch.bool)

    def last_skip_flag(self) -> torch.Tensor:
        return self.flag


# ---------------------------------------------------------------- the oracle over real scaler runs
def _train_step(model, opt, scaler, x) -> None:
    scaler.scale(model(x).square().mean()).backward()
    scaler.clip_grad_norm_(opt, max_norm=1e9)  # the norm the norm-spike policy reads
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _check_against_the_oracle(scaler, lr_kind: str, fused: bool, injected: str) -> None:
    """A real run with ``injected`` gradients on INJECTED: each step's rates equal the oracle's (the
    same scheduler stepped when the parameters moved), and a plain scheduler's differ somewhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = _optimizer(lr_kind, [model[0].weight, model[1].weight], fused)
    sched = tritonscale.SkipAwareLR(_warmup_cosine(opt), scaler, total_steps=STEPS)
    oracle_opt, naive_opt = _optimizer(lr_kind, fused=fused), _optimizer(lr_kind, fused=fused)
    oracle, naive = _warmup_cosine(oracle_opt), _warmup_cosine(naive_opt)
    GradInjector(model[0].weight, injected)
    truth, x = Truth(model), torch.randn(5, 4)
    naive_diverged = False
    for _ in range(STEPS):
        truth.before()
        _train_step(model, opt, scaler, x)
        truth.after()
        sched.step()
        oracle_opt.step(), naive_opt.step()  # no gradients: only marks the order torch's scheduler checks
        naive.step()  # a plain scheduler, stepped every step: what main's loop does without the recipe
        if not truth.skipped[-1]:
            oracle.step()
        assert _same(_lrs(opt), _lrs(oracle_opt))
        naive_diverged |= not _same(_lrs(naive_opt), _lrs(oracle_opt))
    assert truth.skipped == [s in INJECTED for s in range(STEPS)]  # the skips happened
    assert naive_diverged  # so this test tells a skip-aware schedule from a plain one
    assert int(sched.applied_steps) == STEPS - len(INJECTED)


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("case", SKIP_CASES)
def test_real_runs_match_torch_stepped_on_applied_steps(case, lr_kind):
    scaler = tritonscale.GradScaler("cpu", **scaler_kwargs(case))
    _check_against_the_oracle(scaler, lr_kind, case == "fused_adamw", injected_kind(case))


def test_a_disabled_scaler_whose_clip_found_inf_holds_the_schedule():
    # A bf16 loop: no loss scale, but the fused clip's inf/NaN check still skips the step.
    _check_against_the_oracle(tritonscale.GradScaler("cpu", enabled=False), "tensor", False, "inf")


def test_zero_host_reads_with_a_fused_adamw_tensor_lr(forbid_host_reads):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = _optimizer("tensor", [model.weight, model.bias], fused=True)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**10)
    sched = tritonscale.SkipAwareLR(_warmup_cosine(opt), scaler, total_steps=STEPS)
    oracle_opt = _optimizer("tensor", fused=True)
    oracle = _warmup_cosine(oracle_opt)
    GradInjector(model.weight, "inf")
    truth, x, seen = Truth(model), torch.randn(5, 4), []
    for _ in range(STEPS):
        truth.before()
        with forbid_host_reads.armed():
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            seen.append(sched.get_last_lr())
            opt.zero_grad()
        truth.after()
    for skipped, lrs in zip(truth.skipped, seen):  # kept values are each step's, not views
        oracle_opt.step()  # no gradients: only marks the order torch's scheduler checks
        if not skipped:
            oracle.step()
        assert _same(lrs, _lrs(oracle_opt))
    assert truth.skipped == [s in INJECTED for s in range(STEPS)]


# ------------------------------------------------------------------------- property: any pattern
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_skip_pattern_and_arguments_match_torch(data):
    name = data.draw(st.sampled_from(sorted(SCHEDULES)), label="schedule")
    strategy, build = SCHEDULES[name]
    kwargs = data.draw(strategy, label="arguments")
    lr_kind = data.draw(st.sampled_from(["float", "tensor"]), label="lr")
    skips = data.draw(st.lists(st.booleans(), min_size=1, max_size=12), label="skips")
    ours_opt, oracle_opt = _optimizer(lr_kind), _optimizer(lr_kind)
    scaler = FlagScaler()
    sched = tritonscale.SkipAwareLR(build(ours_opt, **kwargs), scaler, total_steps=len(skips))
    oracle = build(oracle_opt, **kwargs)
    assert _same(_lrs(ours_opt), _lrs(oracle_opt))
    for skip in skips:
        ours_opt.step(), oracle_opt.step()  # no gradients: only marks the order torch's scheduler checks
        scaler.flag = torch.tensor(skip)
        sched.step()
        if not skip:
            oracle.step()
        assert _same(_lrs(ours_opt), _lrs(oracle_opt))
    assert int(sched.applied_steps) == skips.count(False)


# ----------------------------------------------------------------------------- state and resume
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_a_mid_run_checkpoint_resumes_to_the_same_rates(lr_kind):
    skips = [False, True, False, False, True, False, False, True, False, False]
    runs = []
    for cut in (None, 4):
        opt, scaler = _optimizer(lr_kind), FlagScaler()
        sched = tritonscale.SkipAwareLR(_warmup_cosine(opt), scaler, total_steps=len(skips))
        rates = []
        for i, skip in enumerate(skips):
            if i == cut:  # a fresh optimizer and scheduler, resumed from the checkpoint
                state = sched.state_dict()
                opt = _optimizer(lr_kind)
                sched = tritonscale.SkipAwareLR(_warmup_cosine(opt), scaler, total_steps=len(skips))
                sched.load_state_dict(state)
            scaler.flag = torch.tensor(skip)
            sched.step()
            rates.append(sched.get_last_lr())
        runs.append(rates)
    assert all(_same(a, b) for a, b in zip(*runs))


def test_state_dict_and_applied_steps_are_values_not_views():
    opt, scaler = _optimizer("tensor"), FlagScaler()
    sched = tritonscale.SkipAwareLR(S.StepLR(opt, 1, 0.5), scaler, total_steps=3)
    state, count, last = sched.state_dict(), sched.applied_steps, sched.get_last_lr()
    sched.step()
    assert int(state["applied_steps"]) == 0 and int(count) == 0
    assert _same(last, [torch.tensor(lr) for lr in LRS])
    assert int(sched.applied_steps) == 1


# -------------------------------------------------------------------------------------- bad input
def _snapshot(opt, sched) -> tuple:
    return _lrs(opt), {k: v for k, v in sched.state_dict().items() if k != "_last_lr"}


def _unsupported(opt):
    class MyStepLR(S.StepLR):
        pass

    return {
        "plateau": S.ReduceLROnPlateau(opt),
        "cyclic": S.CyclicLR(opt, 1e-3, 1e-2, cycle_momentum=False),
        "chained": S.ChainedScheduler([S.StepLR(opt, 2), S.ExponentialLR(opt, 0.9)]),
        "subclass": MyStepLR(opt, 2),
        "warm_restarts": S.CosineAnnealingWarmRestarts(opt, 3),
    }


@pytest.mark.parametrize("name", ["plateau", "cyclic", "chained", "subclass", "warm_restarts"])
def test_unsupported_schedulers_are_refused_with_the_recipe(name):
    opt = _optimizer("tensor")
    sched = _unsupported(opt)[name]
    before = _lrs(opt)
    with pytest.raises(TypeError, match=r"wraps torch's LambdaLR.*scaler\.last_step_skipped\(\)"):
        tritonscale.SkipAwareLR(sched, FlagScaler(), total_steps=4)
    assert _same(_lrs(opt), before)


def _sequential_with_cyclic(opt):
    return S.SequentialLR(opt, [S.StepLR(opt, 2), S.CyclicLR(opt, 1e-3, 0.1)], milestones=[2])


def _stepped(sched):
    sched.optimizer.step()
    sched.step()
    return sched


# id -> (build the scheduler from the optimizer, SkipAwareLR's keyword arguments, the error's words)
REFUSALS = {
    "onecycle_cycling_momentum": (lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=5), {}, "cycle_momentum=False"),
    "no_total_steps": (lambda o: S.StepLR(o, 2), {}, "needs total_steps="),
    "zero_total_steps": (lambda o: S.StepLR(o, 2), {"total_steps": 0}, "positive int"),
    "float_total_steps": (lambda o: S.StepLR(o, 2), {"total_steps": 2.0}, "positive int"),
    "past_onecycle_end": (
        lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=5, cycle_momentum=False),
        {"total_steps": 6},
        "past",
    ),
    "already_stepped": (lambda o: _stepped(S.StepLR(o, 2)), {"total_steps": 4}, "already stepped"),
    "sequential_with_cyclic": (_sequential_with_cyclic, {"total_steps": 4}, "CyclicLR"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_bad_arguments_are_refused_and_change_nothing(name):
    opt = _optimizer("tensor")
    make, kwargs, message = REFUSALS[name]
    sched = make(opt)
    before = _snapshot(opt, sched)
    with pytest.raises((TypeError, ValueError), match=message):
        tritonscale.SkipAwareLR(sched, FlagScaler(), **kwargs)
    after = _snapshot(opt, sched)
    assert _same(after[0], before[0]) and str(after[1]) == str(before[1])


def test_a_scaler_without_a_skip_flag_is_refused():
    opt = _optimizer("tensor")
    with pytest.raises(TypeError, match="tritonscale.GradScaler"):
        tritonscale.SkipAwareLR(S.StepLR(opt, 2), torch.amp.GradScaler("cpu"), total_steps=4)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"applied_steps": 1}, "keys"),
        ({"applied_steps": 3, "calls": 2}, "applied_steps"),
        ({"applied_steps": 1, "calls": 9}, "total_steps"),
        ({"applied_steps": torch.tensor(1.0), "calls": 2}, "integer"),
        ({"applied_steps": torch.tensor(True), "calls": 2}, "integer"),
        ({"applied_steps": -1, "calls": 2}, "applied_steps"),
    ],
    ids=["missing_key", "more_applied_than_calls", "past_total_steps", "float_count", "bool_count", "negative"],
)
def test_a_bad_state_dict_is_refused_and_changes_nothing(state, message):
    opt, scaler = _optimizer("tensor"), FlagScaler()
    sched = tritonscale.SkipAwareLR(S.StepLR(opt, 1, 0.5), scaler, total_steps=4)
    sched.step()
    before_state, before_lrs = sched.state_dict(), _lrs(opt)
    with pytest.raises(ValueError, match=message):
        sched.load_state_dict(state)
    assert _same(_lrs(opt), before_lrs) and str(sched.state_dict()) == str(before_state)


def test_stepping_past_total_steps_raises_and_changes_nothing():
    opt, scaler = _optimizer("float"), FlagScaler()
    sched = tritonscale.SkipAwareLR(S.StepLR(opt, 1, 0.5), scaler, total_steps=2)
    sched.step(), sched.step()
    before_state, before_lrs = str(sched.state_dict()), _lrs(opt)
    with pytest.raises(RuntimeError, match="larger total_steps"):
        sched.step()
    assert _same(_lrs(opt), before_lrs) and str(sched.state_dict()) == before_state


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_the_wrapped_scheduler_stepped_by_hand_is_refused_and_the_named_fix_works(lr_kind):
    """The newcomer's loop: SkipAwareLR added, the old ``scheduler.step()`` left in. torch's own step
    rewrites the rate by its chain ([0.002855, ...] against [0.002927, ...] in the report); the next
    SkipAwareLR.step() refuses, naming the call to remove, and changes nothing. Following the fix (the
    call removed, step() called again for that iteration) training goes on at the rate of a torch
    scheduler stepped only on the applied steps: the oracle, on a twin optimizer."""
    opt, scaler = _optimizer(lr_kind), FlagScaler()
    inner = S.StepLR(opt, 1, 0.5)
    sched = tritonscale.SkipAwareLR(inner, scaler, total_steps=6)
    twin = _optimizer(lr_kind)
    oracle = S.StepLR(twin, 1, 0.5)
    skips = [False, True, True, False, True, False]  # iteration 2 (skipped) has the hand step
    for i, skipped in enumerate(skips):
        scaler.flag.fill_(skipped)
        if not skipped:
            oracle.step()
        if i == 2:
            inner.step()  # the call left in the loop
            before_state, before_lrs = str(sched.state_dict()), _lrs(opt)
            with pytest.raises(RuntimeError, match=r"StepLR was stepped by hand .*remove the `StepLR.step\(\)` call"):
                sched.step()
            assert _same(_lrs(opt), before_lrs) and str(sched.state_dict()) == before_state  # changed nothing
            assert not _same(_lrs(opt), _lrs(twin))  # the hand step's rate, until the fix
        sched.step()  # the fix: the call removed, SkipAwareLR.step() called (again, at iteration 2)
        assert _same(_lrs(opt), _lrs(twin)), (i, _lrs(opt), _lrs(twin))
    assert int(sched.applied_steps) == skips.count(False) and sched.state_dict()["calls"] == len(skips)


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_a_hand_step_left_in_the_loop_is_refused_at_every_iteration(lr_kind):
    # The refusal lets the next step() go on only where the wrapped scheduler stayed where it saw it.
    opt, scaler = _optimizer(lr_kind), FlagScaler()
    inner = S.StepLR(opt, 1, 0.5)
    sched = tritonscale.SkipAwareLR(inner, scaler, total_steps=6)
    for _ in range(3):
        inner.step()
        before_state = str(sched.state_dict())
        with pytest.raises(RuntimeError, match="stepped by hand"):
            sched.step()
        assert str(sched.state_dict()) == before_state


def test_changed_param_groups_are_refused():
    opt, scaler = _optimizer("tensor"), FlagScaler()
    sched = tritonscale.SkipAwareLR(S.StepLR(opt, 1, 0.5), scaler, total_steps=4)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": torch.tensor(0.1)})
    with pytest.raises(RuntimeError, match="param groups"):
        sched.step()


def test_the_docstring_example_runs():
    doc = inspect.cleandoc(tritonscale.SkipAwareLR.__doc__)
    example = inspect.cleandoc(doc.split("Example::", 1)[1])
    namespace = {"torch": torch, "tritonscale": tritonscale}
    exec(example, namespace)
    sched, scaler = namespace["sched"], namespace["scaler"]
    applied = int(sched.applied_steps)
    assert applied == 4 - int(scaler.stats()["skipped_steps"])
    twin = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(1e-3), fused=True)
    oracle = S.StepLR(twin, step_size=2)
    for _ in range(applied):
        twin.step()
        oracle.step()
    assert _same(sched.get_last_lr(), _lrs(twin))


# -------------------------------------------------------------- one rank schedules its tensor lr
def _one_rank_schedules(rank: int, world: int) -> dict:
    """Two gloo ranks with process_group=, ZeRO partitions of fused AdamW with ``lr=torch.tensor(0.05)``;
    both build the same StepLR, rank 0 alone wraps it in SkipAwareLR and steps it. Each step's
    outcome (None, or the RankMismatchError), whether the refused step changed a parameter, and
    the lr; then the same on the GPU paths (no host read: the step is skipped, the next read raises),
    and a control where both ranks wrap and step it."""
    import torch.distributed as dist
    from support.host_reads import HostReadGuard

    import tritonscale.host_reads

    out: dict = {}
    guard = HostReadGuard()
    for path in ("both", "cpu", "gpu"):
        if path == "gpu":
            tritonscale.host_reads.are_free = lambda device: False
        params = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(4) if i % 2 == rank]
        opt = torch.optim.AdamW(params, lr=torch.tensor(0.05), fused=True)
        scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, backend="torch", process_group=dist.group.WORLD)
        sched = S.StepLR(opt, step_size=1, gamma=0.5)
        wraps = rank == 0 or path == "both"
        sched = tritonscale.SkipAwareLR(sched, scaler, total_steps=3) if wraps else sched
        errors = []
        for step in range(3):
            scaler.scale(torch.ones(()))
            for p in params:
                p.grad = torch.full_like(p, 2.0**8 * (step + 1))
            before = [p.detach().clone() for p in params]
            try:
                with guard.armed() if path == "gpu" else contextlib.nullcontext():
                    scaler.clip_grad_norm_(opt, max_norm=1.0)
                    scaler.step(opt)
                    scaler.update()
                if path == "gpu":
                    scaler.get_scale()  # the first host read: raises a flagged mismatch
                errors.append(None)
            except tritonscale.RankMismatchError as error:
                errors.append(str(error))
                out[path, "untouched"] = all(torch.equal(a, p) for a, p in zip(before, params))
                break
            if wraps:
                sched.step()
        out[path] = errors
        out[path, "lr"] = float(opt.param_groups[0]["lr"])
    return out


def test_a_tensor_lr_scheduled_on_one_rank_raises_on_every_rank_and_changes_nothing():
    """Before: rank 0 trained at 0.00625 and rank 1 at 0.05 after 3 steps, and nothing raised (the
    row counted a tensor lr by dtype and shape only)."""
    from support.multiprocess import run_ranks

    for rank, out in enumerate(run_ranks(_one_rank_schedules, 2)):
        assert out["both"] == [None] * 3 and out["both", "lr"] == pytest.approx(0.00625), f"rank {rank}: {out}"
        for path in ("cpu", "gpu"):
            errors = out[path]
            assert errors[0] is None, f"rank {rank}, {path}: the agreeing first step raised {errors[0]}"
            assert len(errors) == 2 and errors[1] is not None, f"rank {rank}, {path}: went on at lr {out[path, 'lr']}"
            assert "the optimizer's tensor-valued settings" in errors[1], errors[1]
            assert out[path, "untouched"], f"rank {rank}, {path}: the refused step changed a parameter"
