"""Importing Megatron-LM, DeepSpeed and apex loss-scaler state: the trajectory continues as theirs would.

Each test runs the framework's reference rule (tests/test_policies.py) for a while, builds that
framework's checkpoint from the reference's state in the framework's own key layout, loads it into
a GradScaler through tritonscale.framework_apis.checkpoint_import, and checks the two continue identically.
"""

from __future__ import annotations

import types

import pytest
import torch
from scale_references import ApexRef, DeepSpeedRef, Loop, MegatronRef, overflow_pattern

from tritonscale import GradScaler, ScalerConfigError
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


@pytest.mark.parametrize("zero", [False, True], ids=["fp16_optimizer", "zero"])
def test_deepspeed_checkpoint(zero):
    pattern = overflow_pattern(3, steps=80, p=0.4)
    ref = DeepSpeedRef(2.0**12, scale_window=4, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)
    for overflow in pattern[:41]:
        ref.update(overflow)
    fields = {"cur_scale": ref.scale, "cur_iter": ref.cur_iter, "last_overflow_iter": ref.last_overflow_iter,
              "scale_factor": 2.0, "scale_window": 4, "cur_hysteresis": ref.cur_hysteresis}  # fmt: skip
    if zero:  # ZeRO pickles the scaler object itself
        obj = types.SimpleNamespace(**fields, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)
        saved = {"loss_scaler": obj, "dynamic_loss_scale": True}
    else:
        saved = {"dynamic_loss_scale": True, **fields}
    # FP16_Optimizer does not save delayed_shift: it comes from the (default) configured hysteresis=2.
    continue_together(from_deepspeed(saved), ref, pattern[41:])


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
