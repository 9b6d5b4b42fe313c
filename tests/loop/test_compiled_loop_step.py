"""The post-backward step with the loop's calls, compiled, advances nothing in Python (issue 41, goal 3).

What a CUDA graph replays is what a compiled graph runs: if any state of the step lived in Python
(a counter, a cached flag, a number Dynamo specialised on), a compiled step would either recompile
when it changed or freeze it. Here the traceable parts are compiled with ``fullgraph=True``
(``clip_grad_norm_`` folded into fused AdamW; ``update()`` then ``SkipAwareLR.step()`` with a tensor
lr) on the paths a GPU takes, after WARM eager steps, each compiled once with ``error_on_recompile`` on: a
Python counter of the step would recompile at its second call (a guard on its value). Over overflows
(hysteresis: the first of two skips without a backoff), growth and a norm-spike skip, and every
value is the eager run's, bit for bit (``aot_eager`` runs eager's ops): parameters, moments, lrs,
SkipAwareLR's counts and every StepLog row. ``scale()`` and ``step()`` run eagerly between them, by
design (``scaler/compile_boundary.py``: traced, a fused optimizer ignores found_inf), as torch's
GradScaler does under Dynamo; the CUDA graph captures them too (tests/test_gpu.py).
"""

from __future__ import annotations

import math

import torch
from support.compiled_placements import needs_compiled_clip
from torch._dynamo.testing import CompileCounterWithBackend

import tritonscale

STEPS = 11
WARM = 2  # eager warm-up steps (the norm history's owner is set at the first), as before a capture
OVERFLOWS = (3, 4)  # hysteresis=2: the first skips keeping the scale, the second backs off
SPIKE = 8  # the targets 1000 times larger: a finite norm spike, skipped by skip_norm_factor


def _run(compiled: bool) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    scaler = tritonscale.GradScaler(
        "cpu", init_scale=2.0**8, growth_interval=2, hysteresis=2, skip_norm_factor=5.0, norm_warmup_steps=2,
        backend="torch", compile_policy=False,
    )  # fmt: skip
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 2, 0.7), scaler, total_steps=STEPS)
    log = tritonscale.StepLog(delay=1)

    def clip():
        return scaler.clip_grad_norm_(opt, 1.0)

    def finish():
        scaler.update()
        sched.step()

    counter = CompileCounterWithBackend("aot_eager")
    compiled_clip = torch.compile(clip, backend=counter, fullgraph=True) if compiled else clip
    compiled_finish = torch.compile(finish, backend=counter, fullgraph=True) if compiled else finish
    g = torch.Generator().manual_seed(1)
    lrs, rows = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        x[0, 0] = math.inf if step in OVERFLOWS else x[0, 0]
        y = y * 1000.0 if step == SPIKE else y
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        warm = step >= WARM
        with torch._dynamo.config.patch(error_on_recompile=True):
            (compiled_clip if warm else clip)()
            scaler.step(opt)
            (compiled_finish if warm else finish)()
        log.record(scaler, step)
        rows += log.ready()
        lrs.append(opt.param_groups[0]["lr"].clone())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": [t.clone() for state in opt.state.values() for t in state.values()],
        "lrs": torch.stack(lrs),
        "rows": rows + log.flush(),
        "sched": sched.state_dict(),
        "graphs": counter.frame_count,
    }


@needs_compiled_clip
def test_the_compiled_step_recompiles_nothing_and_equals_eager(forbid_host_reads):
    eager, compiled = _run(False), _run(True)
    skipped = [step for step, values in eager["rows"] if values["skipped"]]
    scales = [values["scale"] for _, values in eager["rows"]]
    assert skipped == [*OVERFLOWS, SPIKE]  # both overflows and the spike were skipped ...
    assert scales[OVERFLOWS[0]] == scales[OVERFLOWS[0] - 1] and scales[OVERFLOWS[1]] < scales[OVERFLOWS[0]]
    assert max(scales[: OVERFLOWS[0]]) > scales[0]  # ... the scale grew, then backed off at the second
    assert compiled["graphs"] == 2  # each function compiled once (a recompilation would have raised)
    for a, b in zip(compiled["params"] + compiled["moments"], eager["params"] + eager["moments"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(compiled["lrs"], eager["lrs"]) and len(set(eager["lrs"].tolist())) > 2
    assert str(compiled["rows"]) == str(eager["rows"])  # every logged row, NaN norms included
    assert compiled["sched"]["calls"] == eager["sched"]["calls"] == STEPS
    assert torch.equal(compiled["sched"]["applied_steps"], eager["sched"]["applied_steps"])
