"""Where the rule runs (``PolicyRunner``): one kernel wherever it launches, the tensor ops
elsewhere (the CPU with backend "auto", under Dynamo, on request) -- and the same state whichever.

On the CPU the kernel runs with the Triton backend (through the interpreter). The oracle is the
same runner on the rule's tensor ops.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.scale_rules import Loop, call_outcome

import tritonscale.policy.runner as runner_module
from tritonscale import GradScaler, LossScalePolicy, presets
from tritonscale.kernels import policy_update
from tritonscale.policy.runner import IterationOutcome, PolicyRunner
from tritonscale.policy.state import HostState

CPU = torch.device("cpu")


def bits(t: torch.Tensor) -> list:
    flat = t.detach().reshape(-1)
    fmt = {torch.float32: "f", torch.float64: "d"}.get(flat.dtype)
    return [struct.pack(fmt, v) for v in flat.tolist()] if fmt else flat.tolist()


def launches(monkeypatch) -> list:
    """Record each call of the policy kernel's launcher (and run it)."""
    calls, original = [], policy_update.update_policy_state_
    monkeypatch.setattr(
        "tritonscale.policy.runner.update_policy_state_", lambda *a, **k: (calls.append(k), original(*a, **k))[1]
    )
    return calls


@pytest.mark.parametrize(
    ("compile_policy", "backend", "compiling", "expected"),
    [
        (None, "triton", False, True),
        (False, "triton", False, True),
        (True, "triton", False, False),  # asked for the compiled tensor ops
        (None, "auto", False, False),  # the interpreter only where the scaler's kernels are Triton's
        (None, "torch", False, False),
        (None, "triton", True, False),  # Dynamo traces: the tensor ops, which inductor fuses
    ],
)
def test_the_kernel_runs_where_it_launches(monkeypatch, compile_policy, backend, compiling, expected):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    assert PolicyRunner(compile_policy, backend).uses_kernel(CPU) is expected


@pytest.mark.parametrize("optimizers", [1, 2, 5])  # 5: more than the kernel reads by pointer
@pytest.mark.parametrize("count_only", [False, True])
def test_the_runner_on_the_kernel_equals_the_tensor_ops(monkeypatch, optimizers, count_only):
    policy = LossScalePolicy(hysteresis=2, skip_norm_factor=2.0, skip_norm_sigma=2.0, skip_norm_window=3,
                             clip_norm_z=1.5, clip_norm_warmup_steps=2, growth_interval=2).validate()  # fmt: skip
    states = [HostState.initial(2.0**16, policy).to_device(CPU) for _ in range(2)]
    runners = [PolicyRunner(False, "triton") for _ in range(2)]
    runners[1].uses_kernel = lambda device: False  # the other executor: the rule's tensor ops
    calls = launches(monkeypatch)
    for step in range(8):
        found = [torch.tensor(float(step % 3 == 1 and k == optimizers - 1)) for k in range(optimizers)]
        skips = [f.clone() for f in found] if step % 4 != 3 else []  # step 3, 7: unscale_ only
        outcome = IterationOutcome(found, skips, [torch.tensor(1.0 + step % 3)])
        results = []
        for runner, state in zip(runners, states):
            run = runner.count_only_ if count_only else runner.update_
            results.append(run(policy, state, outcome))
        for name in ("scale", "growth_tracker", "counters", "norm_stats", "spike_stats"):
            assert bits(getattr(states[0], name)) == bits(getattr(states[1], name)), f"step {step}: {name}"
        assert bits(results[0][0]) == bits(results[1][0]), f"step {step}: found_inf"
    assert len(calls) == 8  # the kernel's side launched every time, the tensor ops' side never


def test_a_raise_on_the_kernel_path_changes_nothing(monkeypatch, forbid_host_reads):
    scaler = GradScaler("cpu", init_scale=1.0, policy=presets.deepspeed(hysteresis=1), backend="triton")
    calls = launches(monkeypatch)
    loop = Loop(scaler, "triton")
    loop.step(False)
    before = scaler.state_dict()
    with pytest.raises(RuntimeError, match="already at min_scale=1"):
        loop.step(True)
    assert scaler.state_dict() == before
    assert calls and all(call["checks"] for call in calls)


def test_the_kernel_path_reads_nothing_on_the_host(monkeypatch, forbid_host_reads):
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="triton", hysteresis=2, skip_norm_sigma=2.0)
    calls = launches(monkeypatch)
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    for overflow in (False, True, False, True, True, False):
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        param.grad[3] = float("inf") if overflow else 1.0
        scaler.clip_grad_norm_(optimizer, 1e6)
        scaler.step(optimizer)  # a plain SGD reads its skip flag: the step protocol's, not the rule's
        with forbid_host_reads.armed():
            scaler.update()
    assert len(calls) == 6


STEP = st.tuples(st.just("step"), st.sampled_from([True, True, False]))
OPS = st.lists(st.one_of(STEP, STEP, st.tuples(st.just("new_scale"), st.sampled_from([1.0, 8.0, 2.0**-12]))),
               min_size=1, max_size=12)  # fmt: skip
POLICIES = st.sampled_from([
    presets.deepspeed(4, 2, 2, min_loss_scale=1.0).policy,
    presets.fairseq(1.0, 3, 0.3, min_loss_scale=2.0**-3).policy,
    LossScalePolicy(growth_interval=2, min_scale=2.0**-2, on_min_scale="warn", max_consecutive_skips=3),
    LossScalePolicy(growth_interval=2, min_scale=2.0**-2, on_min_scale="raise", max_consecutive_skips=2),
])  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=POLICIES, ops=OPS)
def test_the_kernels_checks_fire_where_the_tensor_ops_checks_do(monkeypatch, policy, ops):
    host, device = (GradScaler("cpu", init_scale=4.0, policy=policy, backend="triton") for _ in range(2))
    host._runner.uses_kernel = lambda device: False  # the rule's tensor ops: the oracle
    loops = Loop(host, "triton"), Loop(device, "triton")
    for i, (kind, value) in enumerate(ops):
        for scaler, loop, free in ((host, loops[0], True), (device, loops[1], False)):
            if kind == "step":
                act = lambda lp=loop, v=value: lp.step(v)  # noqa: E731
            else:
                act = lambda s=scaler, v=value: s.update(new_scale=v)  # noqa: E731
            if free:
                expected = call_outcome(act)
            else:
                seen = call_outcome(act)
        assert seen == expected, f"op {i} {kind} {value}"
        assert device.state_dict() == host.state_dict(), f"op {i}"
        if expected[0] is not None:
            return


@pytest.mark.parametrize(
    ("compile_policy", "kernels_launch", "compiled"),
    [(None, True, False), (None, False, True), (True, True, True), (False, False, False)],
)
def test_the_rule_is_compiled_on_cuda_only_where_the_kernels_do_not_launch(
    monkeypatch, compile_policy, kernels_launch, compiled
):
    """compile_policy=None on CUDA: the tensor-op rule (a step's skip nothing else decided) is
    compiled only where the kernels cannot launch (backend="torch"); with the kernels it stays
    eager, so no Dynamo call runs per step and none compiles inside a CUDA-graph capture."""
    monkeypatch.setattr(runner_module, "kernel_runs", lambda device, backend: kernels_launch)
    assert PolicyRunner(compile_policy)._compiles(torch.device("cuda")) is compiled
    assert PolicyRunner(compile_policy)._compiles(torch.device("cpu")) is bool(compile_policy)
