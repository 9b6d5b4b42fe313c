"""Device launches per phase of a step on the GPU paths, counted on the CPU (tests/support/launches.py).

The host-read switch is off (the paths a GPU takes), the gradient passes are the Triton kernels
(through the interpreter) and the policy runs on the device; the counts are what a GPU launches.
torch's GradScaler, counted the same way, is the reference beside ours (docs/performance.md).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.launches import LaunchCounter, count_scaled_step

from tritonscale import GradScaler

PHASES = ("scale", "clip", "update")  # the step's bound is the optimizer's own kernels (below)
RICH = {"hysteresis": 2, "skip_norm_factor": 5.0}
#: Policies whose rules the clip's finalize decides too: the z-score window, ZClip's adaptive clip.
SPIKY = {
    "sigma": {"skip_norm_sigma": 3.0, "skip_norm_window": 16, "skip_norm_above": 1e3},
    "zclip": {"clip_norm_z": 2.5, "clip_norm_warmup_steps": 2, "skip_norm_factor": 5.0},
}
#: The most launches each phase may make (fused AdamW folding the clip: check, finalize / foreach
#: SGD: check, finalize, apply), whatever the policy and the tensor count; beyond them only
#: TABLE_REBUILD, when the gradients moved (``p.grad = None`` each step, as here).
BOUNDS = {
    "fused": {"scale": 1, "clip": 2, "update": 1},
    "sgd": {"scale": 1, "clip": 3, "update": 1},
}


def _params(count: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(1024 if count == 1 else 16)) for _ in range(count)]


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.SGD(params, lr=0.1, foreach=True)


#: Gradients at new addresses (``zero_grad(set_to_none=True)``) rebuild the pointer table of a
#: multi-tensor launch (kernels/tensor_table.py): a stack of the addresses and sizes in host
#: memory, then one asynchronous copy to a GPU, which the CPU count cannot see. Not a kernel of
#: the clip's; persistent gradients (set_to_none=False) reuse the table and make none.
TABLE_REBUILD = ["aten.stack"]


def _optimizers_own_ops(kind: str, count: int) -> list[str]:
    """The ops the optimizer's step launches by itself, as a scaler's step calls it: a fused one
    with ``grad_scale`` and ``found_inf`` set (torch's protocol), a plain one as it is."""
    params = _params(count)
    optimizer = _optimizer(kind, params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the state exists, as in the counted (third) step
    if kind == "fused":
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(2.0), torch.tensor(0.0)
    counter = LaunchCounter()
    with counter.phase("step"):
        optimizer.step()
    return counter.ops["step"]


@pytest.mark.parametrize("count", [1, 148])
@pytest.mark.parametrize("policy", ["defaults", "rich", *SPIKY])
@pytest.mark.parametrize("kind", ["fused", "sgd"])
def test_launches_per_phase_on_the_gpu_paths(forbid_host_reads, kind, policy, count):
    """scale 1, the clip 2 (folded) or 3, the step nothing but the optimizer's own kernels, update 1."""
    params = _params(count)
    knobs = {"defaults": {}, "rich": RICH, **SPIKY}[policy]
    scaler = GradScaler("cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **knobs)
    counter = count_scaled_step(scaler, _optimizer(kind, params), params)
    table = TABLE_REBUILD if count > 1 else []
    over = {p: counter.ops[p] for p in PHASES if counter.counts[p] - (p == "clip") * len(table) > BOUNDS[kind][p]}
    assert not over, f"phases over their launch bound {BOUNDS[kind]}: {over}"
    assert counter.ops["clip"][: len(table)] == table
    assert counter.ops.get("step", []) == _optimizers_own_ops(kind, count), "the step launched more than the optimizer"


def test_the_counter_counts_torchs_scaler_as_its_kernels():
    """The reference: torch's update is its one ``_amp_update_scale_``, its scale one multiply,
    its fused AdamW step the optimizer's own kernels."""
    params = _params(1)
    counter = count_scaled_step(torch.amp.GradScaler("cpu"), _optimizer("fused", params), params, clip="torch")
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


@pytest.mark.parametrize("count", [1, 148])
@pytest.mark.parametrize("policy", ["defaults", "rich"])
@pytest.mark.parametrize("kind", ["fused", "sgd"])
def test_a_step_without_a_clip_is_its_check_and_the_optimizers_own(forbid_host_reads, kind, policy, count):
    """No clip: the step's own pass (a fused step's check + finalize, which decides the skip; a plain
    step's unscale: the flag's fill + the pass) and then the optimizer's kernels, nothing else."""
    params = _params(count)
    scaler = GradScaler(
        "cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **(RICH if policy == "rich" else {})
    )
    own = _optimizers_own_ops(kind, count)
    ops = count_scaled_step(scaler, _optimizer(kind, params), params, clip="none").ops["step"]
    table = TABLE_REBUILD if count > 1 else []
    assert ops[len(ops) - len(own) :] == own, ops
    assert len(ops) - len(own) - len(table) <= 2, f"the step launched more than its pass and the optimizer: {ops}"


@pytest.mark.parametrize("count", [1, 148])
@pytest.mark.parametrize("policy", ["defaults", "rich"])
@pytest.mark.parametrize("kind", ["fused", "sgd"])
def test_a_step_after_unscale_is_the_optimizers_own(forbid_host_reads, kind, policy, count):
    """unscale_ then step: the unscale is the flag's fill + its pass, and the step decides its skip
    from that flag without a launch (an overflow skips it: skip_decision's found_inf > 0)."""
    params = _params(count)
    scaler = GradScaler(
        "cpu", init_scale=2.0**10, backend="triton", compile_policy=False, **(RICH if policy == "rich" else {})
    )
    counter = count_scaled_step(scaler, _optimizer(kind, params), params, clip="unscale")
    table = TABLE_REBUILD if count > 1 else []
    assert counter.counts["clip"] - len(table) <= 2, counter.ops["clip"]
    assert counter.ops["step"] == _optimizers_own_ops(kind, count)
