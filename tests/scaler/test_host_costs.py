"""What a step pays on the host: a single process no rank checks, while everything a caller keeps
is a new value each step.

Oracles: torch.amp.GradScaler with torch.nn.utils.clip_grad_norm_ on a twin of the same model (the
norms, the parameters), and the count of update() calls (the iteration count). No timings: the
structure that costs the time is what is checked.
"""

from __future__ import annotations

import pickle
import threading

import torch

import tritonscale
import tritonscale.scaler.grad_scaler as grad_scaler_module
from tritonscale.passes.backends import torch_backend
from tritonscale.passes.rank_validation import RankChecks

STEPS = 10


def _model_and_data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(33, generator=g)), torch.nn.Parameter(torch.randn(4, 5, generator=g))]
    xs = [(torch.randn(33, generator=g), torch.randn(4, 5, generator=g)) for _ in range(STEPS)]
    return params, xs


def _loss(params, x):
    return sum((p * xi).square().sum() for p, xi in zip(params, x))


def _run(kind: str, optimizer_cls, clip: bool, **opt_kw):
    """STEPS whole scaled steps (scale, backward, clip or unscale_, step, update, zero_grad): the
    parameters and the clip's norms as returned, each kept from its own step."""
    params, xs = _model_and_data()
    opt = optimizer_cls(params, lr=0.1, **opt_kw)
    if kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    else:
        scaler = tritonscale.GradScaler("cpu", init_scale=2.0**8, backend="torch")
    norms = []
    for x in xs:
        scaler.scale(_loss(params, x)).backward()
        if kind == "torch":
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0) if clip else None
        else:
            norm = scaler.clip_grad_norm_(opt, 1.0) if clip else scaler.unscale_(opt)
        norms.append(norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return params, norms, scaler


def test_a_single_process_step_makes_no_rank_check(monkeypatch):
    """Without a process group no combine runs, so nothing of the rank checks may run either: no
    Agreement row is made (clip_grad_norm_, unscale_, a fused step's check), no stamp taken. The
    iteration count still counts every update(), and travels with a pickle."""
    made = []

    class CountedAgreement(grad_scaler_module.Agreement):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("kind", args[2] if len(args) > 2 else "flags"))
            super().__init__(*args, **kwargs)

    def no_stamp(*args, **kwargs):
        raise AssertionError("a single process made a rank row")

    monkeypatch.setattr(grad_scaler_module, "Agreement", CountedAgreement)
    monkeypatch.setattr(RankChecks, "stamp", no_stamp)
    runs = [(torch.optim.AdamW, True, {"fused": True}), (torch.optim.SGD, True, {}), (torch.optim.SGD, False, {}),
            (torch.optim.Adam, False, {"fused": True})]  # fmt: skip
    for optimizer_cls, clip, kw in runs:
        ours, _, scaler = _run("ours", optimizer_cls, clip, **kw)
        theirs, _, _ = _run("torch", optimizer_cls, clip, **kw)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert int(scaler._ranks.iteration) == STEPS
        assert int(pickle.loads(pickle.dumps(scaler))._ranks.iteration) == STEPS
    assert made == [], f"rank agreements made in a single process: {sorted(set(made))}"


def test_each_steps_norm_is_a_new_value_that_keeps(monkeypatch):
    """The torch backend's clip hands each step's norm out as a new tensor that keeps its value
    after later steps (torch's norms, step by step)."""
    ours, our_norms, _ = _run("ours", torch.optim.AdamW, True, fused=True)
    theirs, torch_norms, _ = _run("torch", torch.optim.AdamW, True, fused=True)
    assert len({id(n) for n in our_norms}) == STEPS
    torch.testing.assert_close(torch.stack(our_norms), torch.stack(torch_norms), rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_two_threads_clipping_at_once_each_get_their_own_factor(monkeypatch):
    """A clip in another thread that runs between this thread's check and its multiply (the GIL lets
    it, torch ops release it) must not hand this clip its factor.
    Thread B's whole clip (another model, another scale) runs exactly there; each thread's
    parameters must still be torch's."""
    multiply, main = torch_backend._multiply_, threading.main_thread()
    other = {}

    def other_thread_clips_first(grads, factor):
        if threading.current_thread() is main and not other:
            worker = threading.Thread(target=lambda: other.update(run=_run_scaled(2.0**4)))
            worker.start()
            worker.join()
        return multiply(grads, factor)

    monkeypatch.setattr(torch_backend, "_multiply_", other_thread_clips_first)
    ours = _run_scaled(2.0**8, steps=1)
    monkeypatch.setattr(torch_backend, "_multiply_", multiply)
    for a, b in zip(ours, _run_scaled(2.0**8, steps=1, kind="torch")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(other["run"], _run_scaled(2.0**4, kind="torch")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _run_scaled(init_scale: float, steps: int = STEPS, kind: str = "ours"):
    """``steps`` clipped SGD steps at ``init_scale``: the parameters after."""
    params, xs = _model_and_data()
    opt = torch.optim.SGD(params, lr=0.1)
    if kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    else:
        scaler = tritonscale.GradScaler("cpu", init_scale=init_scale, backend="torch")
    for x in xs[:steps]:
        scaler.scale(_loss(params, x)).backward()
        if kind == "torch":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return params


def test_a_single_process_update_makes_no_context_to_undo_it(monkeypatch):
    """Without a pending rank mismatch (a single process never has one) update() has nothing to
    undo: its rule runs in one shared do-nothing context, and no save-and-restore context is made
    per step (``RankChecks.unchanged_if_mismatched`` is never asked). The steps stay torch's, and
    the iteration count counts every update()."""
    asked = []
    undo_context = RankChecks.unchanged_if_mismatched

    def counted(self, state):
        asked.append(state)
        return undo_context(self, state)

    monkeypatch.setattr(RankChecks, "unchanged_if_mismatched", counted)
    ours, our_norms, scaler = _run("ours", torch.optim.AdamW, True, fused=True)
    theirs, torch_norms, _ = _run("torch", torch.optim.AdamW, True, fused=True)
    assert asked == [] and scaler._ranks.pending is None
    assert int(scaler._ranks.iteration) == STEPS
    torch.testing.assert_close(torch.stack(our_norms), torch.stack(torch_norms), rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_plain_step_after_the_clip_skips_and_backs_off_as_torchs():
    """A plain step after the clip holds its skip as a new float32 0/1 tensor each step, and an
    overflow step skips and backs off as torch's does."""
    params, xs = _model_and_data()
    xs[3] = (torch.full_like(xs[3][0], float("inf")), xs[3][1])  # one overflow: the step skips, the scale backs off
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = tritonscale.GradScaler("cpu", init_scale=2.0**8), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt, torch_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(twins, lr=0.1)
    skips = []
    for x in xs:
        ours.scale(_loss(params, x)).backward()
        theirs.scale(_loss(twins, x)).backward()
        ours.clip_grad_norm_(opt, 1.0)
        theirs.unscale_(torch_opt)
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        ours.step(opt)
        theirs.step(torch_opt)
        skips.append(ours._per_optimizer_states[id(opt)].skip)
        ours.update()
        theirs.update()
        opt.zero_grad()
        torch_opt.zero_grad()
        assert ours.get_scale() == theirs.get_scale()
        assert int(ours._tensors.growth_tracker) == int(theirs._growth_tracker)
    assert all(s.dtype == torch.float32 and s.dim() == 0 for s in skips) and len({id(s) for s in skips}) == STEPS
    assert [float(s) for s in skips] == [1.0 if k == 3 else 0.0 for k in range(STEPS)]
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
