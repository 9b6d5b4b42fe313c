"""tritonscale.integrations.timm against timm's own NativeScaler, through its __call__ in a training loop.

Each run trains the same tiny MLP from the same seed on the same batches twice: with timm's
``NativeScaler`` (torch.amp.GradScaler + unscale_ + timm's dispatch_clip_grad) and with
``FusedNativeScaler``; the scale after every step, the skipped steps (an injected inf step and a
NaN step included) and the final parameters must agree.

timm imports torchvision at package import. Next to a CPU build of torch, pip's torchvision is a
CUDA build whose import fails ("operator torchvision::nms does not exist"), so when ``import timm``
fails this loads ``timm.utils.cuda`` (NativeScaler), ``timm.utils.clip_grad`` and ``timm.utils.agc``
-- which need only torch -- from the installed timm without running timm's package __init__.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import skip_truth
import torch


def _import_timm_utils_cuda() -> types.ModuleType:
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed", allow_module_level=True)  # runs at import
    try:
        import timm.utils.cuda

        return timm.utils.cuda
    except (ImportError, RuntimeError):  # torchvision missing, or a build that does not fit torch
        pass
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        del sys.modules[name]  # what the failed import left half-initialized
    for name in ("timm", "timm.utils"):
        spec = importlib.util.find_spec(name)  # a package's spec: found, not executed
        package = types.ModuleType(name)
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules[name] = package
    return importlib.import_module("timm.utils.cuda")


timm_cuda = _import_timm_utils_cuda()
NativeScaler = timm_cuda.NativeScaler

from tritonscale.integrations.timm import FusedNativeScaler  # noqa: E402

STEPS = 10
ACCUM = 2  # micro-batches per step: need_update=False on the first
INF_STEP, NAN_STEP = 3, 6
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
CLIP = 0.05  # below the gradient norm: the clip is active on every step


def _model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(STEPS * ACCUM)]
    return model, batches


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # the fold


def _train(loss_scaler, kind: str, clip_mode: str = "norm", clip_grad: float | None = CLIP, subset: bool = False):
    """timm's train_one_epoch, reduced: returns (scales, skipped, final parameters)."""
    model, batches = _model_and_data()
    optimizer = _optimizer(kind, model)
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(ACCUM):
            x, y = batches[step * ACCUM + micro]
            loss = torch.nn.functional.mse_loss(model(x), y) / ACCUM
            if micro == ACCUM - 1 and step in (INF_STEP, NAN_STEP):
                loss = loss * (float("inf") if step == INF_STEP else float("nan"))
            params = list(model.parameters())
            loss_scaler(
                loss,
                optimizer,
                clip_grad=clip_grad,
                clip_mode=clip_mode,
                parameters=params[:2] if subset else params,
                need_update=micro == ACCUM - 1,
            )
        optimizer.zero_grad()
        scales.append(loss_scaler._scaler.get_scale())
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return scales, skipped, [p.detach().clone() for p in model.parameters()]


def _assert_same_run(ours, theirs):
    (scales, skipped, params), (t_scales, t_skipped, t_params) = ours, theirs
    assert scales == t_scales
    assert skipped == t_skipped
    for p, t in zip(params, t_params):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


class _Calls:
    """Counts (and keeps the results of) calls to a function, passing them through."""

    def __init__(self, fn):
        self.fn, self.results = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.results.append(out)
        return out


def _fused_scaler(backend: str = "torch", **kw) -> FusedNativeScaler:
    return FusedNativeScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend=backend, **kw)


def _timm_scaler() -> NativeScaler:
    scaler = NativeScaler("cpu")
    scaler._scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return scaler


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_norm_clip_matches_timm(monkeypatch, kind, backend):
    torch_clips = _Calls(torch.nn.utils.clip_grad_norm_)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", torch_clips)
    theirs = _train(_timm_scaler(), kind)
    torch_norms = torch.stack(torch_clips.results)
    assert len(torch_clips.results) == STEPS

    ours_scaler = _fused_scaler(backend)
    fused_clips = _Calls(ours_scaler._scaler.clip_grad_norm_)
    ours_scaler._scaler.clip_grad_norm_ = fused_clips
    ours = _train(ours_scaler, kind)
    _assert_same_run(ours, theirs)
    assert ours[1] == [s in (INF_STEP, NAN_STEP) for s in range(STEPS)]
    assert ours[0][1] == 2 * INIT_SCALE and ours[0][INF_STEP] < ours[0][INF_STEP - 1]  # growth and backoff
    # The fused clip ran on every step and torch's clip never did; same norms on the good steps.
    assert len(fused_clips.results) == STEPS and len(torch_clips.results) == STEPS
    good = [s for s in range(STEPS) if s not in (INF_STEP, NAN_STEP)]
    torch.testing.assert_close(torch.stack(fused_clips.results)[good], torch_norms[good], rtol=1e-5, atol=0)
    assert torch.all(torch_norms[good] > CLIP)  # clipping was active


@pytest.mark.parametrize("clip_mode", ["value", "agc"])
def test_value_and_agc_fall_back_to_timm_dispatch(monkeypatch, clip_mode):
    clip_grad = 0.01 if clip_mode == "value" else 0.05
    theirs = _train(_timm_scaler(), "sgd", clip_mode=clip_mode, clip_grad=clip_grad)
    scaler = _fused_scaler()
    scaler._scaler.clip_grad_norm_ = lambda *a, **k: pytest.fail("fused clip used for clip_mode=" + clip_mode)
    _assert_same_run(_train(scaler, "sgd", clip_mode=clip_mode, clip_grad=clip_grad), theirs)


def test_clip_over_other_parameters_falls_back():
    # parameters= names the first layer only: timm clips those, not the optimizer's gradients.
    theirs = _train(_timm_scaler(), "sgd", subset=True)
    scaler = _fused_scaler()
    scaler._scaler.clip_grad_norm_ = lambda *a, **k: pytest.fail("fused clip used for a parameter subset")
    _assert_same_run(_train(scaler, "sgd", subset=True), theirs)


def test_no_clip_matches_timm():
    _assert_same_run(
        _train(_fused_scaler(), "adamw_fused", clip_grad=None), _train(_timm_scaler(), "adamw_fused", clip_grad=None)
    )


def test_checkpoint_surface():
    ours = _fused_scaler()
    assert isinstance(ours, NativeScaler) and ours.state_dict_key == "amp_scaler"
    assert ours.scaler is ours._scaler
    _train(ours, "sgd")
    theirs = NativeScaler("cpu")
    theirs.load_state_dict(ours.state_dict())  # ours -> timm's
    assert theirs._scaler.get_scale() == ours.scaler.get_scale()
    back = FusedNativeScaler("cpu")
    back.load_state_dict(theirs.state_dict())  # timm's -> ours
    torch_keys = theirs.state_dict().keys()
    assert {k: back.state_dict()[k] for k in torch_keys} == {k: ours.state_dict()[k] for k in torch_keys}


def test_fold_call_reads_nothing_on_the_host(forbid_host_reads):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    loss_scaler = _fused_scaler()
    for bad in (False, True, False):
        loss = model(torch.randn(3, 8)).square().mean() * (float("inf") if bad else 1.0)
        forbid_host_reads.on = True
        loss_scaler(loss, optimizer, clip_grad=0.1, parameters=model.parameters())
        forbid_host_reads.on = False
        optimizer.zero_grad()
    assert int(loss_scaler.scaler.stats()["skipped_steps"]) == 1


def _cosine(optimizer: torch.optim.Optimizer):
    """timm's own per-update schedule: warm-up, then cosine (t counted in updates, as train.py does)."""
    scheduler = importlib.import_module("timm.scheduler")
    return scheduler.CosineLRScheduler(
        optimizer, t_initial=skip_truth.STEPS, lr_min=1e-4, warmup_t=2, warmup_lr_init=1e-3, t_in_epochs=False
    )


@pytest.mark.parametrize("case", skip_truth.SKIP_CASES)
def test_step_update_with_applied_count_advances_only_on_applied_steps(case):
    # timm's train.py, reduced: step_update after every update, with the scaler's applied count.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    injector = skip_truth.GradInjector(model.weight, skip_truth.injected_kind(case))  # noqa: F841 (kept alive)
    optimizer = skip_truth.make_optimizer(case, model.parameters())
    lr_scheduler, truth, signal, lrs = _cosine(optimizer), skip_truth.Truth(model), [], []
    loss_scaler = FusedNativeScaler("cpu", backend="torch", **skip_truth.scaler_kwargs(case))
    for _ in range(skip_truth.STEPS):
        truth.before()
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 6)), torch.randn(8, 3))
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
        optimizer.zero_grad()
        truth.after()
        signal.append(loss_scaler.applied_steps.skipped())
        lr_scheduler.step_update(num_updates=loss_scaler.applied_steps.count)
    assert truth.skipped == [s in skip_truth.INJECTED for s in range(skip_truth.STEPS)]
    assert signal == truth.skipped
    # The oracle: timm's scheduler stepped on the host only on applied steps, with their count.
    oracle_opt = skip_truth.make_optimizer(case, [torch.zeros(1, requires_grad=True)])
    oracle, applied = _cosine(oracle_opt), []

    def advance() -> None:
        applied.append(None)
        oracle.step_update(num_updates=len(applied))

    expected = skip_truth.lrs_on_applied_steps(truth.skipped, lambda: oracle_opt.param_groups[0]["lr"], advance)
    assert lrs + [optimizer.param_groups[0]["lr"]] == expected
