"""tritonscale.integrations.accelerate against Accelerate's own scaler path, through Accelerate's real API.

On CPU Accelerate turns fp16 into plain fp32 with no scaler, so the reference run forces its
native-AMP path by hand (``native_amp = True`` and a ``torch.amp.GradScaler("cpu")`` as
``accelerator.scaler`` before ``prepare``): the same code Accelerate runs on a GPU. The other run
calls ``install``. Same seed, same batches, an injected inf and NaN step; the scale trajectory,
``step_was_skipped`` per step, the norms and the final parameters must agree, and the fused pass
must be what ran (no fallback, ``scaler.clip_grad_norm_`` called, its norm in ``stats()``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import tritonscale  # noqa: E402
from tritonscale.integrations.accelerate import (  # noqa: E402
    FusedClipFallbackWarning,
    FusedScalerTrainerMixin,
    install,
    installed_scaler,
)

SCALER_ARGS = {"init_scale": 2.0**10, "growth_interval": 2}
BAD_STEPS = {2: float("inf"), 4: float("nan")}  # step -> value written into one gradient element


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # AcceleratorState is a process-wide singleton: each Accelerator here starts from scratch.
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batches(n: int, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (batch, 16), generator=g) for _ in range(n)]


def accelerate_reference(mixed_precision: str = "fp16") -> Accelerator:
    """Accelerate's own native-AMP path, forced on CPU with torch's scaler."""
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
    return accelerator


def spy_fused_clip(scaler: tritonscale.GradScaler) -> list[torch.Tensor]:
    """Record the norms scaler.clip_grad_norm_ returns (an instance attribute shadows the method)."""
    norms: list[torch.Tensor] = []
    method = scaler.clip_grad_norm_

    def clip_grad_norm_(*args, **kwargs):
        norms.append(method(*args, **kwargs))
        return norms[-1]

    scaler.clip_grad_norm_ = clip_grad_norm_
    return norms


def train(accelerator: Accelerator, model, optimizer, steps: int, after_step=None) -> dict:
    """Accelerate's documented loop: backward, clip_grad_norm_, optimizer.step, zero_grad."""
    model, optimizer = accelerator.prepare(model, optimizer)
    out = {"scale": [], "skipped": [], "norm": [], "loss": []}
    for step, ids in enumerate(batches(steps)):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if step in BAD_STEPS:
            next(model.parameters()).grad.view(-1)[3] = BAD_STEPS[step]
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step, norm)
        out["scale"].append(accelerator.scaler.get_scale())
        out["skipped"].append(optimizer.step_was_skipped)
        out["norm"].append(float(norm))
        out["loss"].append(float(loss.detach()))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def assert_same_run(ours: dict, ref: dict) -> None:
    """Scale exactly; numbers to ~1e-5. The fused clip multiplies once by
    ``clip_coef / scale`` where torch divides and then multiplies: an ulp apart, and fp16 autocast
    can round two weights an ulp apart to different fp16 values, so a later norm moves by up to
    ~2e-5 (measured) while the model as a whole stays within ~1e-6."""
    assert ours["scale"] == ref["scale"]
    assert [math.isfinite(n) for n in ours["norm"]] == [math.isfinite(n) for n in ref["norm"]]
    for a, b in zip(ours["norm"], ref["norm"]):
        if math.isfinite(b):
            assert a == pytest.approx(b, rel=1e-4)
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    a, b = (torch.cat([p.flatten() for p in run["params"]]) for run in (ours, ref))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def sgd(model, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "sgd-fused-fold"])
def test_matches_accelerates_own_scaler_path(fused):
    """(AdamW would amplify the rounding noise in gradients that are zero in exact arithmetic,
    such as the attention key bias's, to whole learning-rate steps; SGD keeps the comparison tight.)"""
    steps = 6
    model = tiny_gpt2()
    init = [p.detach().clone() for p in model.parameters()]
    ref = train(accelerate_reference(), model, sgd(model, fused), steps)
    AcceleratorState._reset_state(True)

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install(accelerator, backend="torch", **SCALER_ARGS)
    assert accelerator.scaler is scaler and installed_scaler(accelerator) is scaler
    fused_norms = spy_fused_clip(scaler)
    stats_norms = []
    model = tiny_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        ours = train(
            accelerator,
            model,
            sgd(model, fused),
            steps,
            after_step=lambda step, norm: stats_norms.append((norm, scaler.stats()["norm"])),
        )

    assert_same_run(ours, ref)
    # The scale backed off on both bad steps and grew every 2 good ones.
    assert ref["scale"] == [1024.0, 2048.0, 1024.0, 1024.0, 512.0, 512.0]
    # A fused optimizer is always stepped (it skips on the device), so Accelerate reports no skip
    # with torch's scaler; install() reports the skips that happened (test_accelerate_skips.py).
    assert ref["skipped"] == ([False] * steps if fused else [s in BAD_STEPS for s in range(steps)])
    assert ours["skipped"] == [s in BAD_STEPS for s in range(steps)]
    assert scaler.last_step_skipped() is False
    assert not any(torch.equal(a, b) for a, b in zip(ours["params"], init))
    # The fused pass ran on every step, and what accelerator.clip_grad_norm_ returned is its norm.
    assert len(fused_norms) == steps
    for (returned, in_stats), fused_norm in zip(stats_norms, fused_norms):
        assert returned is fused_norm
        torch.testing.assert_close(in_stats, returned, equal_nan=True)


def test_triton_backend_and_install_after_prepare():
    """The Triton kernels (interpreter) on a small model; install() after prepare() re-points the
    prepared optimizer, so step_was_skipped and the step hook work with the new scaler."""
    steps = 5

    def run(accelerator, set_up_after_prepare=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        model, optimizer = accelerator.prepare(model, sgd(model, fused=False))
        scaler = set_up_after_prepare(accelerator) if set_up_after_prepare else None
        g = torch.Generator().manual_seed(2)
        rows = []
        for step in range(steps):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            with accelerator.autocast():  # the model was prepared before fp16 was on: autocast here
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            if step in BAD_STEPS:
                model[0].weight.grad[0, 0] = BAD_STEPS[step]
            norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            rows.append((accelerator.scaler.get_scale(), optimizer.step_was_skipped, float(norm)))
        return rows, [p.detach().clone() for p in model.parameters()], scaler

    ref_rows, ref_params, _ = run(accelerate_reference())
    AcceleratorState._reset_state(True)

    def late_install(accelerator):
        with pytest.warns(UserWarning, match="before accelerator.prepare"):
            scaler = install(accelerator, backend="triton", **SCALER_ARGS)
        assert accelerator._optimizers[0].scaler is scaler
        return scaler

    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        rows, params, scaler = run(Accelerator(mixed_precision="fp16", cpu=True), late_install)
    assert scaler.backend == "triton"
    assert [r[:2] for r in rows] == [r[:2] for r in ref_rows]
    assert [r[1] for r in rows] == [s in BAD_STEPS for s in range(steps)]
    for (*_, a), (*_, b) in zip(rows, ref_rows):
        assert a == pytest.approx(b, rel=1e-5, nan_ok=True)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def scaled_grads_set_up(n_optimizers: int = 1):
    """An installed accelerator after one backward: (accelerator, scaler, model, optimizers)."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install(accelerator, backend="torch", **SCALER_ARGS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if n_optimizers == 1:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    else:
        optimizers = [torch.optim.SGD(model[i].parameters(), lr=0.1) for i in range(2)]
    model, *optimizers = accelerator.prepare(model, *optimizers)
    accelerator.backward(model(torch.randn(4, 8)).float().square().sum())
    return accelerator, scaler, model, optimizers


def true_norm(grads, scale, norm_type=2.0):
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g / scale, norm_type) for g in grads]), norm_type
    )


@pytest.mark.parametrize(
    "case, match",
    [
        ("subset", "also holds 2 gradient"),
        ("two-optimizers", "spread over 2 prepared optimizers"),
        ("not-prepared", "belong to no optimizer"),
    ],
)
def test_falls_back_to_accelerates_path_with_a_reason(case, match):
    accelerator, scaler, model, optimizers = scaled_grads_set_up(2 if case == "two-optimizers" else 1)
    fused_norms = spy_fused_clip(scaler)
    params, max_norm, norm_type = list(model.parameters()), 0.5, 2.0
    if case == "subset":
        params = list(model[0].parameters())
    elif case == "not-prepared":
        params = [torch.nn.Parameter(torch.ones(3))]
        params[0].grad = torch.ones(3)
    expected = true_norm([p.grad for p in params], 1.0 if case == "not-prepared" else scaler.get_scale(), norm_type)
    with pytest.warns(FusedClipFallbackWarning, match=match):
        norm = accelerator.clip_grad_norm_(params, max_norm, norm_type)
    assert fused_norms == []
    torch.testing.assert_close(norm.float(), expected, rtol=1e-5, atol=0)
    for optimizer in optimizers:  # Accelerate's path unscaled through our scaler; the step completes
        optimizer.step()
        assert not optimizer.step_was_skipped


@pytest.mark.parametrize("max_norm, norm_type", [(math.inf, 2.0), (0.5, 3.0)], ids=["norm-only", "norm-type-3"])
def test_norm_only_and_other_norm_types_run_fused(max_norm, norm_type):
    # max_norm=inf is the Trainer's call when max_grad_norm <= 0; norm types beyond 1, 2 and inf
    # run with torch ops inside the scaler's pass. Both stay on the scaler, no fallback.
    accelerator, scaler, model, optimizers = scaled_grads_set_up(1)
    fused_norms = spy_fused_clip(scaler)
    params = list(model.parameters())
    expected = true_norm([p.grad for p in params], scaler.get_scale(), norm_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        norm = accelerator.clip_grad_norm_(params, max_norm, norm_type)
    assert len(fused_norms) == 1
    torch.testing.assert_close(norm.float(), expected, rtol=1e-5, atol=0)


def test_bf16_runs_the_fused_clip_unscaled_and_skips_on_inf():
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    scaler = install(accelerator, backend="torch")
    assert not scaler.is_enabled()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, sgd(model, fused=False))
    before = model.weight.detach().clone()
    accelerator.backward(model(torch.randn(3, 4)).float().sum())
    grads = [p.grad.clone() for p in model.parameters()]
    model.weight.grad[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.isnan()
    optimizer.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert torch.equal(model.weight.detach(), before)
    for p, g in zip(model.parameters(), grads):  # a good step clips like torch
        p.grad = g.clone()
    expected = true_norm(grads, 1.0)
    torch.testing.assert_close(accelerator.clip_grad_norm_(model.parameters(), 1.0), expected, rtol=1e-5, atol=0)
    optimizer.step()
    assert not optimizer.step_was_skipped


def test_refusals_and_checkpoint_round_trip(tmp_path):
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        install(Accelerator(cpu=True), enabled=True)
    AcceleratorState._reset_state(True)
    accelerator, scaler, model, (optimizer,) = scaled_grads_set_up()
    accelerator.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scaler.update(4096.0)
    accelerator.save_state(str(tmp_path))  # Accelerate saves accelerator.scaler.state_dict()
    scaler.update(8.0)
    accelerator.load_state(str(tmp_path))
    assert scaler.get_scale() == 4096.0


def test_hf_trainer_recipe_matches_the_trainers_own_scaler_run(tmp_path):
    transformers = pytest.importorskip("transformers")

    class TorchScalerTrainer(transformers.Trainer):
        """The Trainer with Accelerate's native-AMP path forced on CPU (the reference)."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)

    class FusedTrainer(FusedScalerTrainerMixin, transformers.Trainer):
        pass

    class Record(transformers.TrainerCallback):
        def __init__(self):
            self.rows, self.trainer = [], None

        def on_step_end(self, args, state, control, **kwargs):
            accelerator = self.trainer.accelerator
            self.rows.append((accelerator.scaler.get_scale(), accelerator.optimizer_step_was_skipped))

    def run(trainer_class, **kwargs):
        AcceleratorState._reset_state(True)
        model = tiny_gpt2()
        data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(12, batch=1)]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / trainer_class.__name__),
            max_steps=3,
            per_device_train_batch_size=4,
            fp16=True,
            use_cpu=True,
            optim="sgd",
            learning_rate=0.05,
            max_grad_norm=0.5,
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        record = Record()
        trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=[record], **kwargs)
        record.trainer = trainer
        fused_norms = spy_fused_clip(trainer.accelerator.scaler) if trainer_class is FusedTrainer else None
        trainer.train()
        return record.rows, [p.detach().clone() for p in model.parameters()], fused_norms, trainer

    ref_rows, ref_params, _, _ = run(TorchScalerTrainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedClipFallbackWarning)
        rows, params, fused_norms, trainer = run(
            FusedTrainer, tritonscale_scaler_kwargs={"backend": "torch", **SCALER_ARGS}
        )
    assert isinstance(trainer.accelerator.scaler, tritonscale.GradScaler)
    assert trainer.tritonscale_scaler is trainer.accelerator.scaler
    assert rows == ref_rows == [(1024.0, False), (2048.0, False), (2048.0, False)]
    assert len(fused_norms) == 3 and all(n.isfinite() for n in fused_norms)
    a, b = (torch.cat([p.flatten() for p in run]) for run in (params, ref_params))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
