"""The step under torch.compile equals the step in eager mode, on both backends and both paths.

A user compiles the post-backward step (clip_grad_norm_ + step + update, fused AdamW). The oracle
is the same run in eager mode: norms, skip flags and scales bit for bit, parameters equal. The run
lets the scale grow (growth_interval=2) and feeds an inf so that a step skips and the scale backs
off: state the step keeps on the host and a compiled graph would freeze shows up there (a cached
1/scale gave norms 2x eager's once the scale had grown). clip_grad_norm_ and update() are traced
into the caller's graph; step() runs eagerly between them (compile_boundary.py), and so does the
optimizer's own step inside it.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.compiled_placements import needs_compiled_clip
from torch._dynamo.testing import CompileCounterWithBackend

from tritonscale import GradScaler, LossScaleOptimizer, Updater, presets
from tritonscale.passes.backends import inverse_scale

STEPS = 10
OVERFLOW_STEP = 5
MAX_NORM = 1.0


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]
    data[OVERFLOW_STEP][0][0, 0] = math.inf  # the first layer's gradients turn inf/NaN
    return data


def api_step(shape: str, model, optimizer, scaler):
    """The user's call for each API shape, loss -> norm: the step after the backward
    (GradScaler), the scaled backward and step (LossScaleOptimizer), a whole iteration (Updater)."""
    if shape == "GradScaler":

        def post_backward(loss):
            norm = scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            return norm

        return post_backward
    if shape == "LossScaleOptimizer":
        return LossScaleOptimizer(optimizer, max_norm=MAX_NORM, scaler=scaler).backward_and_step
    mse = torch.nn.functional.mse_loss
    updater = Updater(model, optimizer, batches(), loss_fn=mse, scaler=scaler, max_norm=MAX_NORM)
    return lambda loss: updater.update().norm


def training_run(backend: str, compiler: str | None, shape: str = "GradScaler", policy=None) -> dict:
    """STEPS scaled steps of a small model, the step compiled by ``compiler`` (a torch.compile
    backend), or eager with None; ``policy``: a peer's preset instead of torch's rule."""
    torch._dynamo.reset()  # the step function's code is shared by every run: no cache carried over
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = (
        GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backend=backend)
        if policy is None
        else GradScaler("cpu", policy=policy, backend=backend)
    )
    traced_steps = []  # the fused optimizer's own step must run eagerly inside scaler.step
    optimizer.register_step_pre_hook(lambda *_: traced_steps.append(torch.compiler.is_compiling()))
    api = api_step(shape, model, optimizer, scaler)

    def step(loss):
        norm = api(loss)
        return norm, torch.stack([norm, loss.detach()])  # the user's code around the step: compiled

    counter = CompileCounterWithBackend(compiler) if compiler else None
    step = torch.compile(step, backend=counter) if compiler else step
    norms, skipped, scales = [], [], []
    for x, y in batches():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if shape == "GradScaler":
            scaler.scale(loss).backward()
        norm, logged = step(loss)
        torch.testing.assert_close(logged[0], norm, rtol=0, atol=0, equal_nan=True)
        norms.append(norm.clone())
        skipped.append(scaler.last_step_skipped())
        scales.append(scaler.get_scale())
    if counter is not None:
        assert counter.frame_count >= 1 and counter.op_count >= 1  # the user's code did compile
    return {
        "norm bits": torch.stack(norms).view(torch.int32).tolist(),
        "skipped": skipped,
        "scales": scales,
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer steps traced": traced_steps,
    }


def assert_same_run(compiled: dict, eager: dict, exact: bool = True) -> None:
    """Skips and scales bit for bit; norms and parameters too (``exact``: aot_eager runs eager's
    ops), or within float32 tolerance (inductor reorders the norm's reductions)."""
    assert eager["skipped"][OVERFLOW_STEP] and sum(eager["skipped"]) == 1
    assert max(eager["scales"]) > eager["scales"][0]  # the scale grew (and backed off at the overflow)
    assert compiled["skipped"] == eager["skipped"]
    assert compiled["scales"] == eager["scales"]
    if exact:
        assert compiled["norm bits"] == eager["norm bits"]
    norms = torch.tensor(compiled["norm bits"], dtype=torch.int32).view(torch.float32)
    expected = torch.tensor(eager["norm bits"], dtype=torch.int32).view(torch.float32)
    torch.testing.assert_close(norms, expected, equal_nan=True)
    for ours, reference in zip(compiled["params"], eager["params"]):
        torch.testing.assert_close(ours, reference, **({"rtol": 0, "atol": 0} if exact else {}))
    # The fused optimizer's step ran eagerly: traced, torch 2.13's fused optimizers ignore
    # found_inf (and fused SGD grad_scale).
    assert compiled["optimizer steps traced"] == [False] * STEPS


@needs_compiled_clip
@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_compiled_step_equals_eager(request, backend, paths):
    if paths == "gpu":  # the paths a GPU takes: no host reads, the policy rule as device ops
        request.getfixturevalue("forbid_host_reads")
    assert_same_run(training_run(backend, "aot_eager"), training_run(backend, None))


@needs_compiled_clip
def test_compiled_step_equals_eager_with_inductor(forbid_host_reads):
    assert_same_run(training_run("torch", "inductor"), training_run("torch", None), exact=False)


@needs_compiled_clip
@pytest.mark.parametrize(
    "preset",
    [
        # DeepSpeed's ZeRO rule: its error at the minimum scale reads the host, so update() stays eager.
        presets.deepspeed(initial_scale_power=8, loss_scale_window=2),
        # Megatron-LM's float32 factors, traced into the caller's graph with no host read.
        presets.megatron(initial_scale=2.0**8, growth_factor=1.1, backoff_factor=0.9, growth_interval=2, hysteresis=1),
    ],
    ids=["deepspeed", "megatron"],
)
def test_a_peers_preset_compiled_equals_eager(request, preset):
    if not preset.policy.needs_host_check():
        request.getfixturevalue("forbid_host_reads")
    assert_same_run(training_run("torch", "aot_eager", policy=preset), training_run("torch", None, policy=preset))


@pytest.mark.parametrize("shape", ["LossScaleOptimizer", "Updater"])
def test_other_api_shapes_compiled_equal_eager(forbid_host_reads, shape):
    assert_same_run(training_run("torch", "aot_eager", shape), training_run("torch", None, shape))


def test_inverse_scale_follows_the_scale_under_compile(forbid_host_reads):
    """1/scale is a function of the scale alone: nothing kept between calls that a trace would freeze."""
    scale = torch.tensor(4.0)
    inverse_scale(scale)
    compiled = torch.compile(inverse_scale, backend="aot_eager")
    for value in (4.0, 8.0, 16.0):
        scale.fill_(value)
        assert compiled(scale).item() == 1 / value
