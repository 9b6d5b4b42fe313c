"""finalize's step results (kernels/finalize.py, kernels/skip_rule.py) against the torch-op path they
replace, bit for bit: ZClip's max_norm (spike_rules.zclip_max_norm), the clip and factor after it
(base.with_clip, base.unscaled_on_overflow), the fold's divisor with an unfit divisor counted as an
overflow unless max_norm 0 made it (grad_passes.unfit_divisor), the earlier flag merged, and the policy's
skip_decision over all of it (the norm rules, the z-score window, the isfinite gate)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from tritonscale.kernels import skip_rule
from tritonscale.kernels.finalize import finalize_kernel
from tritonscale.kernels.interfaces import KERNEL_CONSTANTS
from tritonscale.passes import grad_passes
from tritonscale.passes.backends import TritonBackend, inverse_scale
from tritonscale.passes.backends.base import unscaled_on_overflow, with_clip
from tritonscale.passes.step_decision import StepDecision, finalize_step
from tritonscale.policy import counters, spike_rules
from tritonscale.policy.loss_scale_policy import LossScalePolicy
from tritonscale.policy.state import HostState

CPU = torch.device("cpu")
POLICIES = {
    "defaults": {},
    "goes_ahead": {"skip_on_overflow": False},
    "above": {"skip_norm_above": 1.2},
    "factor": {"skip_norm_factor": 1.5, "norm_warmup_steps": 3},
    "sigma": {"skip_norm_sigma": 3.0, "skip_norm_window": 8, "skip_norm_min_steps": 2},
    "sigma_long": {"skip_norm_sigma": 2.0, "skip_norm_window": 1500},
    "zclip": {"clip_norm_z": 2.0, "clip_norm_warmup_steps": 4},
    "zclip_mean": {"clip_norm_z": 1.5, "clip_norm_warmup_steps": 4, "clip_norm_option": "mean"},
    "zclip_percentile": {"clip_norm_z": 1.0, "clip_norm_warmup_steps": 4, "clip_norm_mode": "percentile"},
    "rich": {"hysteresis": 2, "skip_norm_factor": 5.0, "skip_norm_sigma": 2.5, "clip_norm_z": 2.5},
}
#: The norms the gradients are made to have: ordinary, near and past each rule's threshold.
NORMS = [0.4, 1.0, 1.1, 1.25, 1.6, 3.0, 40.0]


def test_the_kernels_layouts_are_the_policys():
    # One home, kernels/interfaces.py; finalize hands its K (defaulted to KERNEL_CONSTANTS) to the rules.
    assert inspect.signature(finalize_kernel.fn).parameters["K"].default is KERNEL_CONSTANTS
    K = KERNEL_CONSTANTS
    assert (K.NORM_AVERAGE, K.NORM_COUNT) == (counters.NORM_AVERAGE, counters.NORM_COUNT)
    names = ("Z_SEEN", "EMA_MEAN", "EMA_VAR", "EMA_SEEN")
    assert [getattr(K, n) for n in names] == [getattr(spike_rules, n) for n in names]
    assert K.SPIKE_HEADER == spike_rules.HEADER
    assert all("K" in inspect.signature(f.fn).parameters for f in (skip_rule.skip_decision, skip_rule.zclip_max_norm))


def _state(policy: LossScalePolicy, seed: int, scale: float):
    """A device state with a history: a norm average and count, a z-score window of norms around 1
    with ``seen`` anywhere from empty to full, ZClip's average warmed up or not."""
    gen = torch.Generator().manual_seed(seed)
    state = HostState.initial(scale, policy).to_device(CPU)
    state.norm_stats.copy_(torch.tensor([0.8 + 0.1 * seed % 0.5, float(seed % 5)]))
    stats = state.spike_stats
    if stats.numel():
        history = torch.randn(stats.numel() - spike_rules.HEADER, generator=gen).double()
        stats[spike_rules.HEADER :] = 1.0 + 0.1 * history
        seen = [0, 1, 2, 5, 10**6][seed % 5]
        stats[spike_rules.Z_SEEN] = seen
        stats[spike_rules.EMA_MEAN] = 1.0 + 0.05 * seed
        stats[spike_rules.EMA_VAR] = 0.01 * (1 + seed % 3)
        stats[spike_rules.EMA_SEEN] = seen
    return state


def _grads(norm: float, scale: float, bad: float | None, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(300, generator=gen), torch.randn(7, 5, generator=gen)]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]).double())
    grads = [(g.double() / total * norm * scale).float() for g in grads]
    if bad is not None:
        grads[1][3, 2] = bad
    return grads


def _torch_op_path(policy, state, grads, scale, max_norm, earlier):
    """Today's torch-op path: the plain check, then each rule as the policy's tensor ops."""
    base = TritonBackend().check([grads], scale, 2.0, None)
    limit = max_norm
    if policy.clip_norm_z is not None:
        limit = spike_rules.zclip_max_norm(policy, state.spike_stats, base.norm, max_norm)
    result = with_clip(base, scale, limit)
    if not policy.skip_on_overflow:
        result = unscaled_on_overflow(result, scale)
    divisor = scale / result.clip_coef
    # The documented rule: a divisor that is not finite is an overflow, unless max_norm 0 made it
    # (clip_coef 0: dividing by inf is the clip's multiplication by 0, exactly).
    found = torch.maximum(result.found_inf, (~torch.isfinite(divisor) & (result.clip_coef != 0)).float())
    if earlier is not None:
        found = torch.maximum(earlier, found)
    skip = policy.skip_decision(found, result.norm, state.norm_stats, spike_stats=state.spike_stats)
    return [found, result.norm, result.clip_coef, result.factor, divisor, skip]


def _bits(values: list[torch.Tensor]) -> list[int]:
    return [int(v.reshape(()).view(torch.int32)) for v in values]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("policy_id", list(POLICIES))
def test_finalize_decides_the_step_as_the_torch_ops_do(policy_id, bad, seed):
    policy = LossScalePolicy(**POLICIES[policy_id]).validate()
    scale = torch.tensor(2.0**10)
    state = _state(policy, seed, 2.0**10)
    earlier = torch.tensor(float(seed == 3))  # a flag an earlier pass of the iteration recorded
    max_norm = [1.0, 0.0, 2.5, math.inf, 1.3][seed]
    for norm in NORMS if bad is None else NORMS[:1]:  # an inf/NaN gradient: the norm is inf/NaN whatever it was
        grads = _grads(norm, 2.0**10, bad, seed)
        step, decides = finalize_step(
            StepDecision(policy, state, {CPU: earlier}),
            CPU,
            fold=True,
            unfit_overflows=True,
            unscale_on_overflow=not policy.skip_on_overflow,
        )
        assert decides
        got = TritonBackend().check([grads], scale, 2.0, max_norm, step)
        got = [got.found_inf, got.norm, got.clip_coef, got.factor, got.grad_scale, got.skip]
        want = _torch_op_path(policy, state, grads, scale, max_norm, earlier)
        assert _bits(got) == _bits(want), (norm, [float(v) for v in got], [float(v) for v in want])


def _decided_fold(scale: float, grads_norm: float, max_norm: float):
    policy = LossScalePolicy().validate()
    state = _state(policy, 0, scale)
    step, _ = finalize_step(
        StepDecision(policy, state, {}), CPU, fold=True, unfit_overflows=True, unscale_on_overflow=False
    )
    return TritonBackend().check([_grads(grads_norm, scale, None, 0)], torch.tensor(scale), 2.0, max_norm, step)


def test_a_divisor_past_float32_is_an_overflow_and_skips():
    """A tiny clip coefficient at a scale near float32's max: scale / clip_coef overflows, and the
    optimizer dividing by it would apply zeros where the clip keeps tiny gradients: the step is
    skipped instead."""
    got = _decided_fold(2.0**126, 1.0, 1e-3)
    assert 0.0 < float(got.clip_coef) < 1e-2
    assert (float(got.grad_scale), float(got.found_inf), float(got.skip)) == (math.inf, 1.0, 1.0)


def test_max_norm_0s_infinite_divisor_is_handed_over_and_the_step_goes_ahead():
    """clip_coef 0 (max_norm 0) makes scale / clip_coef inf, which is exactly the clip: a finite
    gradient divided by inf is the signed zero torch's clip writes. No overflow, no skip."""
    got = _decided_fold(8.0, 1.0, 0.0)
    assert (float(got.clip_coef), float(got.grad_scale), float(got.found_inf), float(got.skip)) == (
        0.0,
        math.inf,
        0.0,
        0.0,
    )
    assert float(got.factor) == float(inverse_scale(torch.tensor(8.0)) * 0.0)  # the clip's factor, not 1


@pytest.mark.parametrize(
    "scale, max_norm", [(8.0, 0.0), (8.0, -0.0), (2.0**126, 1e-3), (8.0, 0.5), (8.0, 1e9)], ids=str
)
def test_the_folds_tensor_op_rule_is_the_kernels_bit_for_bit(scale, max_norm, forbid_host_reads):
    """grad_passes' divisor and its unfit flag as torch ops (where nothing is read on the host: the
    torch backend, a tensor max_norm) against the finalize kernel's, bit for bit."""
    got = _decided_fold(scale, 1.0, max_norm)
    base = TritonBackend().check([_grads(1.0, scale, None, 0)], torch.tensor(scale), 2.0, None)
    result = with_clip(base, torch.tensor(scale), torch.tensor(max_norm))
    divisor = grad_passes._fold_divisor(result, torch.tensor(scale))
    assert _bits([divisor, result.found_inf]) == _bits([got.grad_scale, got.found_inf])
