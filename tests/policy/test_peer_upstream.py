"""Each peer's own unit tests' scenarios, transcribed, run through tritonscale.GradScaler with the preset.

Every scenario cites the upstream test it transcribes (repository, path, commit). It drives the
scaler through its real API (tests/oracles/peer_rules.py's ``follow``: backward, inf/NaN injected, step,
update) beside the transcribed rule of tests/oracles/peer_rules.py -- same float32 scale bits, same skipped
steps (the parameters unchanged exactly on a skip), same raise -- and then checks the scales the
upstream test expects, computed the way that test computes them.
"""

from __future__ import annotations

import random

import pytest
from oracles.peer_rules import RULES, ApexHysteresisRule, f32, follow
from oracles.scale_rules import Loop

from tritonscale import GradScaler, presets
from tritonscale.policy.rounding import SCALE_FLOOR


def run(name, overflows, backend, **peer_args):
    """The preset ``name`` with the peer's arguments, beside the peer's rule: the scale after each update."""
    scaler = GradScaler("cpu", policy=presets.PRESETS[name](**peer_args), backend=backend)
    return scaler, follow(scaler, RULES[name](**peer_args), overflows, backend)


def skipped_steps(scaler) -> int:
    return int(scaler.stats()["skipped_steps"])


# ------------------------------------------------------------------------------------ DeepSpeed
# deepspeedai/DeepSpeed tests/unit/runtime/half_precision/test_dynamic_loss_scale.py @ edaa7221:
# TestFused (Adam: FP16_Optimizer) and TestUnfused (Lamb: FP16_UnfusedOptimizer) run the same
# scenarios; both optimizers' _update_scale is the rule of optimizer="fp16".
@pytest.mark.parametrize("variant", ["fused", "unfused"])
def test_deepspeed_no_overflow(backend, variant):
    _, scales = run("deepspeed", [False] * 10, backend, optimizer="fp16", initial_scale_power=8, loss_scale_window=2)
    expected_loss_scale, expected_scale_window = 2**8, 2
    for i, scale in enumerate(scales):
        assert scale == expected_loss_scale  # checked after step i, whose cur_iter is i + 1
        if (i + 1) % expected_scale_window == 0:
            expected_loss_scale *= 2


@pytest.mark.parametrize("variant, min_loss_scale", [("fused", 1), ("unfused", 2.0)])
def test_deepspeed_all_overflow(backend, variant, min_loss_scale):
    overflows = [True] * 8  # inf, -inf, then six NaN
    scaler, scales = run(
        "deepspeed", overflows, backend, optimizer="fp16", initial_scale_power=4, loss_scale_window=2,
        min_loss_scale=min_loss_scale,
    )  # fmt: skip
    expected_loss_scale = 2**4
    for scale in scales:
        expected_loss_scale = max(expected_loss_scale / 2, min_loss_scale)
        assert scale == expected_loss_scale
    assert skipped_steps(scaler) == len(overflows)


@pytest.mark.parametrize("variant", ["fused", "unfused"])
def test_deepspeed_some_overflow(backend, variant):
    window = 2
    overflows = [True, True] + [False] * (window + 1) + [True]
    scaler, scales = run("deepspeed", overflows, backend, optimizer="fp16", initial_scale_power=8, loss_scale_window=2)
    expected_loss_scale = 2**8 / 2**2  # two overflows
    assert scales[1] == expected_loss_scale
    expected_loss_scale *= 2  # scale_window + 1 good steps grow it once
    assert scales[1 + window + 1] == expected_loss_scale
    assert scales[-1] == expected_loss_scale / 2
    assert skipped_steps(scaler) == 3


@pytest.mark.parametrize(
    "peer, peer_args",
    [
        ("deepspeed", dict(optimizer="fp16", initial_scale_power=8, loss_scale_window=2)),
        ("deepspeed", dict(optimizer="zero", version="0.17.1", initial_scale_power=8, loss_scale_window=2)),
        ("torch", dict(init_scale=256.0, growth_interval=2)),
        ("deepspeed", dict(optimizer="zero", version="0.16.0", initial_scale_power=8, loss_scale_window=2)),
    ],
    ids=["fp16-optimizer", "zero-0.17.1", "torch", "zero-0.16.0"],
)
def test_issue_deepspeed_grows_one_step_later_than_torch(backend, peer, peer_args):
    # Issue 28, item 1: four clean updates give DeepSpeed 256, 256, 512, 512 and torch 256, 512, 512, 1024;
    # ZeRO before e440506be (v0.17.1) grew like torch.
    _, scales = run(peer, [False] * 4, backend, **peer_args)
    late = peer == "deepspeed" and peer_args.get("version") != "0.16.0"
    assert scales == ([256.0, 256.0, 512.0, 512.0] if late else [256.0, 512.0, 512.0, 1024.0])


@pytest.mark.parametrize("optimizer", ["zero", "fp16"])
def test_deepspeed_zero_raises_at_min_scale_fp16_optimizer_does_not(backend, optimizer):
    # deepspeed/runtime/fp16/loss_scaler.py @ edaa7221, DynamicLossScaler.update_scale: an overflow with
    # the scale already at min_scale raises (raise_error_at_min_scale, True in ZeRO); FP16_Optimizer's
    # _update_scale clamps. Training stops at the raise (follow stops there).
    args = dict(initial_scale_power=1, min_loss_scale=1, hysteresis=1, optimizer=optimizer)
    _, scales = run("deepspeed", [True, True, True], backend, **args)
    assert scales == ([1.0, 1.0] if optimizer == "zero" else [1.0, 1.0, 1.0])


# ------------------------------------------------------------------------------------ Megatron
def test_issue_megatron_multiplies_float32_tensors(backend):
    # Issue 28, item 3: growth 1.1, backoff 0.9, hysteresis 2, floor 1, init 3, two overflows: Megatron
    # gives 2.6999998092651367 (float32 product of float32 tensors), not 2.700000047683716 (double).
    args = dict(initial_scale=3.0, min_scale=1.0, growth_factor=1.1, backoff_factor=0.9, hysteresis=2)
    _, scales = run("megatron", [True, True], backend, **args)
    assert scales == [3.0, 2.6999998092651367]
    assert scales[-1] != f32(3.0 * 0.9)


# ---------------------------------------------------------------------------------------- apex
# NVIDIA/apex tests/L0/run_amp/test_update_scale_hysteresis.py @ cb65b8ed~1, update_scale_hysteresis_body
# and test_fuzz. Scaled down to keep it fast: growth_interval and hysteresis 10 (upstream also 100),
# extra_iters up to 10 (upstream 1000) so that backoffs stay above float32's smallest normal, growth
# factors 2 and 4 (upstream also 1.0, which a tritonscale policy refuses: growth must be > 1).
def apex_isfinite(val):
    return 2.0**-126 <= val <= 3.4028234663852886e38


@pytest.mark.parametrize("init_scale", [1, 1024, 65536])
@pytest.mark.parametrize("growth_factor", [2.0, 4.0])
@pytest.mark.parametrize("backoff_factor", [0.5, 0.25])
def test_apex_update_scale_hysteresis(backend, init_scale, growth_factor, backoff_factor):
    growth_interval = hysteresis = 10
    rng = random.Random(init_scale + growth_factor + backoff_factor)
    extra_backoffs, extra_growths = rng.randint(0, 10), rng.randint(0, 10)
    overflows = [True] * (hysteresis - 1) + [False] * (growth_interval - 1)
    overflows += [True] * (hysteresis + extra_backoffs) + [False] * (growth_interval + extra_growths)
    _, scales = run(
        "apex-hysteresis", overflows, backend, init_scale=init_scale, growth_factor=growth_factor,
        backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis,
    )  # fmt: skip
    # infs for hysteresis-1 iterations, then no infs for growth_interval-1: the scale is unchanged.
    assert scales[hysteresis + growth_interval - 3] == init_scale
    scale_ref = float(init_scale)
    for _ in range(1 + extra_backoffs):  # backed off once per inf past the hysteresis
        scale_new = scale_ref * backoff_factor
        scale_ref = scale_new if apex_isfinite(scale_new) else 0
    backed_off = 2 * hysteresis + growth_interval - 3 + extra_backoffs
    assert scales[backed_off] == scale_ref
    for _ in range(1 + extra_growths // growth_interval):  # grown every growth_interval iterations
        scale_new = scale_ref * growth_factor
        scale_ref = scale_new if apex_isfinite(scale_new) else scale_ref
    assert scales[-1] == scale_ref


def test_apex_hysteresis_backoff_stops_at_the_smallest_normal_where_apex_reaches_zero(backend):
    # csrc/update_scale_hysteresis.cu does not check a backoff (its own test expects 0 below float32's
    # smallest normal); tritonscale never backs a scale off below SCALE_FLOOR = 2**-126 (documented).
    args = dict(init_scale=2.0**-120, backoff_factor=0.5, hysteresis=1)
    scaler = GradScaler("cpu", policy=presets.apex_hysteresis(**args), backend=backend)
    rule = ApexHysteresisRule(2.0**-120, 2.0, 0.5, 2000, 1)
    loop = Loop(scaler, backend)
    for _ in range(32):
        loop.step(True)
        rule.update(True)
        assert scaler.get_scale() == max(rule.scale, SCALE_FLOOR)
    assert rule.scale == 0.0 and scaler.get_scale() == SCALE_FLOOR == 2.0**-126


@pytest.mark.parametrize("loss_scale", [128.0, 1.0])
def test_apex_static_loss_scale_applies_overflowed_steps(backend, loss_scale):
    # apex/amp/scaler.py @ cb65b8ed~1: with a number for loss_scale, update_scale returns should_skip False.
    scaler, scales = run("apex", [False, True, False, True], backend, loss_scale=loss_scale)
    assert scales == [loss_scale] * 4 and skipped_steps(scaler) == 0


# ------------------------------------------------------------------------------------- fairseq
def test_fairseq_gradient_scaling():
    # facebookresearch/fairseq tests/test_fp16_optimizer.py @ c518c2c0, TestGradientScaling.run_iter:
    # fp16_init_scale 1, fp16_scale_window 1, tolerance 1, threshold_loss_scale 1: one good step -> 2.0.
    args = dict(fp16_init_scale=1, fp16_scale_window=1, fp16_scale_tolerance=1, threshold_loss_scale=1)
    _, scales = run("fairseq", [False], "torch", min_loss_scale=1e-4, **args)
    assert scales == [2.0]


def test_fairseq_minimum_loss_scale_raises_floating_point_error(backend):
    # fairseq/optim/dynamic_loss_scaler.py @ 0d77035e, check_overflow: the overflow that leaves the scale
    # <= min_loss_scale puts the previous scale back and raises FloatingPointError (training stops).
    args = dict(fp16_init_scale=2.0**-12, min_loss_scale=1e-4)
    scaler = GradScaler("cpu", policy=presets.fairseq(**args), backend=backend)
    scales = follow(scaler, RULES["fairseq"](**args), [True, True, True], backend)
    assert scales == [2.0**-13, 2.0**-13]  # the second overflow raised; the scale is the one before it


# --------------------------------------------------------------------------------------- Keras 3
# keras-team/keras keras/src/optimizers/loss_scale_optimizer_test.py @ 3a408dac.
def test_keras_downscaling(backend):
    _, scales = run("keras", [True] * 4, backend, initial_scale=400.0)  # test_downscaling
    assert scales[-1] == 25.0


def test_keras_upscaling(backend):
    _, scales = run("keras", [False] * 8, backend, initial_scale=2.0, dynamic_growth_steps=2)  # test_upscaling
    assert scales[-1] == 32.0


def test_keras_finite_and_infinite_step(backend):
    # test_finite_step applies the step, test_infinite_step leaves the variables (follow checks both).
    scaler, scales = run("keras", [False, True], backend)
    assert scales == [2.0**15, 2.0**14] and skipped_steps(scaler) == 1


def test_issue_keras3_backs_off_with_no_floor(backend):
    # Issue 28, item 4: Keras 3 backs off to 0.25 from 2 after three NaN steps (tf.keras 2 stops at 1).
    _, scales = run("keras", [True] * 3, backend, initial_scale=2.0)
    assert scales == [1.0, 0.5, 0.25]
    _, scales = run("tf-keras", [True] * 3, backend, initial_scale=2.0)
    assert scales == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------- tf-keras
# keras-team/tf-keras tf_keras/mixed_precision/loss_scale_optimizer_test.py @ 6add81a9.
@pytest.mark.parametrize(
    "scenario, peer_args, overflows, expected",
    [
        ("testDynamicUpdate", dict(initial_scale=2, dynamic_growth_steps=1), [False, True], [4.0, 2.0]),
        ("testCustomAggregater", dict(initial_scale=2, dynamic_growth_steps=2), [True], [1.0]),
        ("testDynamicLossScaleWithSlots", dict(initial_scale=2.0, dynamic_growth_steps=1), [False] * 2, [4.0, 8.0]),
        ("testClipping", dict(initial_scale=2, dynamic_growth_steps=1), [False, False, True], [4.0, 8.0, 4.0]),
        ("testIterationsIncremented", dict(), [False, True], [2.0**15, 2.0**14]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_tf_keras_dynamic(backend, scenario, peer_args, overflows, expected):
    scaler, scales = run("tf-keras", overflows, backend, **peer_args)
    assert scales == expected and skipped_steps(scaler) == sum(overflows)


def test_tf_keras_fixed_scale_applies_nan_steps(backend):
    # testFixedLossScaleAppliedToLossWithMinimize (dynamic=False, initial_scale 10: the step is applied);
    # issue 28, item 5: a NaN step is applied too (should_apply_grads True without a dynamic state).
    scaler, scales = run("tf-keras", [False, True, False], backend, dynamic=False, initial_scale=10.0)
    assert scales == [10.0] * 3 and skipped_steps(scaler) == 0


def test_tf_keras_default_values():
    # testDynamicLossScaleDefaultValues: initial scale 2**15.
    assert GradScaler("cpu", policy=presets.tf_keras()).get_scale() == 2**15
    assert GradScaler("cpu", policy="tf-keras").get_scale() == 2**15


# ------------------------------------------------------------------------------------- TF 1.x
# tensorflow/tensorflow tensorflow/contrib/mixed_precision/python/loss_scale_manager_test.py @ efbe7a54:
# ExponentialUpdateLossScaleManagerTest._test_helper (ratio 2, decr_ratio 1/2; its inputs are
# "gradients finite"), and FixedLossScaleManagerTest.test_basic.
F32_MAX = 3.4028234663852886e38
TF1_CASES = {
    "test_increase_every_n_steps": ([True] * 6, [1, 2, 2, 4, 4, 8], 1, 2, 2),
    "test_keep_increasing_until_capped": (
        [True] * 6, [F32_MAX / 4, F32_MAX / 2, F32_MAX / 2, F32_MAX, F32_MAX, F32_MAX], F32_MAX / 4 + 10, 2, 2,
    ),
    "test_decrease_every_n_steps": ([False] * 6, [1024, 512, 512, 256, 256, 128], 1024, 2, 2),
    "test_keep_decreasing_until_one": ([False] * 10, [16, 8, 8, 4, 4, 2, 2, 1, 1, 1], 16, 2, 2),
    "test_incr_bad_step_clear_good_step": ([True, True, True, False, True], [1, 2, 2, 2, 2], 1, 2, 2),
    "test_incr_good_step_does_not_clear_bad_step": (
        [True, True, True, False, True, False], [1, 2, 2, 2, 2, 1], 1, 2, 2,
    ),
    "test_trigger_loss_scale_update_each_step": ([True] * 3 + [False, True, True], [2, 4, 8, 4, 8, 16], 1, 1, 1),
    "test_alternating_good_and_bad_gradients_trigger_each_step": (
        [True, False] * 4 + [True], [2, 1] * 4 + [2], 1, 1, 1,
    ),
    "test_alternating_good_and_bad_gradients_trigger_incr_every_2steps": (
        [True, False] * 3 + [True], [32, 16, 16, 8, 8, 4, 4], 32, 2, 1,
    ),
    "test_random_mix_good_and_bad_gradients": (
        [False, False, True, True, True, False, True, False, True, True, True, False],
        [4, 2, 2, 4, 4, 4, 4, 2, 2, 4, 4, 4], 4, 2, 2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TF1_CASES))
def test_tf1_exponential_update_loss_scale_manager(backend, case):
    finite, expected, init_loss_scale, incr_every_n_step, decr_every_n_nan_or_inf = TF1_CASES[case]
    ratio = 2
    _, scales = run(
        "tf1", [not f for f in finite], backend, init_loss_scale=init_loss_scale, incr_every_n_steps=incr_every_n_step,
        decr_every_n_nan_or_inf=decr_every_n_nan_or_inf, incr_ratio=ratio, decr_ratio=1.0 / ratio,
    )  # fmt: skip
    assert scales == [f32(e) for e in expected]


def test_tf1_fixed_loss_scale_manager(backend):
    scaler, scales = run("tf1", [False] * 10 + [True], backend, loss_scale=1000)  # test_basic (+ one overflow)
    assert scales == [1000.0] * 11 and skipped_steps(scaler) == 1


# ------------------------------------------------------------------------------ the peers' defaults
@pytest.mark.parametrize("name", [n for n in presets.PRESETS if n != "tf1"])  # TF 1.x has no default scale or interval
def test_a_preset_name_gives_the_peers_defaults(name):
    overflows = [True, False, True, True, False]
    scaler = GradScaler("cpu", policy=name, backend="torch")
    follow(scaler, RULES[name](), overflows, "torch")
    assert presets.preset(name) == presets.PRESETS[name]()


def test_init_scale_overrides_the_presets():
    scaler = GradScaler("cpu", init_scale=512.0, policy=presets.deepspeed(loss_scale_window=2), backend="torch")
    follow(scaler, RULES["deepspeed"](initial_scale_power=9, loss_scale_window=2), [False] * 4 + [True], "torch")
