"""Importing Megatron-LM, DeepSpeed and apex loss-scaler state: the trajectory continues as theirs would.

Each test runs the framework's rule (tests/oracles/peer_rules.py, tests/oracles/scale_rules.py) for a while,
builds that framework's checkpoint from the rule's state in the framework's own key layout, loads it
into a GradScaler built with another policy (torch's) through tritonscale.peer_apis.checkpoint_import,
and checks the two continue identically: the checkpoint brings the peer's rule with it.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from oracles.peer_rules import DeepSpeedFP16Rule, DeepSpeedZeroRule, FairseqRule
from oracles.scale_rules import ApexRef, Loop, MegatronRef, overflow_pattern

from tritonscale import GradScaler, ScalerConfigError, from_fairseq
from tritonscale.peer_apis.checkpoint_import import from_apex, from_deepspeed, from_megatron


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


# ------------------------------------------------ what each importer reads is checked, by key
IMPORTERS = {"from_megatron": from_megatron, "from_deepspeed": from_deepspeed, "from_apex": from_apex,
             "from_fairseq": from_fairseq}  # fmt: skip


@pytest.mark.parametrize("state", [None, [4096.0, 0, 2], "ckpt.pt", 4096.0], ids=["none", "list", "path", "float"])
@pytest.mark.parametrize("name", sorted(IMPORTERS))
def test_a_state_that_is_not_a_dict_is_refused_naming_the_importer_and_what_it_takes(name, state):
    shown = "None" if state is None else type(state).__name__
    with pytest.raises(ScalerConfigError, match=rf"^{name} takes .*state_dict\(\) \(a dict.*\), got {shown}"):
        IMPORTERS[name](state)


def _zero_scaler(**changed):
    """A pickled ZeRO DynamicLossScaler's attributes (DeepSpeed's names), ``changed`` replacing some."""
    fields = {"cur_scale": 1024.0, "cur_iter": 9, "last_overflow_iter": 4, "scale_factor": 2.0, "scale_window": 4,
              "min_scale": 1.0, "delayed_shift": 2, "cur_hysteresis": 1, "consecutive_hysteresis": False,
              "raise_error_at_min_scale": True}  # fmt: skip
    return types.SimpleNamespace(**{**fields, **changed})


# Each importer's good state, and the path of each value it reads in it: (importer, state, key, kind).
GOOD = {
    "from_megatron": lambda **c: {"scale": torch.tensor([4096.0]), "growth_tracker": 3, "hysteresis_tracker": -1, **c},
    "from_deepspeed": lambda **c: {"dynamic_loss_scale": True, "cur_scale": 1024.0, "cur_iter": 3,
                                   "last_overflow_iter": -1, "scale_factor": 2.0, "scale_window": 1000, **c},
    "from_deepspeed(zero)": lambda **c: {"loss_scaler": _zero_scaler(**c)},
    "from_apex": lambda **c: {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 5, **c}},
    "from_fairseq": lambda **c: {"loss_scale": 128.0, **c},
}  # fmt: skip
READ = [
    ("from_megatron", "scale", "scale"),
    ("from_megatron", "growth_tracker", "count"),
    ("from_megatron", "hysteresis_tracker", "count"),
    ("from_deepspeed", "cur_scale", "scale"),
    ("from_deepspeed", "cur_iter", "count"),
    ("from_deepspeed", "last_overflow_iter", "count"),
    ("from_deepspeed", "scale_window", "count"),
    ("from_deepspeed", "scale_factor", "scale"),
    ("from_deepspeed", "dynamic_loss_scale", "flag"),
    ("from_deepspeed(zero)", "cur_scale", "scale"),
    ("from_deepspeed(zero)", "min_scale", "scale"),
    ("from_deepspeed(zero)", "delayed_shift", "count"),
    ("from_deepspeed(zero)", "cur_hysteresis", "count"),
    ("from_deepspeed(zero)", "consecutive_hysteresis", "flag"),
    ("from_deepspeed(zero)", "raise_error_at_min_scale", "flag"),
    ("from_apex", "loss_scale", "scale"),
    ("from_apex", "unskipped", "count"),
    ("from_fairseq", "loss_scale", "scale"),
]
BAD = {
    # Each as GradScaler.load_state_dict would refuse it for its scale (it loads 0 as torch's underflow,
    # which no peer saves: refused here), and for a tracker (an int, also as a one-element tensor).
    "scale": ["abc", None, True, torch.tensor([1.0, 2.0]), float("nan"), float("inf"), -1.0, 0.0, 1e300],
    "count": ["3", None, 2.5, torch.tensor([1, 2]), -5],
    "flag": ["yes", 1, None],
}
# Megatron's hysteresis tracker goes below 0 (each overflow past the budget backs off): -5 is in range.
IN_RANGE = {("hysteresis_tracker", "-5")}
CASES = [(w, k, bad) for w, k, kind in READ for bad in BAD[kind] if (k, repr(bad)) not in IN_RANGE]


def _call(who, state):
    return IMPORTERS[who.split("(")[0]](state)


@pytest.mark.parametrize("who, key, bad", CASES, ids=[f"{w}-{k}-{i}" for i, (w, k, _) in enumerate(CASES)])
def test_every_value_an_importer_reads_is_checked_naming_the_key(who, key, bad):
    _call(who, GOOD[who]())  # the good state loads
    importer = who.split("(")[0]
    with pytest.raises(ScalerConfigError, match=rf"^{importer}: state(\['loss_scaler0?'\])?\['{key}'\]"):
        _call(who, GOOD[who](**{key: bad}))


@pytest.mark.parametrize("who", sorted(GOOD))
def test_one_element_tensors_and_numpy_numbers_load_as_the_plain_numbers(who):
    plain = _call(who, GOOD[who]())
    as_tensors = {key: torch.tensor(plain_value) for key, plain_value in _read_values(who).items()}
    as_numpy = {key: np.array(plain_value)[()] for key, plain_value in _read_values(who).items()}
    assert _call(who, GOOD[who](**as_tensors)) == plain
    assert _call(who, GOOD[who](**as_numpy)) == plain
    scaler = GradScaler("cpu", backend="torch")
    scaler.load_state_dict(plain)  # what the importer returns loads


def _read_values(who):
    """The numbers (not flags) of ``who``'s good state that the importer reads."""
    state = GOOD[who]()
    fields = vars(state["loss_scaler"]) if who.endswith("(zero)") else state.get("loss_scaler0", state)
    numbers = {key: fields[key] for w, key, kind in READ if w == who and kind != "flag"}
    return {key: float(v) if isinstance(v, torch.Tensor) else v for key, v in numbers.items()}
