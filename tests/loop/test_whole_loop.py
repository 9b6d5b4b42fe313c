"""A whole training loop on the GPU paths reads nothing on the host: forward, backward, clip, step,
update, the skip-aware schedule, the logger and a spike policy, with overflows and norm spikes.

The oracle is the same loop written the way a loop reads the host today: torch's own scheduler
stepped only when ``scaler.last_step_skipped()`` says the step was applied (Megatron's rule), and
``stats()`` read at once every step. The two must agree bit for bit: parameters, every step's
learning rate, every logged value; and the skipped steps are exactly the poisoned ones (the truth:
whether the parameters moved).
"""

from __future__ import annotations

import torch
from integrations.skip_truth import GradInjector, Truth
from oracles.stats import exact, read_at_once
from torch.optim import lr_scheduler

import tritonscale

STEPS = 12
OVERFLOWS, SPIKES = (2, 3, 9), (6,)  # backward passes given an inf, and a norm spike


def warmup_cosine(optimizer):
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    return lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])


def build():
    """A fused AdamW with a tensor lr (so the schedule is set on the device), hysteresis, OLMo-core's
    z-score skip and ZClip's clip, poisoned gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    policy = tritonscale.LossScalePolicy(
        hysteresis=2,
        growth_interval=4,
        skip_norm_sigma=6,
        skip_norm_window=8,
        skip_norm_min_steps=3,
        clip_norm_z=2.5,
        clip_norm_warmup_steps=3,
    )
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**10, policy=policy)
    GradInjector(model[0].weight, "inf", at=OVERFLOWS)
    GradInjector(model[2].weight, "spike", at=SPIKES)
    batches = torch.randn(STEPS, 32, 8, generator=torch.Generator().manual_seed(1))
    return model, optimizer, scaler, batches


def one_step(model, optimizer, scaler, batch) -> None:
    optimizer.zero_grad()
    scaler.scale(model(batch).square().mean()).backward()
    scaler.clip_grad_norm_(optimizer, 1.0)
    scaler.step(optimizer)
    scaler.update()


def device_loop(guard):
    """The loop with no host read: SkipAwareLR and StepLog, the guard armed around every line."""
    model, optimizer, scaler, batches = build()
    schedule = tritonscale.SkipAwareLR(warmup_cosine(optimizer), scaler, total_steps=STEPS)
    log = tritonscale.StepLog(delay=2)
    lrs, rows, truth = [], [], Truth(model)
    for step in range(STEPS):
        truth.before()
        with guard.armed():
            one_step(model, optimizer, scaler, batches[step])
            schedule.step()
            log.record(scaler, step)
            rows += log.ready()
            lrs.append(schedule.get_last_lr()[0])
        truth.after()
    rows += log.flush()
    return model, [lr.item() for lr in lrs], rows, truth.skipped


def host_loop():
    """Today's recipe: one host read per step for the scheduler, one for the logger."""
    model, optimizer, scaler, batches = build()
    scheduler = warmup_cosine(optimizer)
    lrs, rows = [], []
    for step in range(STEPS):
        one_step(model, optimizer, scaler, batches[step])
        if not scaler.last_step_skipped():
            scheduler.step()
        rows.append((step, read_at_once(scaler)))
        lrs.append(optimizer.param_groups[0]["lr"].item())
    return model, lrs, rows


def test_a_whole_loop_reads_nothing_on_the_host_and_matches_the_host_recipe(forbid_host_reads):
    model, lrs, rows, skipped = device_loop(forbid_host_reads)
    oracle_model, oracle_lrs, oracle_rows = host_loop()
    assert skipped == [step in OVERFLOWS + SPIKES for step in range(STEPS)]
    assert lrs == oracle_lrs
    assert exact(rows) == exact(oracle_rows)
    for ours, theirs in zip(model.parameters(), oracle_model.parameters()):
        assert torch.equal(ours, theirs)
    # The run exercised what it claims: a hysteresis skip that kept the scale, then a backoff.
    scales = [values["scale"] for _, values in oracle_rows]
    assert scales[OVERFLOWS[0]] == scales[0] and scales[OVERFLOWS[1]] < scales[OVERFLOWS[0]]
