"""tritonscale.integrations.mmengine against mmengine's own AmpOptimWrapper, through update_params.

Each run trains the same tiny MLP from the same seed on the same batches (forward inside
``optim_context``: mmengine's CPU autocast, bfloat16) with gradient accumulation, twice: with
mmengine's ``AmpOptimWrapper`` on torch's scaler (unscale_ + torch.nn.utils.clip_grad_norm_) and
with ``FusedClipAmpOptimWrapper``. The scale after every update, the skipped updates (an injected
inf and an injected NaN) and the final parameters must agree, and the logged ``train/grad_norm``.

mmengine's ``AmpOptimWrapper.__init__`` asserts a GPU (its scaler is ``torch.cuda.amp.GradScaler``).
The reference run gets past that assert with a patched ``is_cuda_available`` and then swaps in a CPU
``torch.amp.GradScaler``: everything after ``__init__`` is mmengine's unmodified code.
"""

from __future__ import annotations

import itertools
import sys
import warnings

import pytest
import skip_truth
import torch

pytest.importorskip("mmengine")

from mmengine.logging import MessageHub  # noqa: E402
from mmengine.optim import AmpOptimWrapper  # noqa: E402
from mmengine.optim.optimizer import amp_optimizer_wrapper  # noqa: E402
from mmengine.registry import OPTIM_WRAPPERS  # noqa: E402

from tritonscale.integrations.mmengine import FusedClipAmpOptimWrapper  # noqa: E402

UPDATES = 10
ACCUM = 2  # micro-batches per update (accumulative_counts)
INF_UPDATE, NAN_UPDATE = 3, 6
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
CLIP = 0.05  # below the gradient norm: the clip is active on every update
_hub_names = itertools.count()


def hide_broken_torchvision(monkeypatch) -> None:
    """mmengine's Runner imports torchvision in collect_env: a CUDA build next to a CPU torch
    fails to import, so it is made to look absent there."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        monkeypatch.setitem(sys.modules, "torchvision", None)


def _torch_wrapper(monkeypatch, optimizer, loss_scale=None, **kwargs) -> AmpOptimWrapper:
    """mmengine's AmpOptimWrapper on CPU, with a CPU torch.amp.GradScaler of the same settings."""
    with monkeypatch.context() as m, warnings.catch_warnings():
        m.setattr(amp_optimizer_wrapper, "is_cuda_available", lambda: True)  # only for the assert
        warnings.simplefilter("ignore")  # torch.cuda.amp.GradScaler: deprecated, and no CUDA here
        wrapper = AmpOptimWrapper(optimizer=optimizer, **kwargs)
    if isinstance(loss_scale, float):  # mmengine's static scale
        wrapper._scale_update_param = loss_scale
        wrapper.loss_scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale)
    else:
        wrapper.loss_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return wrapper


def _fused_wrapper(optimizer, backend="torch", loss_scale=None, **kwargs) -> FusedClipAmpOptimWrapper:
    if not isinstance(loss_scale, float):
        loss_scale = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend=backend)
    return FusedClipAmpOptimWrapper(optimizer=optimizer, loss_scale=loss_scale, **kwargs)


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # the fold


def _train(make_wrapper, kind: str = "sgd", clip_grad: dict | None = None):
    """Returns (scales, skipped, final parameters, logged grad norms, the wrapper)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(UPDATES * ACCUM)]
    hub = MessageHub.get_instance(f"tritonscale-test-{next(_hub_names)}")  # the wrapper logs here
    clip_grad = dict(max_norm=CLIP) if clip_grad is None else dict(clip_grad)
    wrapper = make_wrapper(_optimizer(kind, model), accumulative_counts=ACCUM, clip_grad=clip_grad)
    scales, skipped = [], []
    for update in range(UPDATES):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(ACCUM):
            x, y = batches[update * ACCUM + micro]
            with wrapper.optim_context(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if micro == 0 and update in (INF_UPDATE, NAN_UPDATE):
                loss = loss * (float("inf") if update == INF_UPDATE else float("nan"))
            wrapper.update_params(loss)
        assert wrapper._inner_count == (update + 1) * ACCUM  # mmengine's accumulation stepped here
        scales.append(wrapper.loss_scaler.get_scale())
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    norms = hub.get_scalar("train/grad_norm").data[0] if "train/grad_norm" in hub.log_scalars else None
    return scales, skipped, [p.detach().clone() for p in model.parameters()], norms, wrapper


def _assert_same_run(ours, theirs):
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    for p, t in zip(ours[2], theirs[2]):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


class _Calls:
    """Counts calls to a function, passing them through."""

    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    "kind,backend", [("sgd", "torch"), ("adamw_fused", "torch"), ("sgd", "triton"), ("adamw_fused", "triton")]
)
def test_norm_clip_matches_amp_optim_wrapper(monkeypatch, kind, backend):
    torch_clips = _Calls(torch.nn.utils.clip_grad_norm_)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", torch_clips)  # OptimWrapper binds it in __init__
    theirs = _train(lambda opt, **kw: _torch_wrapper(monkeypatch, opt, **kw), kind)
    assert torch_clips.count == UPDATES

    fused_clips = {}

    def make(opt, **kw):
        wrapper = _fused_wrapper(opt, backend, **kw)
        fused_clips["spy"] = wrapper.loss_scaler.clip_grad_norm_ = _Calls(wrapper.loss_scaler.clip_grad_norm_)
        return wrapper

    ours = _train(make, kind)
    _assert_same_run(ours, theirs)
    assert ours[1] == [u in (INF_UPDATE, NAN_UPDATE) for u in range(UPDATES)]
    assert ours[0][1] == 2 * INIT_SCALE and ours[0][INF_UPDATE] < ours[0][INF_UPDATE - 1]  # growth, backoff
    # The fused clip ran once per update and torch's never did; the logged norms agree.
    assert fused_clips["spy"].count == UPDATES and torch_clips.count == UPDATES
    good = [u for u in range(UPDATES) if u not in (INF_UPDATE, NAN_UPDATE)]
    torch.testing.assert_close(torch.tensor(ours[3][good]), torch.tensor(theirs[3][good]), rtol=1e-5, atol=0)
    assert (theirs[3][good] > CLIP).all()  # clipping was active
    assert not torch.isfinite(torch.tensor(ours[3][[INF_UPDATE, NAN_UPDATE]])).any()


@pytest.mark.parametrize(
    "clip_grad",
    [dict(type="value", clip_value=0.01), dict(max_norm=CLIP, norm_type=3.0), dict(max_norm=CLIP, norm_type="inf")],
    ids=["value", "norm3", "norm_inf"],
)
def test_other_clips(monkeypatch, clip_grad):
    """value and p=3 run mmengine's own step on our scaler; inf (a string, as torch takes it) is fused."""
    fused = clip_grad.get("norm_type") == "inf"
    theirs = _train(lambda opt, **kw: _torch_wrapper(monkeypatch, opt, **kw), clip_grad=clip_grad)
    calls = {}

    def make(opt, **kw):
        wrapper = _fused_wrapper(opt, **kw)
        calls["spy"] = wrapper.loss_scaler.clip_grad_norm_ = _Calls(wrapper.loss_scaler.clip_grad_norm_)
        return wrapper

    ours = _train(make, clip_grad=clip_grad)
    _assert_same_run(ours, theirs)
    assert calls["spy"].count == (UPDATES if fused else 0)


def test_static_loss_scale(monkeypatch):
    # loss_scale=<float>: mmengine resets the scale with update(new_scale) after every step.
    theirs = _train(lambda opt, **kw: _torch_wrapper(monkeypatch, opt, loss_scale=512.0, **kw))
    ours = _train(lambda opt, **kw: _fused_wrapper(opt, loss_scale=512.0, **kw))
    _assert_same_run(ours, theirs)
    assert ours[0] == [512.0] * UPDATES and sum(ours[1]) == 2


def test_registry_config_and_checkpoint(monkeypatch):
    model = torch.nn.Linear(4, 2)
    cfg = dict(
        type="FusedClipAmpOptimWrapper",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        clip_grad=dict(max_norm=1.0),
        loss_scale=dict(init_scale=256.0, backend="torch"),
        dtype="bfloat16",
    )
    wrapper = OPTIM_WRAPPERS.build(cfg)  # no GPU needed
    assert type(wrapper) is FusedClipAmpOptimWrapper and isinstance(wrapper, AmpOptimWrapper)
    assert wrapper.cast_dtype is torch.bfloat16 and wrapper.loss_scaler.get_scale() == 256.0
    with wrapper.optim_context(model):
        loss = model(torch.randn(3, 4)).float().square().mean()
    wrapper.update_params(loss)
    # Our checkpoint loads into mmengine's AmpOptimWrapper and back (the scaler under "loss_scaler").
    state = wrapper.state_dict()
    theirs = _torch_wrapper(monkeypatch, torch.optim.SGD(model.parameters(), lr=0.1))
    theirs.load_state_dict(state)
    assert theirs.loss_scaler.get_scale() == 256.0
    back = _fused_wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    back.load_state_dict(theirs.state_dict())
    assert back.loss_scaler.get_scale() == 256.0
    with pytest.raises(ValueError, match="use_fsdp"):
        FusedClipAmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), use_fsdp=True)


def test_runner_config_by_name_matches_amp_optim_wrapper(monkeypatch, tmp_path):
    """A tiny Runner: ours selected by name in the config against an AmpOptimWrapper instance."""

    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    hide_broken_torchvision(monkeypatch)

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
            self.calls = 0

        def forward(self, inputs, labels, mode="tensor"):
            out = self.net(inputs)
            if mode != "loss":
                return out
            self.calls += 1
            loss = torch.nn.functional.mse_loss(out.float(), labels)
            return {"loss": loss * float("inf") if self.calls == 3 else loss}

    class Record(Hook):
        def __init__(self):
            self.scales = []

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.scales.append(runner.optim_wrapper.loss_scaler.get_scale())

    def run(name, optim_wrapper):
        torch.manual_seed(0)
        model = Net()
        data = [(torch.randn(16), torch.randn(4)) for _ in range(48)]
        record = Record()
        runner = Runner(
            model=model,
            work_dir=str(tmp_path / name),
            experiment_name=name,
            train_dataloader=dict(
                dataset=data,
                sampler=dict(type="DefaultSampler", shuffle=False),
                batch_size=8,
                collate_fn=dict(type="default_collate"),
            ),
            train_cfg=dict(by_epoch=False, max_iters=6),
            optim_wrapper=optim_wrapper(model),
            default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=3, by_epoch=False)),
            custom_hooks=[record],
            log_level="WARNING",
        )
        runner.train()
        return record.scales, [p.detach().clone() for p in model.parameters()], runner

    clip = dict(max_norm=CLIP)
    loss_scale = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    t_scales, t_params, _ = run(
        "torch",
        lambda m: _torch_wrapper(monkeypatch, torch.optim.SGD(m.parameters(), lr=0.1), clip_grad=dict(clip)),
    )
    fused = _Calls(FusedClipAmpOptimWrapper.step)
    monkeypatch.setattr(FusedClipAmpOptimWrapper, "step", lambda self, **kw: fused(self, **kw))
    cfg = dict(type="FusedClipAmpOptimWrapper", optimizer=dict(type="SGD", lr=0.1), clip_grad=clip)
    scales, params, runner = run("ours", lambda m: dict(cfg, loss_scale=dict(loss_scale, backend="torch")))
    assert type(runner.optim_wrapper) is FusedClipAmpOptimWrapper and runner.optim_wrapper._fused_clip
    assert fused.count == 6
    assert scales == t_scales and scales[2] < scales[1]  # the inf iteration backed off
    for p, t in zip(params, t_params):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
    saved = torch.load(tmp_path / "ours" / "iter_6.pth", weights_only=False)["optimizer"]["loss_scaler"]
    assert saved["scale"] == scales[-1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fold_step_reads_nothing_on_the_host(forbid_host_reads, backend):
    # With a fused optimizer and log_grad_norm=False, update_params ends on the fused pass and the
    # optimizer's device-side skip: no device value is read on the host.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    wrapper = _fused_wrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), backend, clip_grad=dict(max_norm=0.1)
    )
    wrapper.log_grad_norm = False
    for bad in (False, True, False):
        loss = model(torch.randn(3, 8)).square().mean() * (float("inf") if bad else 1.0)
        forbid_host_reads.on = True
        wrapper.update_params(loss)
        forbid_host_reads.on = False
    assert int(wrapper.loss_scaler.stats()["skipped_steps"]) == 1


def _linear_lr(optimizer):
    """mmengine's iteration-based LinearLR (the rate changes on every iteration)."""
    from mmengine.optim import LinearLR

    return LinearLR(optimizer, start_factor=0.1, by_epoch=False, begin=0, end=skip_truth.STEPS)


@pytest.mark.parametrize("case", skip_truth.SKIP_CASES)
def test_runner_param_schedulers_advance_only_on_applied_steps(monkeypatch, tmp_path, case):
    """A Runner with an iteration-based LinearLR: FusedClipParamSchedulerHook steps it on applied steps."""

    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    hide_broken_torchvision(monkeypatch)

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(6, 3)

        def forward(self, inputs, labels, mode="tensor"):
            out = self.net(inputs)
            return {"loss": torch.nn.functional.mse_loss(out.float(), labels)} if mode == "loss" else out

    class Record(Hook):  # NORMAL priority: runs before the scheduler hook (LOW)
        def __init__(self, truth):
            self.truth, self.signal, self.lrs = truth, [], []

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            self.truth.before()
            self.lrs.append(runner.optim_wrapper.optimizer.param_groups[0]["lr"])

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.truth.after()
            self.signal.append(runner.optim_wrapper.applied_steps.skipped())

    torch.manual_seed(0)
    model = Net()
    injector = skip_truth.GradInjector(model.net.weight, skip_truth.injected_kind(case))  # noqa: F841
    wrapper = FusedClipAmpOptimWrapper(
        optimizer=skip_truth.make_optimizer(case, model.parameters()),
        loss_scale=dict(skip_truth.scaler_kwargs(case), backend="torch", device="cpu"),
        clip_grad=dict(max_norm=1.0),
        log_grad_norm=False,
    )
    record = Record(skip_truth.Truth(model))
    runner = Runner(
        model=model,
        work_dir=str(tmp_path),
        train_dataloader=dict(
            dataset=[(torch.randn(6), torch.randn(3)) for _ in range(8 * skip_truth.STEPS)],
            sampler=dict(type="DefaultSampler", shuffle=False),
            batch_size=8,
            collate_fn=dict(type="default_collate"),
        ),
        train_cfg=dict(by_epoch=False, max_iters=skip_truth.STEPS),
        optim_wrapper=wrapper,
        param_scheduler=dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=skip_truth.STEPS),
        default_hooks=dict(checkpoint=None, param_scheduler=dict(type="FusedClipParamSchedulerHook")),
        custom_hooks=[record],
        log_level="WARNING",
    )
    runner.train()
    skipped = record.truth.skipped
    assert skipped == [s in skip_truth.INJECTED for s in range(skip_truth.STEPS)]
    assert record.signal == skipped
    oracle_opt = skip_truth.make_optimizer(case, [torch.zeros(1, requires_grad=True)])
    oracle = _linear_lr(oracle_opt)
    expected = skip_truth.lrs_on_applied_steps(skipped, lambda: oracle_opt.param_groups[0]["lr"], oracle.step)
    assert record.lrs + [wrapper.optimizer.param_groups[0]["lr"]] == expected
