"""Device launches per phase of a step on the GPU paths, counted on the CPU (tests/launches.py).

The host-read switch is off (the paths a GPU takes), the gradient passes are the Triton kernels
(through the interpreter) and the policy runs on the device; the counts are what a GPU launches.
torch's GradScaler, counted the same way, is the reference beside ours (docs/performance.md).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from launches import LaunchCounter

from tritonscale import GradScaler

PHASES = ("scale", "clip", "step", "update")
RICH = {"hysteresis": 2, "skip_norm_factor": 5.0}
#: The most launches each phase may make (fused AdamW folding the clip / foreach SGD).
BOUNDS = {
    "fused": {"scale": 1, "clip": 12, "step": 17, "update": 1},
    "sgd": {"scale": 1, "clip": 5, "step": 15, "update": 1},
}


def _params(count: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(1024 if count == 1 else 16)) for _ in range(count)]


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.SGD(params, lr=0.1, foreach=True)


def count_step(scaler, optimizer, params, *, torch_clip: bool = False, steps: int = 3) -> LaunchCounter:
    """Run ``steps`` scaled steps (scale, clip to 1.0, step, update); count the last one per phase."""
    counter = LaunchCounter()
    for i in range(steps):
        last = i == steps - 1
        phase = counter.phase if last else (lambda name: contextlib.nullcontext())
        for p in params:
            p.grad = None
        loss = sum((p * p).sum() for p in params)
        with phase("scale"):
            scaled = scaler.scale(loss)
        scaled.backward()
        with phase("clip"):
            if torch_clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            else:
                scaler.clip_grad_norm_(optimizer, 1.0)
        with phase("step"):
            scaler.step(optimizer)
        with phase("update"):
            scaler.update()
    return counter


@pytest.mark.parametrize("count", [1, 148])
@pytest.mark.parametrize("policy", ["defaults", "rich"])
@pytest.mark.parametrize("kind", ["fused", "sgd"])
def test_launches_per_phase_on_the_gpu_paths(forbid_host_reads, kind, policy, count):
    params = _params(count)
    knobs = RICH if policy == "rich" else {}
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **knobs)
    counter = count_step(scaler, _optimizer(kind, params), params)
    over = {p: (counter.counts[p], counter.ops[p]) for p in PHASES if counter.counts[p] > BOUNDS[kind][p]}
    assert not over, f"phases over their launch bound {BOUNDS[kind]}: {over}"


def test_the_counter_counts_torchs_scaler_as_its_kernels():
    """The reference: torch's update is its one ``_amp_update_scale_``, its scale one multiply,
    its fused AdamW step the optimizer's own kernels."""
    params = _params(1)
    counter = count_step(torch.amp.GradScaler("cpu"), _optimizer("fused", params), params, torch_clip=True)
    assert counter.ops["update"] == ["aten._amp_update_scale_"]
    assert counter.ops["scale"] == ["aten.mul"]
    assert "aten._fused_adamw_" in counter.ops["step"]
    assert "aten._amp_foreach_non_finite_check_and_unscale_" in counter.ops["clip"]


#: A policy with every kind of state the update carries: hysteresis, a norm average, both spike rules.
SPIKES = {"hysteresis": 2, "skip_norm_factor": 5.0, "skip_norm_sigma": 3.0, "skip_norm_window": 4, "clip_norm_z": 2.0}


@pytest.mark.parametrize("knobs", [{}, SPIKES], ids=["defaults", "spike-rules"])
def test_update_is_one_launch_whatever_the_policy_and_the_optimizers(forbid_host_reads, knobs):
    """Two optimizers on one scaler, each clipped and stepped: the update reads both flags in its one launch."""
    params = _params(2)
    optimizers = [torch.optim.SGD([p], lr=0.1, foreach=True) for p in params]
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **knobs)
    counter = LaunchCounter()
    for i in range(3):
        for p in params:
            p.grad = None
        scaler.scale(sum((p * p).sum() for p in params)).backward()
        for k, optimizer in enumerate(optimizers):
            if not knobs or k == 0:  # the norm rules keep one optimizer's history: one clip
                scaler.clip_grad_norm_(optimizer, 1.0)
            scaler.step(optimizer)
        with counter.phase("update") if i == 2 else contextlib.nullcontext():
            scaler.update()
    assert counter.ops["update"] == ["triton.policy_update_kernel"]
