"""Importing Megatron-LM, DeepSpeed and apex loss-scaler state: the trajectory continues as theirs would.

Each test runs the framework's rule (tests/peer_rules.py, tests/scale_references.py) for a while,
builds that framework's checkpoint from the rule's state in the framework's own key layout, loads it
into a GradScaler built with another policy (torch's) through tritonscale.framework_apis.checkpoint_import,
and checks the two continue identically: the checkpoint brings the peer's rule with it.
"""

from __future__ import annotations

import types

import pytest
import torch
from peer_rules import DeepSpeedFP16Rule, DeepSpeedZeroRule, FairseqRule
from scale_references import ApexRef, Loop, MegatronRef, overflow_pattern

from tritonscale import GradScaler, ScalerConfigError, from_fairseq
from tritonscale.framework_apis.checkpoint_import import from_apex, from_deepspeed, from_megatron


def continue_together(state_dict, ref, pattern):
    scaler = GradScaler("cpu", backend="torch")
    scaler.load_state_dict(state_dict)
    loop = Loop(scaler, "torch")
    for i, overflow in enumerate(pattern):
        loop.step(overflow)
        ref.update(overflow)
        assert scaler.get_scale() == ref.scale, f"step {i}"


@pytest.mark.parametrize("seed", [0, 1])
def test_megatron_checkpoint(seed):
    pattern = overflow_pattern(seed, steps=80, p=0.4)
    ref = MegatronRef(2.0**12, 1.0, 2.0, 0.5, 5, 2)
    for overflow in pattern[:37]:
        ref.update(overflow)
    saved = {"scale": torch.tensor([ref.scale]), "growth_tracker": ref.growth_tracker,
             "hysteresis_tracker": ref.hysteresis_tracker}  # fmt: skip
    continue_together(from_megatron(saved, growth_interval=5), ref, pattern[37:])


@pytest.mark.parametrize("seed", [3, 5])
@pytest.mark.parametrize("version", ["0.16.9", None], ids=["zero-0.16.9", "zero-now"])
def test_deepspeed_zero_checkpoint(seed, version):
    pattern = overflow_pattern(seed, steps=80, p=0.4)
    ref = DeepSpeedZeroRule(2.0**40, 4, 1.0, delayed_shift=3, consecutive_hysteresis=False,
                            stable_interval=version is None)  # fmt: skip
    for overflow in pattern[:41]:
        ref.update(overflow)
    # ZeRO pickles the scaler object itself: its hysteresis, floor and flags come with it.
    saved = {"loss_scaler": types.SimpleNamespace(**vars(ref)), "dynamic_loss_scale": True}
    continue_together(from_deepspeed(saved, version=version), ref, pattern[41:])


@pytest.mark.parametrize("seed", [3, 5])
def test_deepspeed_fp16_optimizer_checkpoint_has_no_hysteresis(seed):
    pattern = overflow_pattern(seed, steps=80, p=0.4)
    ref = DeepSpeedFP16Rule(2.0**12, 4, 1.0)
    for overflow in pattern[:41]:
        ref.update(overflow)
    saved = {"dynamic_loss_scale": True, "cur_scale": ref.cur_scale, "cur_iter": ref.cur_iter,
             "last_overflow_iter": ref.last_overflow_iter, "scale_factor": 2.0, "scale_window": 4}  # fmt: skip
    continue_together(from_deepspeed(saved), ref, pattern[41:])


def test_the_issues_fp16_optimizer_checkpoint_backs_off_at_the_first_overflow():
    saved = {"dynamic_loss_scale": True, "cur_scale": 1024.0, "cur_iter": 3, "last_overflow_iter": -1,
             "scale_factor": 2.0, "scale_window": 1000}  # fmt: skip
    ref = DeepSpeedFP16Rule(1024.0, 1000, 1.0)
    ref.cur_iter = 3
    continue_together(from_deepspeed(saved), ref, [True, False, False])
    assert ref.scale == 512.0


@pytest.mark.parametrize("tolerance", [0.0, 0.25])
def test_fairseq_checkpoint_restarts_its_counters_as_fairseq_does(tolerance):
    pattern = overflow_pattern(6, steps=60, p=0.3)
    ref = FairseqRule(2.0**10, 2.0, 3, tolerance, None, 1e-4)
    for overflow in pattern[:25]:
        ref.update(overflow)
    # fairseq saves only the scale; its loader puts it into a fresh DynamicLossScaler.
    saved = {"loss_scale": ref.loss_scale, "state": {}, "param_groups": []}
    restarted = FairseqRule(ref.loss_scale, 2.0, 3, tolerance, None, 1e-4)
    continue_together(from_fairseq(saved, fp16_scale_window=3, fp16_scale_tolerance=tolerance), restarted, pattern[25:])


def test_apex_checkpoint():
    pattern = overflow_pattern(4, steps=60, p=0.2)
    ref = ApexRef(2.0**22, scale_window=3, max_loss_scale=2.0**24)
    for overflow in pattern[:23]:
        ref.update(overflow)
    saved = {"loss_scaler0": {"loss_scale": ref.scale, "unskipped": ref.unskipped}}
    continue_together(from_apex(saved, scale_window=3), ref, pattern[23:])


def test_malformed_checkpoints_are_named():
    with pytest.raises(ScalerConfigError, match="Megatron.*hysteresis_tracker"):
        from_megatron({"scale": 1.0, "growth_tracker": 0})
    with pytest.raises(ScalerConfigError, match="apex.*loss_scaler0"):
        from_apex({"loss_scaler": {}})
    with pytest.raises(ScalerConfigError, match="DeepSpeed.*cur_iter"):
        from_deepspeed({"cur_scale": 2.0, "scale_window": 10})
    with pytest.raises(ScalerConfigError, match="fairseq.*loss_scale"):
        from_fairseq({"state": {}})
    with pytest.raises(ScalerConfigError, match="scale_factor=3.0; DeepSpeed's rule is 2"):
        from_deepspeed(
            {"cur_scale": 2.0, "cur_iter": 0, "last_overflow_iter": -1, "scale_window": 10, "scale_factor": 3.0}
        )
