"""What a captured step relies on, on the CPU: the gradient watch (loop/captured_step.py) and the
refusals inside a capture (``host_reads.refuse_in_capture``), the capture stood in for by turning
the one switch on (``host_reads.capturing``). The capture and replays themselves: tests/test_gpu.py."""

from __future__ import annotations

import copy
import gc
import re

import pytest
import torch

import tritonscale
from tritonscale import host_reads
from tritonscale.loop.captured_step import CapturedStep, CaptureWatch


def _setup(**knobs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True, capturable=True)
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, compile_policy=False, **knobs)
    return model, opt, scaler


def _backward(model, scaler, set_to_none=False):
    for p in model.parameters():
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    x = torch.randn(4, 8, dtype=next(model.parameters()).dtype)
    scaler.scale(model(x).square().mean()).backward()


def _post_backward(opt, scaler):
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def _grad_of(model, i=0):
    return list(model.parameters())[i].grad


def _set_lr_in_place(model, opt):
    opt.param_groups[0]["lr"].fill_(0.5)


def _flatten_again(model, opt):
    tritonscale.flatten_grads_(model.parameters())


def _drop_grads(model, opt):
    opt.zero_grad(set_to_none=True)


def _data_assigned(model, opt):
    _grad_of(model).data = torch.zeros_like(_grad_of(model))


def _set_elsewhere(model, opt):
    _grad_of(model).set_(torch.zeros_like(_grad_of(model)))


def _set_flat(model, opt):  # the same bytes in the same order: what an elementwise step reads is unchanged
    g = _grad_of(model)
    g.set_(g.untyped_storage(), g.storage_offset(), (g.numel(),), (1,))


def _transposed(model, opt):  # the same bytes, read in another order
    _grad_of(model).t_()


def _read_as_int32(model, opt):  # the same memory, read as another dtype
    _grad_of(model).data = _grad_of(model).view(torch.int32)


def _to_float64(model, opt):
    model.to(torch.float64)


def _load_state(model, opt):
    opt.load_state_dict(opt.state_dict())


def _state_entry_set(model, opt):
    state = opt.state[next(model.parameters())]
    state["exp_avg"] = torch.zeros_like(state["exp_avg"])


def _state_relaid(model, opt):
    state = opt.state[next(model.parameters())]
    state["exp_avg"].data = torch.zeros_like(state["exp_avg"])


def _add_param_group(model, opt):
    extra = torch.nn.Parameter(torch.zeros(3))
    extra.grad = torch.zeros(3)
    opt.add_param_group({"params": [extra]})


def _lr_replaced(model, opt):
    opt.param_groups[0]["lr"] = torch.tensor(0.5)


def _weight_decay_set(model, opt):
    opt.param_groups[0]["weight_decay"] = 0.5


def _grad_appears(model, opt):  # the last bias had none at the capture; a backward makes one
    pass


#: (layout, move, a backward after it, what the watch says; None: an ordinary loop, nothing moved).
MOVES = [
    pytest.param("plain", None, True, None, id="plain-zero_grad(set_to_none=False)"),
    pytest.param("flat", None, True, None, id="flat-views-reused"),
    pytest.param("plain", _set_lr_in_place, True, None, id="plain-lr-fill_"),
    pytest.param("plain", _drop_grads, True, "gradient is a new tensor", id="plain-set_to_none-backward"),
    pytest.param("flat", _drop_grads, True, "gradient is a new tensor", id="flat-set_to_none-backward"),
    pytest.param("plain", _drop_grads, False, "gradient is None", id="plain-set_to_none"),
    pytest.param("flat", _flatten_again, True, "gradient is a new tensor", id="flat-flatten_grads_-again"),
    pytest.param("plain", _flatten_again, True, "gradient is a new tensor", id="plain-flatten_grads_"),
    pytest.param("plain", _data_assigned, True, "parameter 0's gradient has a new address", id="plain-grad.data="),
    pytest.param("flat", _data_assigned, True, "parameter 0's gradient has a new address", id="flat-grad.data="),
    pytest.param("flat", _set_elsewhere, True, "parameter 0's gradient has a new address", id="flat-grad.set_"),
    pytest.param("plain", _set_flat, False, None, id="plain-grad.set_-same-bytes"),
    pytest.param("plain", _transposed, False, "parameter 0's gradient has a new contiguity", id="plain-grad.t_"),
    pytest.param("plain", _read_as_int32, False, "parameter 0's gradient has a new dtype", id="plain-grad.data=-view"),
    pytest.param("plain", _to_float64, True, "parameter 0 has a new address", id="plain-model.to(float64)"),
    pytest.param("flat", _to_float64, True, "parameter 0 has a new address", id="flat-model.to(float64)"),
    pytest.param("plain", _load_state, False, "parameter 0's optimizer state was replaced", id="load_state_dict"),
    pytest.param("plain", _state_entry_set, False, "parameter 0's optimizer state was replaced", id="state-entry-set"),
    pytest.param("plain", _state_relaid, False, "parameter 0's state 'exp_avg' has a new address", id="state.data="),
    pytest.param("plain", _add_param_group, False, "has 5 parameters, 4 at the capture", id="add_param_group"),
    pytest.param("plain", _lr_replaced, False, "param group 0's 'lr' changed", id="lr-replaced"),
    pytest.param("plain", _weight_decay_set, False, "param group 0's 'weight_decay' changed", id="weight_decay-set"),
    pytest.param("plain", _grad_appears, True, "parameter 3 has a gradient, none at the capture", id="grad-appears"),
]


def _warmed_up(layout, move):
    """Two whole steps (the warm-up), then the state a capture would see."""
    model, opt, scaler = _setup()
    if layout == "flat":
        tritonscale.flatten_grads_(model.parameters())
    for _ in range(2):
        _backward(model, scaler)
        _post_backward(opt, scaler)
    if move is _grad_appears:
        list(model.parameters())[3].grad = None
    return model, opt, scaler


@pytest.mark.parametrize("layout, move, backward, says", MOVES)
def test_the_watch_sees_each_move_and_only_a_move(layout, move, backward, says):
    """Whole ordinary steps (the scaler's passes, fused AdamW, gradients zeroed in place, a flat
    buffer's views reused, an lr tensor changed in place) move nothing; each way of replacing
    what the step reads -- a gradient, a parameter, a state tensor or dict, a param group, its
    settings -- is seen (even where the scaler's own cache holds the old gradients alive), and
    named."""
    model, opt, scaler = _warmed_up(layout, move)
    watch = CaptureWatch([opt])
    _backward(model, scaler)
    _post_backward(opt, scaler)
    if move is not None:
        move(model, opt)
    if backward:
        _backward(model, scaler)
    gc.collect()
    assert watch.moved == (says is not None)
    assert watch.what_moved() is None if says is None else says in watch.what_moved()


def test_a_tensor_strided_at_the_capture_is_watched_by_its_strides():
    """Not contiguous at the capture: its shape and strides are part of what a replay relies on."""
    p = torch.nn.Parameter(torch.zeros(4, 6))
    p.grad = torch.zeros(6, 4).t()
    watch = CaptureWatch([torch.optim.SGD([p], lr=0.1)])
    p.grad.add_(1.0)
    assert not watch.moved
    p.grad.as_strided_((6, 4), (1, 6))  # the same bytes, read in another order: still not contiguous
    assert watch.moved
    says = "parameter 0's gradient has a new shape (torch.Size([4, 6]) at the capture, torch.Size([6, 4]) now)"
    assert watch.what_moved() == f"optimizer 0 (SGD), {says}"


def test_the_watch_keeps_the_captured_memory():
    """Until a recapture, the storages the graph writes stay out of the allocator's hands."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    watch = CaptureWatch([torch.optim.SGD([p], lr=0.1)])
    address = p.grad.data_ptr()
    p.grad = None
    gc.collect()
    assert watch.moved and address in [s.data_ptr() for s in watch.keep]


def test_a_step_without_gradients_is_refused_at_capture():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="hold no gradients; capture after a backward"):
        CaptureWatch([torch.optim.SGD([p], lr=0.1)])


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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


def _everything(model, opt, scaler) -> list[torch.Tensor]:
    """Parameters, gradients, the optimizer's state and the scaler's, as copies."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [scaler._scale, scaler._growth_tracker, scaler._counters]
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("layout, move, backward, says", MOVES)
def test_a_replay_after_a_move_is_refused_changing_nothing(layout, move, backward, says, fake_cuda_graphs):
    """CapturedStep's calls after the capture: each move refuses the next call before anything is
    replayed, naming what moved and the fix; nothing changes (parameters, gradients, optimizer and
    scaler state bitwise; no replay). An ordinary loop replays."""
    model, opt, scaler = _warmed_up(layout, move)
    step = tritonscale.CapturedStep(lambda: _post_backward(opt, scaler), opt, warmup=1)
    for i in range(2):  # the warm-up, the capture (and its replay)
        _backward(model, scaler)
        if i == 1 and move is _grad_appears:
            list(model.parameters())[3].grad = None
        step()
    assert step.graph.replays == 1
    if move is not None:
        move(model, opt)
    if backward:
        _backward(model, scaler)
    gc.collect()
    if says is None:
        step()
        assert step.graph.replays == 2
        return
    before = _everything(model, opt, scaler)
    refusal = rf"moved since its capture: .*{re.escape(says)}.*recapture\(\).*Nothing was replayed"
    with pytest.raises(RuntimeError, match=refusal):
        step()
    assert step.graph.replays == 1
    after = _everything(model, opt, scaler)
    assert len(before) == len(after) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))


def _model_and_opt():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True, capturable=True)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda m, o: (None, m), TypeError, r"step_fn must be a function of no arguments .*got NoneType"),
        (lambda m, o: (lambda: None, m.parameters()), TypeError, r"got a generator \(model.parameters\(\)\?\)"),
        (lambda m, o: (lambda: None, m), TypeError, r"got Linear\. Pass the optimizer\(s\)"),
        (lambda m, o: (lambda: None, list(m.parameters())), TypeError, r"got Parameter\. Pass the optimizer"),
        (lambda m, o: (lambda: None, [o, m]), TypeError, r"got Linear\. Pass the optimizer"),
        (lambda m, o: (lambda batch: None, o), TypeError, r"called with no arguments.*requires batch.*lambda:"),
        (lambda m, o: (lambda: None, []), ValueError, r"no optimizer given"),
    ],
    ids=["step_fn-None", "parameters()", "a-module", "a-list", "a-module-in-the-list", "step_fn-args", "none"],
)
def test_what_is_no_step_or_no_optimizer_is_refused_at_construction(make, error, match, fake_cuda_graphs):
    """Found when the CapturedStep is made, not at the capture after the warm-up."""
    model, opt = _model_and_opt()
    with pytest.raises(error, match=match):
        tritonscale.CapturedStep(*make(model, opt))


def test_without_cuda_construction_is_refused(monkeypatch):
    model, opt = _model_and_opt()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs CUDA.*is_available\(\) is False.*call the step function itself"):
        tritonscale.CapturedStep(lambda: None, opt)


class _Wrapper:
    """An optimizer wrapper as frameworks hand them out (the real optimizer in ``.optimizer``)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def step(self, *args, **kwargs):
        return self.optimizer.step(*args, **kwargs)


def _two_groups_second_not_capturable(params):
    opt = torch.optim.AdamW(params[:2], lr=torch.tensor(0.01), fused=True, capturable=True)
    opt.add_param_group({"params": params[2:], "capturable": False})
    return opt


#: Optimizer kinds, the fix a refusal names (None: it can be captured), and whether the oracle
#: warms up with an eager step first: torch's non-fused steps with capturable=True run on an
#: accelerator only, and their capture fails earlier, at the scaler's host read of the skip.
KINDS = [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01), fused=True, capturable=True), None, True,
                 id="AdamW-fused-capturable"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), fused=True, capturable=True), None, True,
                 id="Adam-fused-capturable"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), None, True, id="SGD-fused"),
    pytest.param(lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True), None, True, id="Adagrad-fused"),
    pytest.param(lambda ps: _Wrapper(torch.optim.AdamW(ps, lr=torch.tensor(0.01), fused=True, capturable=True)),
                 None, True, id="a-wrapper"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
                 r"group\(s\) \[0\] have capturable=False.*Make it with capturable=True", True, id="AdamW-fused"),
    pytest.param(_two_groups_second_not_capturable, r"group\(s\) \[1\] have capturable=False", True,
                 id="a-group-without"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.01, capturable=True),
                 r"plain one.*host read.*Make it with Adam\(\.\.\., fused=True, capturable=True\)$",
                 False, id="Adam-capturable"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.01), r"capturable=False.*and its step is a plain one", True,
                 id="AdamW"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 r"plain one.*Make it with SGD\(\.\.\., fused=True\)$", True, id="SGD"),
    pytest.param(lambda ps: torch.optim.Adagrad(ps, lr=0.1), r"plain one.*Make it with Adagrad\(\.\.\., fused=True\)$",
                 True, id="Adagrad"),
    pytest.param(lambda ps: torch.optim.RMSprop(ps, lr=0.01, capturable=True),
                 r"plain one.*Use an optimizer with a fused step: torch's Adam or AdamW \(fused=True, capturable=True",
                 False, id="RMSprop-capturable"),
]  # fmt: skip


class _CapturingStream:
    def is_capturing(self) -> bool:
        return True


def _raises_inside_a_capture(opt, model, monkeypatch, forbid_host_reads, warm_up) -> bool:
    """The oracle: after an eager warm-up step, does the scaler's post-backward step raise inside
    a capture, as torch's own check sees one (``_accelerator_graph_capture_health_check``: a CUDA
    accelerator whose stream is capturing), on the paths a GPU takes with every host read an error?"""
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, compile_policy=False)
    if warm_up:
        _backward(model, scaler)
        _post_backward(opt, scaler)
    _backward(model, scaler)
    with monkeypatch.context() as m:
        m.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        m.setattr(torch.accelerator, "current_stream", lambda device=None: _CapturingStream())
        m.setattr(host_reads, "capturing", lambda device: True)
        try:
            with forbid_host_reads.armed():
                _post_backward(opt, scaler)
        except (RuntimeError, AssertionError):
            return True
    return False


@pytest.mark.parametrize("make, fix, warm_up", KINDS)
def test_construction_refuses_exactly_the_optimizers_whose_step_cannot_be_captured(
    make, fix, warm_up, monkeypatch, forbid_host_reads, fake_cuda_graphs
):
    """CapturedStep refuses an optimizer, naming the fix, exactly where the step it captures would
    fail inside a capture: torch's own check (capturable=False, fused or not) or the scaler's host
    read of the skip (a plain step). Nothing changes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = make(list(model.parameters()))
    assert _raises_inside_a_capture(opt, model, monkeypatch, forbid_host_reads, warm_up) == (fix is not None)
    before = copy.deepcopy(opt.state_dict()) if fix is not None else None
    if fix is None:
        tritonscale.CapturedStep(lambda: None, opt)
        return
    with pytest.raises(RuntimeError, match=fix):
        tritonscale.CapturedStep(lambda: None, opt)
    after = opt.state_dict()
    assert str(after) == str(before)


def test_a_step_that_moves_what_it_reads_while_captured_is_refused(fake_cuda_graphs):
    """A capture whose own Python replaces what the graph reads (here a setting; in practice state
    made at a first step) leaves no graph, naming the fix: more warm-up steps."""
    model, opt, scaler = _setup()

    def post_backward():
        _post_backward(opt, scaler)
        opt.param_groups[0]["weight_decay"] += 0.001

    step = tritonscale.CapturedStep(post_backward, opt, warmup=1)
    _backward(model, scaler)
    step()
    _backward(model, scaler)
    with pytest.raises(RuntimeError, match=r"moved what it reads while it was captured: .*'weight_decay'.*warmup="):
        step()
    assert step.graph is None
