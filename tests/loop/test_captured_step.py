"""What a captured step relies on, on the CPU: the gradient watch (loop/captured_step.py) and the
refusals inside a capture (``host_reads.refuse_in_capture``), the capture stood in for by turning
the one switch on (``host_reads.capturing``). The capture and replays themselves: tests/test_gpu.py."""

from __future__ import annotations

import gc

import pytest
import torch

import tritonscale
from tritonscale import host_reads
from tritonscale.loop.captured_step import CapturedStep, GradWatch


def _setup(**knobs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, compile_policy=False, **knobs)
    return model, opt, scaler


def _backward(model, scaler, set_to_none=False):
    for p in model.parameters():
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()


def _post_backward(opt, scaler):
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("move", ["kept", "set_to_none", "flatten_again"])
def test_the_watch_sees_gradients_move_and_only_then(move):
    """Gradients kept in place through whole steps (the scaler's passes, fused AdamW) are not
    'moved'; set to None and re-made by backward, or re-laid into a new flat buffer, they are."""
    model, opt, scaler = _setup()
    if move == "flatten_again":
        tritonscale.flatten_grads_(model.parameters())
    _backward(model, scaler)
    _post_backward(opt, scaler)
    watch = GradWatch([opt])
    for _ in range(2):
        _backward(model, scaler, set_to_none=move == "set_to_none")
        _post_backward(opt, scaler)
        if move == "flatten_again":
            tritonscale.flatten_grads_(model.parameters())
    gc.collect()
    assert watch.moved == (move != "kept")


def test_the_watch_keeps_the_captured_memory():
    """Until the move is seen, the storage the graph writes stays out of the allocator's hands."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    watch = GradWatch([torch.optim.SGD([p], lr=0.1)])
    address = p.grad.data_ptr()
    p.grad = None
    gc.collect()
    assert watch.moved and watch.keep[0].data_ptr() == address


def test_a_step_without_gradients_is_refused_at_capture():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="hold no gradients; capture after a backward"):
        GradWatch([torch.optim.SGD([p], lr=0.1)])


@pytest.mark.parametrize("warmup", [0, -1, True, 1.5])
def test_a_bad_warmup_is_refused(warmup):
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(lambda: None, [], warmup=warmup)


@pytest.fixture
def capturing(monkeypatch):
    """The GPU paths, inside a (stand-in) capture."""
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    monkeypatch.setattr(host_reads, "capturing", lambda device: True)


def _state(model, opt, scaler) -> list[torch.Tensor]:
    return [t.clone() for t in (*model.parameters(), *(p.grad for p in model.parameters()), scaler._scale,
                                scaler._growth_tracker, scaler._counters)]  # fmt: skip


@pytest.mark.parametrize(
    "knobs, match",
    [
        (dict(max_consecutive_skips=3), "checks on the host"),
        (dict(min_scale=1.0, on_min_scale="warn"), "checks on the host"),
        (dict(raise_at_scale=1.0), "checks on the host"),
    ],
    ids=["max_consecutive_skips", "on_min_scale=warn", "raise_at_scale"],
)
def test_host_checks_are_refused_inside_a_capture_changing_nothing(knobs, match, monkeypatch):
    """update() with a check that reads the host (and skips reads on a Python bound that a replay
    would not advance) is refused in a capture, naming the fix, before anything changes."""
    model, opt, scaler = _setup(**knobs)
    _backward(model, scaler)
    _post_backward(opt, scaler)
    _backward(model, scaler)
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    before = _state(model, opt, scaler)
    monkeypatch.setattr(host_reads, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=f"{match}.*cannot be captured.*on_min_scale='clamp'"):
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt, scaler)))


def test_a_python_found_inf_is_refused_inside_a_capture(capturing):
    model, opt, scaler = _setup()
    _backward(model, scaler)
    with pytest.raises(RuntimeError, match=r"found_inf=<a Python bool>.*0-dim device tensor"):
        scaler.update(found_inf=True)


def test_a_float_lr_schedule_is_refused_inside_a_capture(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tritonscale.GradScaler("cpu")
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), scaler, total_steps=3)
    monkeypatch.setattr(host_reads, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"float lr.*lr=torch.tensor"):
        sched.step()
    assert sched.state_dict() == {"applied_steps": torch.tensor(0), "calls": 0}
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("helper", ["StepLog", "AppliedSteps"])
def test_host_side_logs_are_refused_inside_a_capture(helper, capturing):
    """StepLog's ring slot and pending rows, AppliedSteps' cached flag: host state a replay would
    not advance. Refused, naming the fix (record after each replay), the log unchanged."""
    model, opt, scaler = _setup()
    _backward(model, scaler)
    _post_backward(opt, scaler)
    log = tritonscale.StepLog() if helper == "StepLog" else tritonscale.AppliedSteps()
    with pytest.raises(RuntimeError, match=rf"{helper}.record cannot be captured.*after each graph.replay"):
        log.record(scaler)
    assert (len(log) == 0) if helper == "StepLog" else (log._flag is None)


def test_skip_aware_lr_counts_its_calls_on_the_device():
    """Replays of a captured SkipAwareLR.step() advance its calls (checkpointed) as eager calls do:
    the count is a device tensor updated in place, the same tensor at every step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1), fused=True)
    scaler = tritonscale.GradScaler("cpu")
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), scaler, total_steps=3)
    calls = sched._calls
    assert isinstance(calls, torch.Tensor)
    sched.step()
    assert sched._calls is calls and int(calls) == 1 and sched.state_dict()["calls"] == 1


class _FakeGraph:
    """Stands for torch.cuda.CUDAGraph on the CPU: counts replays (a replay runs no Python)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """torch.cuda's streams and graphs stood in for on the CPU; ``events`` lists what ran where."""
    import contextlib

    events = []

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    @contextlib.contextmanager
    def on(kind):
        events.append(f"{kind} begins")
        yield
        events.append(f"{kind} ends")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: on("side stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kwargs: on("capture"))
    return events


def test_the_captured_step_warms_up_captures_replays_and_refuses_moved_grads(fake_cuda_graphs):
    """tritonscale.CapturedStep's calls: ``warmup`` eager steps on a side stream, then one capture
    (by torch.cuda.graph, no stream=) replayed once, then replays only; gradients dropped since the
    capture are refused before any replay, naming the fix; recapture() warms up once and captures again."""
    events = fake_cuda_graphs
    model, opt, scaler = _setup()
    ran = []

    def post_backward():
        ran.append(len(events))
        _post_backward(opt, scaler)

    step = tritonscale.CapturedStep(post_backward, opt, warmup=2)
    for _ in range(4):
        _backward(model, scaler)
        step()
    assert events == ["side stream begins", "side stream ends"] * 2 + ["capture begins", "capture ends"]
    assert len(ran) == 3 and step.graph.replays == 2  # two warm-ups, the capture; replays: the capture's and one
    _backward(model, scaler, set_to_none=True)
    gc.collect()
    with pytest.raises(RuntimeError, match="moved since its capture.*recapture"):
        step()
    assert step.graph.replays == 2  # nothing replayed
    step.recapture()
    for _ in range(2):
        _backward(model, scaler)
        step()
    assert len(ran) == 5 and events[-4:] == ["side stream begins", "side stream ends", "capture begins", "capture ends"]
    assert step.graph.replays == 1
