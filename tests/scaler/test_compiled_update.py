"""update() traced by a compiled caller: one graph, no recompilation once warm, eager's results.

The oracle is the same run in eager mode. The run lets the scale grow (growth_interval=2) and
feeds two overflows, so that the rule backs off, counts skips and grows again while the compiled
update is warm: a Python number of the scale state that Dynamo specialised on would recompile
(``error_on_recompile``) or freeze (the stats would drift from eager's).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.compiled_placements import placed
from torch._dynamo.testing import CompileCounterWithBackend

from tritonscale import GradScaler

STEPS = 12
OVERFLOWS = (4, 8)
WARM = 3  # updates before which a recompilation is allowed


def training_run(
    optimizer_kind: str,
    compiled: bool,
    fullgraph: bool = True,
    where: str = "closure",
    dynamic: bool | None = None,
    **knobs,
) -> dict:
    """STEPS scaled steps whose update() is compiled (or eager), with the scaler held as ``where``
    says (compiled_placements.py); ``iterations``: the count of ended iterations the scaler keeps
    for the rank checks (rank_validation.RankChecks.iteration)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    if optimizer_kind == "fused":
        optimizer = torch.optim.AdamW(params, lr=0.01, fused=True)
    else:
        optimizer = torch.optim.SGD(params, lr=0.01)
    scaler = GradScaler("cpu", backend="torch", growth_interval=2, **knobs)
    counter = CompileCounterWithBackend("aot_eager")
    update = placed(where, scaler, lambda s: s.update())
    update = torch.compile(update, backend=counter, fullgraph=fullgraph, dynamic=dynamic) if compiled else update
    stats = []
    for i in range(STEPS):
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        if i in OVERFLOWS:
            params[0].grad[0, 0] = math.inf
        scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        with torch._dynamo.config.patch(error_on_recompile=compiled and i >= WARM):
            update()
        stats.append({name: value.clone() for name, value in scaler.stats().items()})
        optimizer.zero_grad()
    params = [p.detach().clone() for p in params]
    return {"stats": stats, "params": params, "graphs": counter.frame_count, "iterations": int(scaler._ranks.iteration)}


def assert_same_run(compiled: dict, eager: dict) -> None:
    skipped = [int(s["skipped"]) for s in eager["stats"]]
    assert [i for i, s in enumerate(skipped) if s] == list(OVERFLOWS)
    scales = [float(s["scale"]) for s in eager["stats"]]
    assert max(scales) > scales[0] and min(scales[OVERFLOWS[0] :]) < max(scales)  # grew and backed off
    for ours, reference in zip(compiled["stats"], eager["stats"]):
        assert ours.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=0, equal_nan=True, msg=name)
    for ours, reference in zip(compiled["params"], eager["params"]):
        assert torch.equal(ours, reference)
    assert compiled["iterations"] == eager["iterations"] == STEPS  # the rank checks' count still counts


@pytest.mark.parametrize("optimizer_kind", ["fused", "plain"])
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_update_compiles_whole_without_recompiling(request, optimizer_kind, paths):
    if paths == "gpu":  # the paths a GPU takes: no host reads, the rule as device ops
        request.getfixturevalue("forbid_host_reads")
    compiled = training_run(optimizer_kind, compiled=True)
    assert_same_run(compiled, training_run(optimizer_kind, compiled=False))
    # fullgraph=True held (a break raises); at most one recompilation, before WARM.
    assert 1 <= compiled["graphs"] <= 2


#: Knobs whose rule rounds float knobs to float32 in the graph, at values that never skip here.
NORM_KNOBS = {"skip_norm_above": 1e30, "skip_norm_factor": 1e6}


@pytest.mark.parametrize(
    "where, dynamic, knobs",
    [("global", None, {}), ("attribute", True, NORM_KNOBS)],
    ids=["global", "attribute-dynamic"],
)
def test_update_does_not_recompile_wherever_the_scaler_lives(forbid_host_reads, where, dynamic, knobs):
    """A scaler that is a module global or a module's attribute (the closure is above): once
    warm, no recompilation (error_on_recompile) while the scale grows, backs off and skips, and
    the iteration count of the rank checks advances in the graph. A Python int counter there was
    a guarded constant: a recompilation per update(), FailOnRecompileLimitHit at the 8th. With
    dynamic=True the policy's float knobs are symbolic floats, which the rule must not round on
    the host (policy/forms.as_float32)."""
    compiled = training_run("fused", compiled=True, where=where, dynamic=dynamic, **knobs)
    assert_same_run(compiled, training_run("fused", compiled=False, **knobs))
    assert 1 <= compiled["graphs"] <= 2 + (dynamic is True)


def test_a_policy_that_reads_the_host_runs_eagerly_inside_a_compiled_caller():
    """max_consecutive_skips reads one device value per update: that update stays eager (a graph
    break around it) and the run is eager's. With fullgraph=True the compile says where it broke."""
    knobs = {"max_consecutive_skips": 5}
    assert_same_run(
        training_run("fused", compiled=True, fullgraph=False, **knobs), training_run("fused", False, **knobs)
    )
    with pytest.raises(Exception, match="tritonscale runs the scaler's calls eagerly"):
        training_run("fused", compiled=True, fullgraph=True, **knobs)


def test_update_with_a_new_scale_under_compile():
    """``update(new_scale)`` with a tensor is traced (fullgraph) and sets each value it is given;
    with a Python number (checked on the host, and a number Dynamo would specialise on) it runs
    eagerly inside the compiled caller, and fullgraph=True names the reason."""
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend="torch")
    traced = torch.compile(lambda value: scaler.update(value), backend="aot_eager", fullgraph=True)
    mixed = torch.compile(lambda value: scaler.update(value), backend="aot_eager")
    for i, value in enumerate((2.0, 4.0, 8.0, 16.0, 0.5, 64.0)):
        scaler.scale(params[0].sum()).backward()
        scaler.step(optimizer)
        # A tensor traced: no recompilation for a new value once warm (the iteration counter turns
        # dynamic at the second call; a float argument is the caller's own guard).
        with torch._dynamo.config.patch(error_on_recompile=i == 5):
            (traced if i % 2 else mixed)(torch.tensor(value) if i % 2 else value)
        assert scaler.get_scale() == value
    scaler.scale(params[0].sum()).backward()
    scaler.step(optimizer)
    with pytest.raises(Exception, match="tritonscale runs the scaler's calls eagerly"):
        traced(32.0)
    assert scaler.get_scale() == 64.0
