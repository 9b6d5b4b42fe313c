"""clip_grad_norm_ traced whole by a compiled caller, and the post-backward step in few graphs.

The oracle is the same run in eager mode. Each run lets the scale grow (growth_interval=2) and
feeds two overflows, so the compiled clip, warm, sees the scale back off and grow again: a Python
number Dynamo specialised on would recompile (``error_on_recompile`` is on once warm) or freeze
(the norms would drift from eager's by the scale's growth). With ``backend="aot_eager"`` the graph
runs the eager ops, so norms, gradients and flags must be eager's bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.compiled_placements import needs_compiled_clip, placed
from torch._dynamo.testing import CompileCounterWithBackend

from tritonscale import GradScaler, flatten_grads_

STEPS = 10
OVERFLOWS = (3, 7)
WARM = 3  # clip calls before which a recompilation is allowed
RELAYOUT = 5
MAX_NORM = 0.5

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01),
    "fused AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "fused Adam": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "fused SGD": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True),
    "fused Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.01, fused=True),
}


def training_run(
    optimizer_name: str, backend: str, compiler: str | None, compile_what: str = "clip", flat: bool = False
) -> dict:
    """STEPS scaled steps of a small model. ``compile_what``: "clip" compiles clip_grad_norm_
    alone with fullgraph=True; "post-backward" compiles clip + step + update as one function.
    ``flat``: the gradients live in a flatten_grads_ buffer, a new one from step RELAYOUT on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)

    def clip():
        return scaler.clip_grad_norm_(optimizer, MAX_NORM)

    def post_backward():
        norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        return norm

    counter = CompileCounterWithBackend(compiler) if compiler else None
    function = clip if compile_what == "clip" else post_backward
    if compiler:
        function = torch.compile(function, backend=counter, fullgraph=compile_what == "clip")
    g = torch.Generator().manual_seed(1)
    run = {"norm bits": [], "grads": [], "found_inf": [], "stats": []}
    for i in range(STEPS):
        if flat and i in (0, RELAYOUT):
            flatten_grads_(model.parameters())  # the gradients move to a new buffer
        optimizer.zero_grad(set_to_none=not flat)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if i in OVERFLOWS:
            x[0, 0] = math.inf
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        with torch._dynamo.config.patch(error_on_recompile=compiler is not None and i >= WARM):
            norm = function()
        run["norm bits"].append(norm.view(torch.int32).item())
        run["grads"].append([p.grad.clone() for p in model.parameters()])
        if compile_what == "clip":
            run["found_inf"].append(scaler.found_inf_for(optimizer).item())
            scaler.step(optimizer)
            scaler.update()
        run["stats"].append({name: value.clone() for name, value in scaler.stats().items()})
    run["params"] = [p.detach().clone() for p in model.parameters()]
    run["graphs"] = counter.frame_count if counter else 0
    return run


def assert_same_run(compiled: dict, eager: dict, exact: bool = True) -> None:
    """Skips, scales and the scale state bit for bit; norms, gradients and parameters bit for bit
    (``exact``) or within float32 tolerance (inductor reorders the reductions)."""
    skipped = [int(s["skipped"]) for s in eager["stats"]]
    assert [i for i, s in enumerate(skipped) if s] == list(OVERFLOWS)
    scales = [float(s["scale"]) for s in eager["stats"]]
    assert max(scales) > scales[0] and min(scales[OVERFLOWS[0] :]) < max(scales)  # grew and backed off
    assert compiled["found_inf"] == eager["found_inf"]
    for ours, reference in zip(compiled["stats"], eager["stats"]):
        for name in ("scale", "growth_tracker", "found_inf", "skipped", "skipped_steps", "consecutive_skips"):
            torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=0, msg=name)
    tolerance = {"rtol": 0, "atol": 0} if exact else {}
    norms = [torch.tensor(bits, dtype=torch.int32).view(torch.float32) for bits in compiled["norm bits"]]
    expected = [torch.tensor(bits, dtype=torch.int32).view(torch.float32) for bits in eager["norm bits"]]
    for ours, reference in zip(norms, expected):
        torch.testing.assert_close(ours, reference, equal_nan=True, **tolerance)
    for step_grads, reference_grads in zip(compiled["grads"], eager["grads"]):
        for ours, reference in zip(step_grads, reference_grads):
            torch.testing.assert_close(ours, reference, equal_nan=True, **tolerance)
    for ours, reference in zip(compiled["params"], eager["params"]):
        torch.testing.assert_close(ours, reference, **tolerance)


@needs_compiled_clip
@pytest.mark.parametrize("optimizer_name", ["SGD", "fused AdamW"])
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_clip_compiles_whole_without_recompiling(request, optimizer_name, paths):
    """fullgraph=True (a break raises) on the torch backend; at most one recompilation, before
    WARM. SGD: the clip writes the gradients; fused AdamW: it folds into the step."""
    if paths == "gpu":  # the paths a GPU takes: no host reads, the rule as device ops
        request.getfixturevalue("forbid_host_reads")
    compiled = training_run(optimizer_name, "torch", "aot_eager")
    assert_same_run(compiled, training_run(optimizer_name, "torch", None))
    assert 1 <= compiled["graphs"] <= 2


@needs_compiled_clip
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_flat_buffers_moved_under_a_warm_compiled_clip(forbid_host_reads, backend_name):
    """Views of a flatten_grads_ buffer, then of a new one: a traced clip proves nothing by address
    (each gradient goes as itself), so the moved memory is read as it is, as in eager mode. Eager,
    the torch backend reads the buffer as one run, whose norm may differ by an ulp from the
    per-gradient norms; the Triton kernels lay the buffer out at run time in both."""
    compiled = training_run("SGD", backend_name, "aot_eager", flat=True)
    assert_same_run(compiled, training_run("SGD", backend_name, None, flat=True), exact=backend_name == "triton")


@needs_compiled_clip
def test_triton_kernels_enter_the_graph_as_custom_ops():
    """On the Triton backend the check and apply passes are single nodes of the graph
    (torch.ops.tritonscale.*); the interpreter runs them here, bit for bit as in eager mode."""
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    eager = training_run("SGD", "triton", None)
    compiled = training_run("SGD", "triton", "aot_eager")
    assert_same_run(compiled, eager)
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend="triton")
    scaler.scale(sum(p.sum() for p in params)).backward()
    torch.compile(lambda: scaler.clip_grad_norm_(optimizer, 1.0), backend=recording_backend, fullgraph=True)()
    assert "tritonscale.check" in targets and "tritonscale.apply_factor_" in targets


@needs_compiled_clip
@pytest.mark.parametrize("optimizer_name", ["fused AdamW", "fused Adam", "fused SGD", "fused Adagrad"])
def test_post_backward_step_is_at_most_three_graphs(forbid_host_reads, optimizer_name):
    """clip + step + update compiled as one function: the clip and the update are graphs, the
    hand-over to the fused optimizer runs eagerly between them (torch 2.13's fused optimizers
    ignore found_inf, and fused SGD grad_scale, inside a graph: test_fused_step_under_compile.py)."""
    compiled = training_run(optimizer_name, "torch", "aot_eager", compile_what="post-backward")
    assert_same_run(compiled, training_run(optimizer_name, "torch", None, compile_what="post-backward"))
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(5, 3))]
    optimizer = OPTIMIZERS[optimizer_name](params)
    scaler = GradScaler("cpu", backend="torch")
    scaler.scale(params[0].sum()).backward()

    def post_backward():
        norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        return norm

    explained = torch._dynamo.explain(post_backward)()
    assert explained.graph_count <= 3, [reason.reason for reason in explained.break_reasons]


@needs_compiled_clip
def test_gradients_sharing_memory_raise_at_run_time_and_change_nothing(forbid_host_reads):
    """A traced clip cannot read addresses, and torch.compile does not notice inputs that alias
    only at run time: the overlap check runs inside the graph (a custom op), before the passes."""
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", backend="torch")
    clip = torch.compile(lambda: scaler.clip_grad_norm_(optimizer, 1.0), backend="aot_eager", fullgraph=True)
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    clip()  # warm: separate gradients
    scaler.step(optimizer)
    scaler.update()
    memory = torch.full((6,), 3.0)
    params[0].grad, params[1].grad = memory[:4], memory[2:]
    before, scale = memory.clone(), scaler.get_scale()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] and .*\['params'\]\[1\] share memory"):
        clip()
    assert torch.equal(memory, before) and scaler.get_scale() == scale
    assert scaler.optimizer_stage(optimizer) is None  # nothing recorded: the step may be retried


@needs_compiled_clip
def test_a_disabled_scalers_clip_compiles_whole():
    """A bf16 run (enabled=False): the plain clip with its inf/NaN check traces too, and the step
    after it skips on the check, as in eager mode."""

    def run(compiled: bool) -> tuple[list, list]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler("cpu", enabled=False, backend="torch")
        clip = lambda: scaler.clip_grad_norm_(optimizer, MAX_NORM)  # noqa: E731
        clip = torch.compile(clip, backend="aot_eager", fullgraph=True) if compiled else clip
        seen = []
        for i in range(5):
            optimizer.zero_grad()
            x = torch.randn(3, 8)
            x[0, 0] = math.inf if i == 2 else x[0, 0]
            model(x).square().sum().backward()
            seen.append(clip().view(torch.int32).item())
            scaler.step(optimizer)
            scaler.update()
            seen.append(scaler.last_step_skipped())
        return seen, [p.detach().clone() for p in model.parameters()]

    (seen, params), (expected, expected_params) = run(True), run(False)
    assert seen == expected and expected.count(True) == 1
    assert all(torch.equal(ours, reference) for ours, reference in zip(params, expected_params))


# ------------------------------------------------ a clip schedule: max_norm changes on every call
#: An LR-style clip schedule, one max_norm per call, and where a step overflows.
SCHEDULE = (0.5, 0.25, 0.125, 0.4, 0.3)
SCHEDULE_OVERFLOW = 3
WARM_CALLS = 2  # a float argument turns dynamic at its second value (automatic dynamic)


def schedule_run(
    backend: str,
    compiled: bool,
    where: str = "closure",
    dynamic: bool | None = None,
    tensor: bool = False,
    norm_types: tuple = (),
) -> dict:
    """clip_grad_norm_ compiled with fullgraph=True (or eager) and called with a new max_norm each
    step (a 0-dim tensor with ``tensor``), and ``norm_types`` in turn; the scaler held as ``where``
    says. Once warm, only a norm type not seen before may compile (``error_on_recompile``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)
    clip = placed(where, scaler, lambda s, max_norm, norm_type: s.clip_grad_norm_(optimizer, max_norm, norm_type))
    counter = CompileCounterWithBackend("aot_eager")
    clip = torch.compile(clip, backend=counter, dynamic=dynamic, fullgraph=True) if compiled else clip
    norm_types = norm_types or (2.0,) * len(SCHEDULE)
    g = torch.Generator().manual_seed(1)
    run = {"norm bits": [], "grads": [], "graphs": [], "skipped": []}
    for i, (max_norm, norm_type) in enumerate(zip(SCHEDULE, norm_types)):
        optimizer.zero_grad()
        x = torch.randn(4, 6, generator=g)
        x[0, 0] = math.inf if i == SCHEDULE_OVERFLOW else x[0, 0]
        scaler.scale(torch.nn.functional.mse_loss(model(x), torch.zeros(4, 3))).backward()
        warm = compiled and i >= WARM_CALLS and norm_type in norm_types[:i]
        with torch._dynamo.config.patch(error_on_recompile=warm and dynamic is not False):
            norm = clip(torch.tensor(max_norm) if tensor else max_norm, norm_type)
        run["norm bits"].append(norm.view(torch.int32).item())
        run["grads"].append([p.grad.clone() for p in model.parameters()])
        run["graphs"].append(counter.frame_count)
        scaler.step(optimizer)
        scaler.update()
        run["skipped"].append(scaler.last_step_skipped())
    run["params"] = [p.detach().clone() for p in model.parameters()]
    return run


def torch_clip_graphs(dynamic: bool | None, tensor: bool, norm_types=()) -> list[int]:
    """The oracle for recompilation: the graphs torch's own clip_grad_norm_, compiled with
    fullgraph=True and called after torch's unscale_, has made after each call of the schedule."""
    torch._dynamo.reset()
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    counter = CompileCounterWithBackend("aot_eager")
    clip = torch.compile(torch.nn.utils.clip_grad_norm_, backend=counter, dynamic=dynamic, fullgraph=True)
    graphs = []
    for max_norm, norm_type in zip(SCHEDULE, norm_types or (2.0,) * len(SCHEDULE)):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 6)).sum()).backward()
        scaler.unscale_(optimizer)
        clip(list(model.parameters()), torch.tensor(max_norm) if tensor else max_norm, norm_type)
        graphs.append(counter.frame_count)
        scaler.step(optimizer)
        scaler.update()
    return graphs


@needs_compiled_clip
@pytest.mark.parametrize(
    "backend_name, where, dynamic, tensor, norm_types",
    [
        ("torch", "global", None, False, ()),
        ("triton", "attribute", True, False, ()),
        ("torch", "closure", True, False, (2.0, 1.0, math.inf, 2.0, 1.0)),
        ("torch", "closure", False, False, ()),
        ("triton", "global", False, True, ()),
    ],
    ids=["global", "attribute-dynamic-triton", "closure-dynamic-norm-types", "static-floats", "tensor-triton"],
)
def test_a_clip_schedule_compiles_as_torchs_own_clip(backend_name, where, dynamic, tensor, norm_types):
    """A max_norm that changes on every call (an LR-style clip schedule), wherever the scaler
    lives: fullgraph=True holds, the run is eager's bit for bit, and the graphs come as torch's own
    compiled clip makes them -- a float turns dynamic at its second value (never again compiled),
    dynamic=True compiles once, a norm type compiles once (it picks the code), and dynamic=False
    compiles each new float (Dynamo specialises floats there). A tensor never recompiles."""
    compiled = schedule_run(backend_name, True, where, dynamic, tensor, norm_types)
    eager = schedule_run(backend_name, False, tensor=tensor, norm_types=norm_types)
    assert eager["skipped"] == [i == SCHEDULE_OVERFLOW for i in range(len(SCHEDULE))]
    assert compiled["norm bits"] == eager["norm bits"] and compiled["skipped"] == eager["skipped"]
    for ours, reference in zip(compiled["grads"] + [compiled["params"]], eager["grads"] + [eager["params"]]):
        assert all(torch.equal(o.view(torch.int32), r.view(torch.int32)) for o, r in zip(ours, reference))
    assert compiled["graphs"] == torch_clip_graphs(dynamic, tensor, norm_types)


def test_tensor_max_norm_is_torchs_float_of_it_and_bad_ones_change_nothing(backend):
    """torch's clip_grad_norm_ takes a one-element tensor max_norm and reads it with float() (a
    host read): the scaler reads it on the device, with the same bits as torch. A negative one,
    or one of several elements, raises and changes nothing, as a bad float does."""
    results = []
    for max_norm in (0.3, torch.tensor(0.3), torch.tensor([0.3], dtype=torch.float64)):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler("cpu", init_scale=2.0**10, backend=backend)
        scaler.scale(model(torch.randn(3, 6)).sum()).backward()
        results.append((scaler.clip_grad_norm_(optimizer, max_norm), [p.grad.clone() for p in model.parameters()]))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    reference.scale(model(torch.randn(3, 6)).sum()).backward()
    reference.unscale_(optimizer)
    reference_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), torch.tensor(0.3))
    results.append((reference_norm, [p.grad for p in model.parameters()]))
    for norm, grads in results[1:]:
        assert torch.equal(norm, results[0][0]) and all(torch.equal(g, r) for g, r in zip(grads, results[0][1]))
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(model(torch.randn(3, 6)).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    for bad, match in ((torch.tensor(-1.0), "max_norm must be >= 0"), (torch.ones(2), "one-element real tensor")):
        with pytest.raises(ValueError, match=match):
            scaler.clip_grad_norm_(optimizer, bad)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert scaler.optimizer_stage(optimizer) is None
