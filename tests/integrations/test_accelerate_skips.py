"""Accelerate and the HF Trainer report skips exactly after ``install``: their own signal against the truth.

Each case of ``skip_truth.SKIP_CASES`` runs for real (8 steps, the gradient poisoned on two
backward passes): plain SGD, torch's fused AdamW (it skips inside its kernel, so Accelerate alone
sees ``step`` called and reports no skip: huggingface/accelerate#4242), hysteresis (the first
overflow skips and keeps the scale) and a norm-spike skip (no overflow). The framework's signal
(``optimizer.step_was_skipped``, ``accelerator.optimizer_step_was_skipped``) must equal the truth
(whether the parameters moved), and its scheduler (Accelerate's prepared ``AcceleratedScheduler``,
the Trainer's own) must give every step the learning rate of the same torch scheduler stepped on
the host only after applied steps (Megatron's rule).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from skip_truth import (  # noqa: E402
    INJECTED,
    SKIP_CASES,
    STEPS,
    GradInjector,
    Truth,
    injected_kind,
    make_optimizer,
    scaler_kwargs,
)

from tritonscale.integrations.accelerate import FusedClipFallbackWarning, FusedScalerTrainerMixin, install  # noqa: E402
from tritonscale.integrations.cpu_precision import CPUFloat16Warning  # noqa: E402

pytestmark = pytest.mark.filterwarnings(f"ignore::{CPUFloat16Warning.__module__}.{CPUFloat16Warning.__name__}")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # AcceleratorState is a process-wide singleton: each Accelerator here starts from scratch.
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def tiny_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def decaying(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A schedule whose rate differs at every step count, so the rate tells the count."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda count: 1.0 / (1 + count))


def host_gated_rates(case: str, make_scheduler, skipped: list[bool]) -> list[float]:
    """The oracle: the same torch scheduler on a bystander optimizer, stepped only after applied
    steps; its rate after each step."""
    bystander = make_optimizer(case, [torch.nn.Parameter(torch.zeros(1))])
    scheduler = make_scheduler(bystander)
    rates = []
    for was_skipped in skipped:
        if not was_skipped:
            bystander.step()  # no gradient: changes nothing; torch wants it before scheduler.step()
            scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    return rates


@pytest.mark.parametrize("case", SKIP_CASES)
def test_accelerate_signal_and_prepared_scheduler_follow_the_truth(case):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    install(accelerator, backend="torch", **scaler_kwargs(case))
    model = tiny_model()
    optimizer = make_optimizer(case, model.parameters())
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, decaying(optimizer))
    assert isinstance(scheduler, AcceleratedScheduler)
    GradInjector(model[0].weight, injected_kind(case))
    truth, g = Truth(model), torch.Generator().manual_seed(1)
    flags, reported, rates = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        for _ in range(STEPS):
            truth.before()
            x, y = batch(g)
            accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the norm the spike rule reads
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            truth.after()
            flags.append(optimizer.step_was_skipped)
            reported.append(accelerator.optimizer_step_was_skipped)
            rates.append(scheduler.get_last_lr()[0])

    assert truth.skipped == [step in INJECTED for step in range(STEPS)]  # the injection bit
    assert [bool(flag) for flag in flags] == truth.skipped
    assert reported == truth.skipped
    assert rates == host_gated_rates(case, decaying, truth.skipped)


def run_trainer(case: str, tmp_path) -> tuple[Truth, list[bool], list[float]]:
    """The HF Trainer with the mixin and its own linear schedule (made on the prepared optimizer)."""
    transformers = pytest.importorskip("transformers")

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny_model()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x).float(), labels)}

    class FusedTrainer(FusedScalerTrainerMixin, transformers.Trainer):
        pass

    model = Regression()
    GradInjector(model.net[0].weight, injected_kind(case))
    truth, reported, rates = Truth(model), [], []

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            truth.before()

        def on_step_end(self, args, state, control, **kwargs):
            truth.after()
            reported.append(trainer.accelerator.optimizer_step_was_skipped)
            rates.append(trainer.lr_scheduler.get_last_lr()[0])

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(4, generator=g), "labels": torch.randn(2, generator=g)} for _ in range(4 * STEPS)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        fp16=True,
        use_cpu=True,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",  # no warm-up: a rate of 0 would leave the parameters unmoved
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = FusedTrainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizers=(make_optimizer(case, model.parameters()), None),
        callbacks=[Record()],
        tritonscale_scaler_kwargs={"backend": "torch", **scaler_kwargs(case)},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        trainer.train()
    return truth, reported, rates


@pytest.mark.parametrize("case", SKIP_CASES)
def test_hf_trainer_signal_and_scheduler_follow_the_truth(case, tmp_path):
    transformers = pytest.importorskip("transformers")
    truth, reported, rates = run_trainer(case, tmp_path)

    def linear(optimizer):
        return transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=STEPS)

    assert truth.skipped == [step in INJECTED for step in range(STEPS)]
    assert reported == truth.skipped
    assert rates == host_gated_rates(case, linear, truth.skipped)


def test_fused_step_and_its_skip_flag_read_nothing_on_the_host(forbid_host_reads, backend):
    """On the GPU paths the step and the flag Accelerate reads stay on the device; only bool()
    on it (the scheduler's gate, the Trainer's) reads the host."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    install(accelerator, backend=backend, **scaler_kwargs("fused_adamw"))
    model = tiny_model()
    model, optimizer = accelerator.prepare(model, make_optimizer("fused_adamw", model.parameters()))
    GradInjector(model[0].weight, "inf", at=(1,))
    truth, g, flags = Truth(model), torch.Generator().manual_seed(1), []
    for _ in range(3):
        truth.before()
        x, y = batch(g)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with forbid_host_reads.armed():
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            flags.append(optimizer.step_was_skipped)
        optimizer.zero_grad()
        truth.after()
    assert truth.skipped == [False, True, False]
    assert [bool(flag) for flag in flags] == truth.skipped


def test_install_after_a_scheduler_wrapped_the_prepared_optimizer_and_twice():
    """install() after prepare(), once a torch scheduler wrapped the prepared optimizer's step,
    and again: the skips are reported, and the scheduler's wrapper still sees the step called."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = tiny_model()
    model, optimizer = accelerator.prepare(model, make_optimizer("fused_adamw", model.parameters()))
    scheduler = decaying(optimizer)  # wraps optimizer.step in the instance
    with pytest.warns(UserWarning, match="before accelerator.prepare"):
        install(accelerator, backend="torch", **scaler_kwargs("fused_adamw"))
    scaler = install(accelerator, backend="torch", **scaler_kwargs("fused_adamw"))
    GradInjector(model[0].weight, "inf")
    truth, g, rates = Truth(model), torch.Generator().manual_seed(1), []
    for _ in range(STEPS):
        truth.before()
        x, y = batch(g)
        with accelerator.autocast():  # the model was prepared before fp16 was on
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            scheduler.step()
        optimizer.zero_grad()
        truth.after()
        rates.append(scheduler.get_last_lr()[0])
    assert truth.skipped == [step in INJECTED for step in range(STEPS)]
    assert int(scaler.stats()["skipped_steps"]) == len(INJECTED)
    assert getattr(optimizer, "_opt_called", False)  # the scheduler's wrapper still ran
    assert rates == host_gated_rates("fused_adamw", decaying, truth.skipped)


def ddp_worker(rank: int, world_size: int, case: str) -> dict:
    """One rank of an Accelerate DDP run on CPU; the gradient is poisoned on rank 0 only."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    warnings.simplefilter("ignore", CPUFloat16Warning)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    install(accelerator, backend="torch", **scaler_kwargs(case))
    model = tiny_model()
    optimizer = make_optimizer(case, model.parameters())
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, decaying(optimizer))
    GradInjector(model.module[0].weight, injected_kind(case), at=INJECTED if rank == 0 else ())
    truth, g, flags, rates = Truth(model), torch.Generator().manual_seed(1 + rank), [], []
    for _ in range(STEPS):
        truth.before()
        x, y = batch(g)
        accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        truth.after()
        flags.append(bool(optimizer.step_was_skipped))
        rates.append(scheduler.get_last_lr()[0])
    return {"truth": truth.skipped, "flags": flags, "rates": rates}


@pytest.mark.slow
def test_every_rank_reports_the_skip_a_peer_caused():
    """Two DDP ranks, the inf written on rank 0 only: after the all-reduce both skip, and both
    report it; Accelerate's prepared scheduler steps num_processes times per applied step."""
    from support.multiprocess import run_ranks

    for run in run_ranks(ddp_worker, 2, "fused_adamw"):
        assert run["truth"] == [step in INJECTED for step in range(STEPS)]
        assert run["flags"] == run["truth"]

        def twice(skipped):  # Accelerate's rule without split_batches: num_processes steps each
            return [flag for flag in skipped for _ in range(2)]

        assert run["rates"] == host_gated_rates("fused_adamw", decaying, twice(run["truth"]))[1::2]
