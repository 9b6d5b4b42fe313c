"""GPU tier: the compiled kernels on a real device, against torch on the same device.

Skipped without a GPU. Run on a GPU machine with ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _train(scaler, model, opt, batches, ours, clip=0.5, strict_from=None):
    out = []
    for i, (x, y) in enumerate(batches):
        if strict_from is not None and i == strict_from:
            # From here on any host sync raises (the first steps compile the policy rule).
            torch.cuda.set_sync_debug_mode("error")
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if ours:
            norm = scaler.clip_grad_norm_(opt, clip)
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        out.append((norm, scaler._scale.clone()))
    torch.cuda.set_sync_debug_mode(0)
    return [(float(n), float(s)) for n, s in out]


@pytest.mark.parametrize("flat", [False, True], ids=["table", "flat"])
def test_gpu_training_matches_torch_without_host_sync(flat):
    import tritonscale

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (torch.randn(64, 256, device="cuda", generator=g), torch.randn(64, 8, device="cuda", generator=g))
        for _ in range(20)
    ]
    batches[5][0][0, 0] = math.inf
    model, opt = make()
    if flat:
        tritonscale.flatten_grads_(model.parameters())
    ours = tritonscale.GradScaler("cuda", init_scale=2.0**20, growth_interval=4, backend="triton")
    try:
        a = _train(ours, model, opt, batches, ours=True, strict_from=3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref_model, ref_opt = make()
    b = _train(torch.amp.GradScaler("cuda", init_scale=2.0**20, growth_interval=4), ref_model, ref_opt, batches, False)
    assert [s for _, s in a] == [s for _, s in b]
    for (n1, _), (n2, _) in zip(a, b):
        assert (math.isnan(n1) and math.isnan(n2)) or n1 == pytest.approx(n2, rel=1e-4)
    for p1, p2 in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5)


def test_gpu_large_finite_gradient_is_not_an_overflow():
    import tritonscale

    p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
    p.grad = torch.randn(1 << 20, device="cuda")
    p.grad[12345] = 3e19
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = tritonscale.GradScaler("cuda", init_scale=1.0, backend="triton")
    scaler.scale(torch.ones((), device="cuda"))
    expected = float(torch.linalg.vector_norm(p.grad.double()))  # float64 cannot overflow here
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isfinite(float(norm)) and float(norm) == pytest.approx(expected, rel=1e-6)
    assert float(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][p.device]) == 0.0


def test_gpu_step_replays_from_a_cuda_graph():
    # The claim behind "no Python branch on a device value, state updated in place at fixed
    # addresses": clip_grad_norm_ (folded into a fused AdamW) + step + update, captured once, replay
    # like the eager step -- skips, backoffs and growth included.
    import tritonscale

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256).cuda()
        tritonscale.flatten_grads_(model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        kw = dict(init_scale=2.0**16, growth_interval=3, backend="triton", compile_policy=False)
        scaler = tritonscale.GradScaler("cuda", **kw)
        scaler.scale(torch.ones((), device="cuda"))  # allocates the device-resident scale
        return model, opt, scaler

    def step(opt, scaler):
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    g = torch.Generator(device="cuda").manual_seed(2)
    shapes = [(256, 256), (256,)]
    grad_sets = [[torch.randn(s, device="cuda", generator=g) * 2.0**14 for s in shapes] for _ in range(12)]
    grad_sets[7][0][3, 4] = math.inf  # one overflowed step: skipped and backed off, in the graph too

    def load(model, grads):
        for p, grad in zip(model.parameters(), grads):
            p.grad.copy_(grad)

    model, opt, scaler = make()
    ref_model, ref_opt, ref_scaler = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotune, lazy state) outside the capture, both alike
        for grads in grad_sets[:3]:
            load(model, grads)
            step(opt, scaler)
            load(ref_model, grads)
            step(ref_opt, ref_scaler)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(opt, scaler)
    scales, ref_scales = [], []
    for grads in grad_sets[3:]:
        load(model, grads)
        graph.replay()
        scales.append(float(scaler._scale))
        load(ref_model, grads)
        step(ref_opt, ref_scaler)
        ref_scales.append(float(ref_scaler._scale))
    assert scales == ref_scales
    assert min(scales) < max(scales)  # the trajectory moved: a backoff and a growth were replayed
    for p1, p2 in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def _capturable_setup(seed: int = 0):
    import tritonscale

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    scaler = tritonscale.GradScaler(
        "cuda", init_scale=2.0**16, growth_interval=3, backend="triton", compile_policy=False
    )
    return model, opt, scaler


def _whole_step(model, opt, scaler, x, y):
    """The whole scaled iteration: forward under fp16 autocast, scale, backward, clip, step, update."""
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return norm


def test_gpu_whole_scaled_step_replays_from_a_cuda_graph():
    """Scale, backward, clip, fused step and update captured once; every later iteration is a
    replay on new data (copied into the static inputs), skips and growth happening on the device."""
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [(torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 8, device="cuda", generator=g))
               for _ in range(14)]  # fmt: skip
    batches[8][0][0, 0] = math.inf
    model, opt, scaler = _capturable_setup()
    ref_model, ref_opt, ref_scaler = _capturable_setup()
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (lazy state, autotune), both alike
        for x, y in batches[:3]:
            static_x.copy_(x), static_y.copy_(y)
            _whole_step(model, opt, scaler, static_x, static_y)
            _whole_step(ref_model, ref_opt, ref_scaler, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_norm = _whole_step(model, opt, scaler, static_x, static_y)
    scales, ref_scales = [], []
    for x, y in batches[3:]:
        static_x.copy_(x), static_y.copy_(y)
        graph.replay()
        ref_norm = _whole_step(ref_model, ref_opt, ref_scaler, x, y)
        scales.append(float(scaler._scale))
        ref_scales.append(float(ref_scaler._scale))
        torch.testing.assert_close(static_norm, ref_norm, equal_nan=True)
    assert scales == ref_scales
    assert min(scales) < max(scales)  # a backoff and a growth were replayed
    for p1, p2 in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p1, p2)


def test_gpu_compiled_post_backward_step_equals_eager():
    """clip + step + update compiled (inductor, mode="reduce-overhead": CUDA graphs where inductor
    can) equals the eager step: skips and scales exactly, parameters within tolerance."""
    g = torch.Generator(device="cuda").manual_seed(4)
    batches = [(torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 8, device="cuda", generator=g))
               for _ in range(12)]  # fmt: skip
    batches[6][0][0, 0] = math.inf
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, opt, scaler = _capturable_setup()

        def post_backward(opt=opt, scaler=scaler):
            norm = scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            return norm

        step = torch.compile(post_backward, mode="reduce-overhead") if compiled else post_backward
        scales = []
        for x, y in batches:
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            step()
            scales.append(float(scaler._scale))
        runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    (eager_scales, eager_params), (scales, params) = runs
    assert scales == eager_scales and min(scales) < max(scales)
    for p1, p2 in zip(params, eager_params):
        torch.testing.assert_close(p1, p2)


def _post_backward_run(mode: str, grad_sets):
    """The post-backward step (clip, fused step, update, SkipAwareLR.step) over ``grad_sets``
    loaded into the gradients in place; ``mode``: "eager", "captured" (torch's recipe through
    ``CapturedStep``: warm-up on a side stream, ``torch.cuda.graph(g)`` with no stream=, replays) or
    "reduce-overhead" (``torch.compile(mode="reduce-overhead")``). Each step's stats() row goes
    through a StepLog, recorded after the step (outside the graph)."""
    import tritonscale
    from tritonscale import CapturedStep

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    scaler = tritonscale.GradScaler(
        "cuda", init_scale=2.0**16, growth_interval=3, hysteresis=2, skip_norm_factor=5.0,
        backend="triton", compile_policy=False,
    )  # fmt: skip
    scaler.place_state("cuda")
    sched = tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(opt, 2, 0.7), scaler, total_steps=len(grad_sets))
    log = tritonscale.StepLog(delay=0)

    def post_backward():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()

    torch._dynamo.reset()
    steps = {
        "eager": lambda: post_backward,
        "captured": lambda: CapturedStep(post_backward, opt, warmup=3),
        "reduce-overhead": lambda: torch.compile(post_backward, mode="reduce-overhead"),
    }
    step = steps[mode]()
    lrs = []
    for i, grads in enumerate(grad_sets):
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)
        step()
        log.record(scaler, i)
        lrs.append(opt.param_groups[0]["lr"].clone())
    torch.cuda.synchronize()
    moments = [t.clone() for state in opt.state.values() for t in state.values()]
    return [p.detach().clone() for p in model.parameters()], moments, lrs, log.flush(), sched.state_dict()


def _spiky_grad_sets():
    """16 steps of gradients for a Linear(64, 64): two overflows in a row (hysteresis=2: the first
    skips keeping the scale, the second backs off), growth between, a finite norm spike (skipped)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(64, 64), (64,)]
    grad_sets = [[torch.randn(s, device="cuda", generator=g) * 2.0**10 for s in shapes] for _ in range(16)]
    grad_sets[6][0][1, 2] = math.inf  # hysteresis: the first overflow skips without a backoff
    grad_sets[7][1][3] = math.nan  # the second backs off
    grad_sets[12] = [t * 100.0 for t in grad_sets[12]]  # a norm spike: skipped, finite
    return grad_sets


def test_gpu_post_backward_step_by_torchs_recipe_equals_eager():
    """torch's recipe exactly, through CapturedStep: N replays with an overflow, growth, hysteresis
    (two overflows before a backoff) and a norm-spike skip equal N eager steps bit for bit:
    parameters, optimizer state, every learning rate, every logged row (scale, counters, norm)."""
    grad_sets = _spiky_grad_sets()
    eager, replayed = _post_backward_run("eager", grad_sets), _post_backward_run("captured", grad_sets)
    for a, b in zip(eager[:3], replayed[:3]):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True)
    assert str(replayed[3]) == str(eager[3])  # every logged row, NaN norms included
    assert replayed[4]["calls"] == eager[4]["calls"] == len(grad_sets)
    assert torch.equal(replayed[4]["applied_steps"], eager[4]["applied_steps"])
    rows = [values for _, values in eager[3]]
    assert sum(r["skipped"] for r in rows) >= 3 and len({r["scale"] for r in rows}) >= 3  # it moved


def _gpu_moves():
    """(layout, move(model, opt), recapture after it): each way the tensors a captured step reads move."""

    def extra_group(model, opt):
        extra = torch.nn.Parameter(torch.zeros(3, device="cuda"))
        extra.grad = torch.zeros_like(extra)
        opt.add_param_group({"params": [extra]})

    def first_grad(model):
        return model.weight.grad

    return [
        pytest.param("plain", lambda m, o: o.zero_grad(set_to_none=True), True, id="plain-set_to_none"),
        pytest.param("flat", lambda m, o: o.zero_grad(set_to_none=True), True, id="flat-set_to_none"),
        pytest.param("flat", lambda m, o: _flatten(m), True, id="flat-flatten_grads_-again"),
        pytest.param("plain", lambda m, o: setattr(first_grad(m), "data", torch.zeros_like(first_grad(m))), True,
                     id="grad.data="),
        pytest.param("flat", lambda m, o: first_grad(m).set_(torch.zeros_like(first_grad(m))), True, id="grad.set_"),
        pytest.param("plain", lambda m, o: m.to(torch.float64), False, id="model.to(float64)"),
        pytest.param("plain", lambda m, o: o.load_state_dict(o.state_dict()), True, id="load_state_dict"),
        pytest.param("plain", extra_group, True, id="add_param_group"),
    ]  # fmt: skip


def _flatten(model):
    import tritonscale

    tritonscale.flatten_grads_(model.parameters())


@pytest.mark.parametrize("layout, move, recapture", _gpu_moves())
def test_gpu_captured_step_refuses_what_moved(layout, move, recapture):
    """After the capture, a move of what the graph reads (gradients set to None, a flat buffer's
    gradients, which the scaler's own cache keeps alive, ``.data =``, ``set_``, ``model.to``, a
    loaded optimizer state, a new param group): the next call refuses, naming the fix, replaying
    nothing; recapture() captures the new tensors after one eager warm-up. Zeroed in place, the
    steps replay."""
    import tritonscale
    from tritonscale import CapturedStep

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    if layout == "flat":
        _flatten(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    scaler = tritonscale.GradScaler("cuda", backend="triton", compile_policy=False)

    def backward():
        x = torch.randn(4, 16, device="cuda", dtype=model.weight.dtype)
        scaler.scale(model(x).square().mean()).backward()

    def post_backward():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    step = CapturedStep(post_backward, opt, warmup=2)
    for _ in range(4):
        opt.zero_grad(set_to_none=False)
        backward()
        step()
    move(model, opt)
    backward()
    torch.cuda.synchronize()
    before = [t.clone() for t in (*model.parameters(), scaler._scale, scaler._growth_tracker)]
    with pytest.raises(RuntimeError, match="moved since its capture.*recapture"):
        step()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), scaler._scale, scaler._growth_tracker)))
    if not recapture:
        return
    step.recapture()
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        backward()
        step()
    assert step.graph is not None


def test_gpu_reduce_overhead_step_with_the_loop_equals_eager():
    """The same post-backward step with SkipAwareLR.step inside, compiled with
    mode="reduce-overhead" (CUDA graphs where inductor can), StepLog.record after each call:
    every learning rate, SkipAwareLR's counts and every logged counter and scale equal eager's bit
    for bit; the norm and the parameters within float32 tolerance (inductor may reorder arithmetic
    around the kernels' custom ops)."""
    grad_sets = _spiky_grad_sets()
    eager, compiled = _post_backward_run("eager", grad_sets), _post_backward_run("reduce-overhead", grad_sets)
    for a, b in zip(eager[:2], compiled[:2]):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, equal_nan=True)
    assert torch.equal(torch.stack(compiled[2]), torch.stack(eager[2]))  # every learning rate
    assert [step for step, _ in compiled[3]] == [step for step, _ in eager[3]]
    for (_, got), (_, expected) in zip(compiled[3], eager[3]):
        assert {k: v for k, v in got.items() if k != "norm"} == {k: v for k, v in expected.items() if k != "norm"}
        nan = math.isnan(expected["norm"])
        assert math.isnan(got["norm"]) if nan else math.isclose(got["norm"], expected["norm"], rel_tol=1e-5)
    assert compiled[4]["calls"] == eager[4]["calls"] == len(grad_sets)
    assert torch.equal(compiled[4]["applied_steps"], eager[4]["applied_steps"])
    rows = [values for _, values in eager[3]]
    assert sum(r["skipped"] for r in rows) >= 3 and len({r["scale"] for r in rows}) >= 3  # it moved


@pytest.mark.parametrize("layout", ["flat", "table"])
def test_gpu_gradients_past_2_31_elements(monkeypatch, layout):
    """A float16 gradient of 2**31 + 12388 elements (4 GiB): the elements past 2**31 are in the
    norm, an inf in the last one is found, the unscale writes them; against torch on the same
    values. The FLAT path's full grid, which the interpreter cannot afford (tests/kernels/test_past_2_31.py
    covers the TABLE path there)."""
    from tritonscale.kernels import apply_factor_, check_pass, describe_grads
    from tritonscale.kernels.check_pass import PARTIAL_ROWS
    from tritonscale.kernels.finalize import finalize

    monkeypatch.setenv("TRITONSCALE_AUTOTUNE", "0")  # no timing reruns over 4 GiB
    bound, numel = 2**31, 2**31 + 3 * 4096 + 100
    big = torch.zeros(numel, dtype=torch.float16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tail = (torch.randn(numel - bound + 4096, device="cuda", generator=gen) * 64).half()
    big[bound - 4096 :] = tail
    other = torch.ones(7, dtype=torch.float16, device="cuda")  # a second tensor makes a table
    grads = [big] if layout == "flat" else [big, other]
    described = describe_grads(grads)
    assert described.flat == (layout == "flat")
    partials = torch.zeros(PARTIAL_ROWS, described.programs, device="cuda")
    check_pass(described, partials)
    found, norm = finalize(partials, described.programs, torch.ones(1, device="cuda"))[:2].tolist()
    expected = math.sqrt(tail.double().square().sum().item() + (7.0 if layout == "table" else 0.0))
    assert found == 0.0
    assert norm == pytest.approx(expected, rel=1e-5)
    big[-1] = math.inf
    found_inf = torch.zeros(1, device="cuda")
    apply_factor_(described, torch.tensor([2.0], device="cuda"), invert=True, found_inf=found_inf)
    assert found_inf.item() == 1.0
    assert torch.equal(big[bound - 4096 : -1], (tail[:-1].float() * 0.5).half())
    assert big[-1].item() == math.inf
