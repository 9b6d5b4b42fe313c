"""checkpoint_codec.py, policy/state.py, optimizer_record.py and step_protocols.py: the pieces the
controller is built from."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import numpy as np
import pytest
import torch

import tritonscale
from tritonscale.scaler.step_protocols import step_with_amp_attributes, takes_amp_scaling
from tritonscale.policy.counters import COUNTER_NAMES
from tritonscale.policy.loss_scale_policy import LossScalePolicy
from tritonscale.policy.state import HostState
from tritonscale.scaler.checkpoint_codec import STATE_KEYS, from_state_dict, to_state_dict
from tritonscale.scaler.optimizer_record import OptimizerRecord, OptState
from tritonscale.torch_compat import FUSED_ADAGRAD_AMP_SCALING, has_torch


def test_constructor_defaults_are_torchs():
    """Oracle: torch.amp.GradScaler's own signature. The defaults are its plain values (same type,
    same repr: help() reads as torch's), in its positional order."""
    ours = inspect.signature(tritonscale.GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    for name in ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"):
        assert ours[name].default == theirs[name].default, name
        assert type(ours[name].default) is type(theirs[name].default), name
        assert repr(ours[name].default) == repr(theirs[name].default), name
        assert ours[name].kind == theirs[name].kind, name
    assert list(ours)[: len(theirs)] == list(theirs)  # same positional order
    assert "passed" not in ours  # noting_passed's channel is not the caller's


def test_state_dict_starts_with_torchs_keys_in_torchs_order():
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    assert tuple(scaler.state_dict()) == STATE_KEYS
    ours = to_state_dict(LossScalePolicy(), HostState.initial(2.0**16, LossScalePolicy()))
    assert tuple(ours)[: len(STATE_KEYS)] == STATE_KEYS


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_host_and_device_state_round_trip_in_place(hysteresis):
    policy = LossScalePolicy(hysteresis=hysteresis)
    initial = HostState.initial(1024.0, policy)
    assert initial.counters == [hysteresis] + [0] * (len(COUNTER_NAMES) - 1)
    device = initial.to_device(torch.device("cpu"))
    assert device.to_host() == initial
    tensors = (device.scale, device.growth_tracker, device.counters, device.norm_stats)
    addresses = [t.data_ptr() for t in tensors]
    loaded = HostState(scale=8.0, growth_tracker=5, counters=[1, 2, 3, 1, 9, 4, 6], norm_stats=[0.5, 4.0])
    device.load_(loaded)
    assert device.to_host() == loaded
    assert addresses == [
        t.data_ptr() for t in (device.scale, device.growth_tracker, device.counters, device.norm_stats)
    ]


def test_from_state_dict_changes_nothing_it_is_given():
    policy = LossScalePolicy(hysteresis=2)
    saved = to_state_dict(policy, HostState(4.0, 3, [1, 0, 2, 0, 7, 0, 0], [1.5, 2.0]))
    snapshot = repr(saved)
    new_policy, host = from_state_dict(saved, LossScalePolicy())
    assert repr(saved) == snapshot and new_policy == policy and new_policy is not policy
    assert host == HostState(4.0, 3, [1, 0, 2, 0, 7, 0, 0], [1.5, 2.0])


def test_optimizer_record_serves_torchs_keys_only():
    record = OptimizerRecord()
    assert record["stage"] is OptState.READY and record["found_inf_per_device"] == {}
    with pytest.raises(KeyError):
        record["grad_scale"]


class _FusedLike(torch.optim.SGD):
    """Declares torch's fused-optimizer protocol and records what step() saw."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, fail=False):
        self.seen = (self.grad_scale, self.found_inf)
        if fail:
            raise RuntimeError("optimizer failed")
        return "stepped"


def test_fold_handshake_sets_attributes_for_one_step_and_always_removes_them():
    optimizer = _FusedLike([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert takes_amp_scaling(optimizer) and not takes_amp_scaling(torch.optim.SGD(optimizer.param_groups, lr=0.1))
    grad_scale, found_inf = torch.tensor(4.0), torch.tensor(0.0)
    attributes = {"grad_scale": grad_scale, "found_inf": found_inf}
    assert step_with_amp_attributes(optimizer, optimizer, attributes) == "stepped"
    assert optimizer.seen == (grad_scale, found_inf)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    with pytest.raises(RuntimeError, match="optimizer failed"):
        step_with_amp_attributes(optimizer, optimizer, attributes, (), {"fail": True})
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


# ------------------------------------- a growth tracker at or past growth_interval (torch keeps it)
def _drive(scaler, pattern):
    """One step per entry (True: an inf gradient), through scale/step/update; each step's
    (scale, growth tracker)."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    seen = []
    for overflow in pattern:
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[1] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        seen.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return seen


# The tracker counts past the interval without growing (torch grows only when it *equals* the
# interval) until an overflow restarts it; then growth every 3 good steps.
PATTERN = [False] * 4 + [True] + [False] * 7 + [True, False, False, False]


@pytest.mark.parametrize("started", [False, True], ids=["before-scale", "after-scale"])
def test_own_state_dict_after_lowering_growth_interval_loads_and_continues_as_torch(backend, started):
    ours = tritonscale.GradScaler("cpu", init_scale=4.0, growth_interval=10, backend=backend)
    _drive(ours, [False] * 5)
    ours.set_growth_interval(3)
    saved = ours.state_dict()
    assert saved["_growth_tracker"] == 5 and saved["growth_interval"] == 3
    loaded = tritonscale.GradScaler("cpu", backend=backend)
    if started:
        loaded.scale(torch.ones(()))
    loaded.load_state_dict(saved)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    expected = _drive(theirs, PATTERN)
    assert max(tracker for _, tracker in expected) > 3  # the pattern counts past the interval
    assert _drive(loaded, PATTERN) == expected
    assert _drive(ours, PATTERN) == expected  # and so does the scaler that saved it


def test_pytorchs_tracker_7_with_growth_interval_1_loads(backend):
    # PyTorch's test_grad_scaling_state_dict sets _init_growth_tracker = 7 beside growth_interval=1.
    source = torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    source._init_growth_tracker = 7
    saved = source.state_dict()
    assert saved["_growth_tracker"] == 7
    ours = tritonscale.GradScaler("cpu", backend=backend)
    ours.load_state_dict(saved)
    assert ours._get_growth_tracker() == 7 and ours.get_growth_interval() == 1
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    assert _drive(ours, PATTERN) == _drive(theirs, PATTERN)


# Each of torch's knobs, with a value every numpy type below holds exactly; integer types only where
# the value is an integer, float types not for growth_interval (torch's update() refuses one, and a
# Python 3.0 is refused here too).
NUMPY_KNOBS = {"init_scale": 8.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3}
NUMPY_TYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
NUMPY_CASES = [
    (knob, kind)
    for knob, value in NUMPY_KNOBS.items()
    for kind in NUMPY_TYPES
    if (float(value).is_integer() if np.issubdtype(kind, np.integer) else knob != "growth_interval")
]
# The types torch's state_dict has for its entries given plain Python numbers (scale once started).
TORCH_ENTRY_TYPES = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                     "_growth_tracker": int}  # fmt: skip


@pytest.mark.parametrize("knob, kind", NUMPY_CASES, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_numpy_knobs_give_torchs_state(knob, kind):
    value = kind(NUMPY_KNOBS[knob])
    ours = tritonscale.GradScaler("cpu", backend="torch", **{knob: value})
    theirs = torch.amp.GradScaler("cpu", **{knob: value})
    for _ in range(2):  # before the first step, then after PATTERN
        saved, expected = ours.state_dict(), theirs.state_dict()
        assert {k: saved[k] for k in STATE_KEYS} == expected
        assert {k: type(saved[k]) for k in STATE_KEYS} == TORCH_ENTRY_TYPES  # plain numbers: see below
        assert _drive(ours, PATTERN) == _drive(theirs, PATTERN)
    # torch keeps the numpy scalar, which torch.load (weights_only, its default) refuses; ours loads.
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    assert torch.load(io.BytesIO(buffer.getvalue())) == ours.state_dict()
    # torch's checkpoint, numpy values and all, loads here and continues as torch.
    loaded = tritonscale.GradScaler("cpu", backend="torch")
    loaded.load_state_dict(theirs.state_dict())
    assert _drive(loaded, PATTERN) == _drive(theirs, PATTERN)


@pytest.mark.parametrize("bad", [np.bool_(True), True, "4", np.str_("4")], ids=repr)
@pytest.mark.parametrize("knob", list(NUMPY_KNOBS))
def test_bools_and_non_numbers_are_still_refused_naming_the_knob(knob, bad):
    with pytest.raises(tritonscale.ScalerConfigError, match=knob.replace("_", "[ _]")):
        tritonscale.GradScaler("cpu", backend="torch", **{knob: bad})


ADAGRAD_FOLDS = pytest.mark.skipif(
    not has_torch(FUSED_ADAGRAD_AMP_SCALING),
    reason="fused Adagrad declares amp scaling from torch 2.12; before, it is unscaled in place (test_torch_compat)",
)
FUSED_ADAGRAD = pytest.param(torch.optim.Adagrad, marks=ADAGRAD_FOLDS)
FUSED_CLASSES = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, FUSED_ADAGRAD]


@pytest.mark.parametrize("cls", FUSED_CLASSES)
def test_a_copied_torch_fused_optimizer_still_takes_amp_scaling(cls):
    # torch drops _step_supports_amp_scaling when it pickles an optimizer (only defaults, state and
    # param_groups travel), yet the copy steps fused: it must fold as the original does.
    fused = cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1, fused=True)
    plain = cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for copied in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert not hasattr(copied, "_step_supports_amp_scaling") and takes_amp_scaling(copied)
    assert takes_amp_scaling(fused) and not takes_amp_scaling(copy.deepcopy(plain))


def test_torchs_checkpoint_over_a_peer_rule_says_which_knobs_it_replaces(recwarn):
    """torch's checkpoint carries torch's three knobs and nothing else: loaded over Megatron's rule it
    sets torch's growth_interval, as torch's own load would, and says so; the rule's hysteresis and
    floor stay. Over torch's own rule, or from our checkpoint, nothing is said."""
    theirs = torch.amp.GradScaler("cpu", growth_interval=2000)
    ours = tritonscale.GradScaler("cpu", policy="megatron")
    with pytest.warns(UserWarning, match=r"growth_interval=2000 \(was 1000\)") as caught:
        ours.load_state_dict(theirs.state_dict())
    assert caught[0].filename == __file__  # pointed at the caller's line
    policy = ours.get_policy()
    assert (policy.growth_interval, policy.hysteresis, policy.min_scale) == (2000, 2, 1.0)
    recwarn.clear()
    tritonscale.GradScaler("cpu").load_state_dict(theirs.state_dict())  # torch's rule: nothing replaced
    tritonscale.GradScaler("cpu", policy="megatron").load_state_dict(ours.state_dict())  # ours: knobs travel
    tritonscale.GradScaler("cpu", policy="megatron").load_state_dict(
        torch.amp.GradScaler("cpu", growth_interval=1000).state_dict()  # the same knobs: nothing changes
    )
    assert [str(w.message) for w in recwarn] == []
