"""The Lightning integration against Lightning's own MixedPrecision, through the real Trainer and Fabric.

Each run trains a tiny MLP for a few steps from the same seed on the same batches, with gradient
clipping by norm active and (where noted) one injected inf/NaN gradient, once with Lightning's
``MixedPrecision(..., scaler=torch.amp.GradScaler("cpu"))`` and its own clipping and once with the
plugin. On CPU Lightning turns ``precision="16-mixed"`` into bf16 without a scaler, so both runs pass
an explicit 16-mixed plugin: the scaler then goes through the frameworks' real code paths.

The parameters agree to rounding, not bitwise: torch unscales (``g * (1/scale)``) and then clips
(``g * clip_coef``), our pass multiplies once by ``(1/scale) * clip_coef``, and the fold hands a
fused optimizer ``scale / clip_coef``: about 1 ulp per gradient element, which a few steps of
AdamW keep far below the 1e-5 relative tolerance. The scale trajectory and the skipped steps are
exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
lightning_fabric = pytest.importorskip("lightning.fabric")

import skip_truth  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

import tritonscale  # noqa: E402
from tritonscale.integrations.lightning import (  # noqa: E402
    FabricFusedClipPrecision,
    FusedClipPrecision,
    enable_fused_clipping,
)

STEPS = 5
CLIP = 0.05  # small enough that every good step is clipped
SCALER_ARGS = {"init_scale": 2.0**10, "growth_interval": 2}  # growth and a backoff within STEPS
RTOL, ATOL = 1e-5, 1e-7

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning",  # Lightning's num_workers / log_every_n_steps / CPU-only hints
    "ignore::DeprecationWarning",
    "ignore:.*LeafSpec.*:FutureWarning",  # lightning 2.6 on torch 2.13's pytree
)


#: The Trainer settings every run here shares: no progress bar, logger, checkpoints, summary or sanity steps.
QUIET = dict(
    enable_progress_bar=False,
    logger=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, fused=kind == "fused-adamw", foreach=False if kind == "adamw" else None)


def inject(net: torch.nn.Module, value: float | None) -> None:
    """One non-finite gradient element, as an fp16 overflow or a bad batch would leave; None zeroes
    every gradient instead (with plain SGD that step then changes nothing, like a skipped one)."""
    if value is None:
        for p in net.parameters():
            p.grad.zero_()
    else:
        net[0].weight.grad[0, 0] = value


def torch_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **SCALER_ARGS)


def params_of(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def assert_params_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------- Trainer


class TinyModule(pl.LightningModule):
    def __init__(self, optimizer: str, bad_step: int | None, bad_value: float | None) -> None:
        super().__init__()
        self.net = make_net()
        self.optimizer_kind, self.bad_step, self.bad_value = optimizer, bad_step, bad_value
        self.grads_seen_by_hook: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step == self.bad_step:
            inject(self.net, self.bad_value)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads_seen_by_hook.append(self.net[2].bias.grad.detach().clone())

    def configure_optimizers(self):
        return make_optimizer(self.net.parameters(), self.optimizer_kind)


class Recorder(pl.Callback):
    """The scale after each step's update(), and whether the step changed the parameters."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[bool] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = params_of(pl_module.net)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)
        after = params_of(pl_module.net)
        self.skipped.append(all(torch.equal(a, b) for a, b in zip(after, self._before)))


def fit(
    plugin,
    optimizer: str = "adamw",
    bad_step: int | None = 2,
    bad_value: float | None = float("inf"),
    steps: int = STEPS,
    algorithm: str = "norm",
):
    module = TinyModule(optimizer, bad_step, bad_value)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm=algorithm,
        plugins=[plugin],
        callbacks=[recorder],
        **QUIET,
    )
    # batch_size=None: the loader hands the prepared batches over as they are.
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(steps), batch_size=None))
    return module, recorder


@pytest.mark.parametrize(
    "backend, unscale_before_hooks, steps",
    [("torch", False, STEPS), ("torch", True, STEPS), ("triton", False, 3)],
)
def test_trainer_matches_lightning_amp(backend, unscale_before_hooks, steps):
    bad = 1 if steps < STEPS else 2
    theirs, their_rec = fit(MixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), bad_step=bad, steps=steps)
    plugin = FusedClipPrecision(
        "16-mixed", "cpu", unscale_before_hooks=unscale_before_hooks, backend=backend, **SCALER_ARGS
    )
    unscale_calls = count_calls(plugin.scaler, "unscale_")
    ours, our_rec = fit(plugin, bad_step=bad, steps=steps)

    # By default the clip is the only unscale (the fused pass); on request Lightning's order.
    assert unscale_calls == ([None] * steps if unscale_before_hooks else [])
    assert our_rec.scales == their_rec.scales
    assert our_rec.skipped == their_rec.skipped == [i == bad for i in range(steps)]
    assert_params_close(params_of(ours.net), params_of(theirs.net))
    # The clip was active, and the plugin's norm is the last good step's (finite) one.
    assert plugin.last_grad_norm is not None and CLIP < float(plugin.last_grad_norm) < float("inf")
    # on_before_optimizer_step: Lightning shows true gradients; by default ours are still scaled
    # (the unscale is the clip's), and unscale_before_hooks=True restores Lightning's view.
    for step, (g_ours, g_theirs) in enumerate(zip(ours.grads_seen_by_hook, theirs.grads_seen_by_hook)):
        scale_then = SCALER_ARGS["init_scale"] if step == 0 else their_rec.scales[step - 1]
        expected = g_theirs if unscale_before_hooks else g_theirs * scale_then
        torch.testing.assert_close(g_ours, expected, rtol=1e-3, atol=1e-6)


def count_calls(obj: object, name: str) -> list[None]:
    """Wrap obj.name (on this instance only); the returned list grows by one per call."""
    calls: list[None] = []
    method = getattr(obj, name)

    def counting(*args, **kwargs):
        calls.append(None)
        return method(*args, **kwargs)

    setattr(obj, name, counting)
    return calls


def test_trainer_fused_optimizer_is_clipped():
    # Lightning's own plugin refuses to clip a fused optimizer...
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(MixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), optimizer="fused-adamw", steps=1)
    # ... ours folds the clip into its step: compare with Lightning's unfused AdamW run.
    theirs, their_rec = fit(MixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), optimizer="adamw")
    plugin = FusedClipPrecision("16-mixed", "cpu", backend="torch", **SCALER_ARGS)
    ours, our_rec = fit(plugin, optimizer="fused-adamw")
    assert our_rec.scales == their_rec.scales
    assert our_rec.skipped == their_rec.skipped == [i == 2 for i in range(STEPS)]
    assert_params_close(params_of(ours.net), params_of(theirs.net))


def test_trainer_clip_by_value_falls_back_to_torch():
    # unscale_ then torch's clip_grad_value_; a fused optimizer is allowed (Lightning refuses it).
    theirs, their_rec = fit(MixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), algorithm="value")
    ours, our_rec = fit(
        FusedClipPrecision("16-mixed", "cpu", backend="torch", **SCALER_ARGS), "fused-adamw", algorithm="value"
    )
    assert our_rec.scales == their_rec.scales
    assert our_rec.skipped == their_rec.skipped == [i == 2 for i in range(STEPS)]
    assert_params_close(params_of(ours.net), params_of(theirs.net))


def test_trainer_bf16_nan_step_is_skipped():
    # Plain SGD: a step with zero gradients leaves the parameters as they are, like a skipped one,
    # so Lightning's bf16 run with the bad gradients zeroed is the reference (no scale, no fold; the
    # norm's per-tensor parts are summed in float64 here, in float32 by torch: ~1 ulp in clip_coef).
    # Lightning's bf16 run with the NaN itself ends with NaN parameters.
    plugin = FusedClipPrecision("bf16-mixed", "cpu", backend="torch")
    ours, our_rec = fit(plugin, optimizer="sgd", bad_value=float("nan"))
    zeroed, _ = fit(MixedPrecision("bf16-mixed", "cpu"), optimizer="sgd", bad_value=None)
    broken, _ = fit(MixedPrecision("bf16-mixed", "cpu"), optimizer="sgd", bad_value=float("nan"))

    assert our_rec.skipped == [i == 2 for i in range(STEPS)]
    assert not plugin.scaler.is_enabled()
    assert_params_close(params_of(ours.net), params_of(zeroed.net))
    assert torch.isnan(broken.net[0].weight).any()


class ManualModule(TinyModule):
    """Manual optimization: ``self.clip_gradients`` between ``manual_backward`` and ``opt.step()``."""

    def __init__(self) -> None:
        super().__init__("adamw", bad_step=2, bad_value=float("inf"))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x).float(), y))
        if batch_idx == self.bad_step:
            inject(self.net, self.bad_value)
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()


def test_trainer_manual_optimization_clips_unscaled_gradients():
    # Lightning's own plugin clips the still-scaled gradients here (it unscales only in the step);
    # ours is the fused unscale + clip. Reference: torch's documented loop.
    module = ManualModule()
    plugin = FusedClipPrecision("16-mixed", "cpu", backend="torch", **SCALER_ARGS)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[plugin],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(), batch_size=None))

    net, scaler = make_net(), torch_scaler()
    opt = make_optimizer(net.parameters(), "adamw")
    for step, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        if step == 2:
            inject(net, float("inf"))
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert plugin.scaler.get_scale() == scaler.get_scale()
    assert_params_close(params_of(module.net), params_of(net))


# ----------------------------------------------------------------------------------------------- Fabric


def fabric_run(
    plugin, optimizer: str = "adamw", bad_value: float | None = float("inf"), fused_clip=True, **clip_kwargs
):
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    if fused_clip:
        fabric = enable_fused_clipping(fabric)
    net = make_net()
    model, opt = fabric.setup(net, make_optimizer(net.parameters(), optimizer))
    scales, skipped, norms, clip_wrote = [], [], [], []
    for step, (x, y) in enumerate(batches()):
        before = params_of(net)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if step == 2:
            inject(net, bad_value)
        grads = [p.grad.clone() for p in net.parameters()]
        norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP, **clip_kwargs))
        clip_wrote.append(any(not torch.equal(g, p.grad) for g, p in zip(grads, net.parameters())))
        opt.step()
        opt.zero_grad()
        scales.append(plugin.scaler.get_scale() if plugin.scaler is not None else 1.0)
        skipped.append(all(torch.equal(a, b) for a, b in zip(params_of(net), before)))
    return net, scales, skipped, norms, clip_wrote


@pytest.mark.parametrize("fused_clip", [True, False], ids=["enable_fused_clipping", "strategy-clip"])
def test_fabric_matches_lightning_amp(fused_clip):
    # Fabric's default error_if_nonfinite=True raises on the overflowed step with Lightning's plugin.
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric_run(FabricMixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), fused_clip=False)
    theirs, their_scales, their_skipped, their_norms, _ = fabric_run(
        FabricMixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), fused_clip=False, error_if_nonfinite=False
    )
    # Ours with Fabric's defaults: the overflowed step is skipped, nothing raises.
    plugin = FabricFusedClipPrecision("16-mixed", "cpu", backend="torch", **SCALER_ARGS)
    ours, our_scales, our_skipped, our_norms, _ = fabric_run(plugin, fused_clip=fused_clip)

    assert our_scales == their_scales
    assert our_skipped == their_skipped == [i == 2 for i in range(STEPS)]
    assert_params_close(params_of(ours), params_of(theirs))
    good = [i for i in range(STEPS) if i != 2]
    torch.testing.assert_close(
        torch.stack([our_norms[i] for i in good]), torch.stack([their_norms[i] for i in good]), rtol=RTOL, atol=0
    )
    if fused_clip:  # the fused pass reports the overflow in the norm it returns
        assert not torch.isfinite(our_norms[2])


def test_fabric_fused_optimizer_is_clipped():
    with pytest.raises(NotImplementedError, match="optimizers handling the unscaling"):
        fabric_run(FabricMixedPrecision("16-mixed", "cpu", scaler=torch_scaler()), "fused-adamw", fused_clip=False)
    theirs, their_scales, their_skipped, *_ = fabric_run(
        FabricMixedPrecision("16-mixed", "cpu", scaler=torch_scaler()),
        "adamw",
        fused_clip=False,
        error_if_nonfinite=False,
    )
    plugin = FabricFusedClipPrecision("16-mixed", "cpu", backend="torch", **SCALER_ARGS)
    ours, our_scales, our_skipped, _, clip_wrote = fabric_run(plugin, "fused-adamw")
    assert clip_wrote == [False] * STEPS  # the fold: scale / clip_coef goes to AdamW, the grads stay
    assert our_scales == their_scales
    assert our_skipped == their_skipped == [i == 2 for i in range(STEPS)]
    assert_params_close(params_of(ours), params_of(theirs))


def test_fabric_bf16_nan_step_is_skipped():
    ours, _, skipped, norms, _ = fabric_run(
        FabricFusedClipPrecision("bf16-mixed", "cpu", backend="torch"), "sgd", bad_value=float("nan")
    )
    zeroed, *_ = fabric_run(FabricMixedPrecision("bf16-mixed", "cpu"), "sgd", bad_value=None, fused_clip=False)
    assert skipped == [i == 2 for i in range(STEPS)]
    assert torch.isnan(norms[2])
    assert_params_close(params_of(ours), params_of(zeroed))


# -------------------------------------------------------------------------- skipped steps and schedulers


def lambda_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A schedule that changes the rate on every step, so one wrong advance shows."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (1 + n))


def expected_lrs(case: str, skipped: list[bool]) -> list[float]:
    """The same torch scheduler stepped on the host only on the applied steps."""
    opt = skip_truth.make_optimizer(case, [torch.zeros(1, requires_grad=True)])
    sched = lambda_schedule(opt)
    return skip_truth.lrs_on_applied_steps(skipped, lambda: opt.param_groups[0]["lr"], sched.step)


class SkipModule(pl.LightningModule):
    """A linear layer, the case's optimizer and a per-step LambdaLR (Lightning steps it)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.case = torch.nn.Linear(6, 3), case
        self.injector = skip_truth.GradInjector(self.net.weight, skip_truth.injected_kind(case))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        opt = skip_truth.make_optimizer(self.case, self.net.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": lambda_schedule(opt), "interval": "step"}}


class SkipRecorder(pl.Callback):
    """Per batch: the truth, the plugin's skip signal, and the rate the step ran with (+ the final one)."""

    def __init__(self, truth: skip_truth.Truth) -> None:
        self.truth, self.signal, self.lrs = truth, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.truth.before()
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.truth.after()
        plugin = trainer.precision_plugin
        self.signal.append(plugin.applied_steps.skipped() if isinstance(plugin, FusedClipPrecision) else None)

    def on_train_end(self, trainer, pl_module) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit_skip_case(case: str, plugin) -> SkipRecorder:
    module = SkipModule(case)
    recorder = SkipRecorder(skip_truth.Truth(module))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=skip_truth.STEPS,
        gradient_clip_val=1.0,  # the norm the spike rule reads comes from the fused clip
        plugins=[plugin],
        callbacks=[recorder],
        **QUIET,
    )
    data = batches(skip_truth.STEPS)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return recorder


@pytest.mark.parametrize("case", skip_truth.SKIP_CASES)
def test_trainer_schedulers_advance_only_on_applied_steps(case):
    # Lightning steps interval="step" schedulers after every batch; the plugin gates them.
    plugin = FusedClipPrecision("16-mixed", "cpu", backend="torch", **skip_truth.scaler_kwargs(case))
    rec = fit_skip_case(case, plugin)
    assert rec.truth.skipped == [s in skip_truth.INJECTED for s in range(skip_truth.STEPS)]
    assert rec.signal == rec.truth.skipped
    assert rec.lrs == expected_lrs(case, rec.truth.skipped)
    assert plugin.applied_steps.count == rec.truth.skipped.count(False)


def test_trainer_fused_step_reads_nothing_on_the_host(forbid_host_reads):
    # With a fused optimizer the step (closure, clip, step, update, recording the skip) stays on the
    # device; the one read is the scheduler gate's, when Lightning steps the scheduler after the
    # batch. (A plain optimizer's scaler.step reads its skip flag: the scaler's own read.)
    case = "fused_adamw"
    plugin = FusedClipPrecision("16-mixed", "cpu", backend="torch", **skip_truth.scaler_kwargs(case))
    step = plugin.optimizer_step

    def guarded(*args, **kwargs):
        with forbid_host_reads.armed():
            return step(*args, **kwargs)

    plugin.optimizer_step = guarded
    rec = fit_skip_case(case, plugin)
    assert rec.lrs == expected_lrs(case, rec.truth.skipped)


def test_trainer_gate_keeps_the_modules_hook_and_a_second_fit():
    # The gate wraps the module's own lr_scheduler_step (an override still runs, and Lightning still
    # sees it as overridden); a second Trainer with a new plugin replaces the first plugin's gate.
    class Overriding(SkipModule):
        calls = 0

        def lr_scheduler_step(self, scheduler, metric) -> None:
            Overriding.calls += 1
            scheduler.step()

    module = Overriding("sgd")
    for fit_number in range(2):
        plugin = FusedClipPrecision("16-mixed", "cpu", backend="torch", **skip_truth.scaler_kwargs("sgd"))
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=skip_truth.STEPS,
            plugins=[plugin],
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        ).fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(skip_truth.STEPS), batch_size=None))
        assert is_overridden("lr_scheduler_step", module)
        assert module.lr_scheduler_step.applied is plugin.applied_steps
        # The injector poisons backward passes 2 and 5 of the first fit only.
        assert Overriding.calls == skip_truth.STEPS - len(skip_truth.INJECTED) + fit_number * skip_truth.STEPS


@pytest.mark.parametrize("case", skip_truth.SKIP_CASES)
def test_fabric_loop_steps_the_scheduler_only_on_applied_steps(case):
    # Fabric has no scheduler of its own: the documented loop asks the plugin (one host read).
    plugin = FabricFusedClipPrecision("16-mixed", "cpu", backend="torch", **skip_truth.scaler_kwargs(case))
    fabric = enable_fused_clipping(lightning_fabric.Fabric(accelerator="cpu", devices=1, plugins=[plugin]))
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 3)
    injector = skip_truth.GradInjector(net.weight, skip_truth.injected_kind(case))  # noqa: F841 (kept alive)
    model, opt = fabric.setup(net, skip_truth.make_optimizer(case, net.parameters()))
    sched, truth, signal, lrs = lambda_schedule(opt), skip_truth.Truth(net), [], []
    for x, y in batches(skip_truth.STEPS):
        truth.before()
        lrs.append(opt.param_groups[0]["lr"])
        fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        truth.after()
        signal.append(plugin.applied_steps.skipped())
        assert signal[-1] == plugin.scaler.last_step_skipped()  # the documented recipe says the same
        if not signal[-1]:
            sched.step()
    assert truth.skipped == [s in skip_truth.INJECTED for s in range(skip_truth.STEPS)]
    assert signal == truth.skipped
    assert lrs + [opt.param_groups[0]["lr"]] == expected_lrs(case, truth.skipped)


# ------------------------------------------------------------------------------------------- arguments


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="tritonscale.GradScaler"):
        FusedClipPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="enabled=False"):
        FabricFusedClipPrecision("bf16-mixed", "cpu", scaler=tritonscale.GradScaler("cpu"))
    with pytest.raises(ValueError, match="16-mixed"):
        FusedClipPrecision("16-true", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    with pytest.raises(TypeError, match="FabricFusedClipPrecision"):
        enable_fused_clipping(fabric)
    # A scaler made by the plugin gets the keywords; one passed in is used as it is.
    assert FusedClipPrecision("16-mixed", "cpu", init_scale=8.0).scaler.get_scale() == 8.0
    mine = tritonscale.GradScaler("cpu", enabled=False)
    assert FabricFusedClipPrecision("bf16-mixed", "cpu", scaler=mine).scaler is mine
