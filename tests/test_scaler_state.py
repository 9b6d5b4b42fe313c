"""scaler_state.py, optimizer_record.py and fold.py: the pieces the controller is built from."""

from __future__ import annotations

import inspect

import pytest
import torch

import tritonscale
from tritonscale.fold import step_with_amp_attributes, takes_amp_scaling
from tritonscale.optimizer_record import OptimizerRecord, OptState
from tritonscale.policy import COUNTER_NAMES, LossScalePolicy
from tritonscale.scaler_state import STATE_KEYS, HostState, from_state_dict, to_state_dict


def test_constructor_defaults_are_torchs():
    ours = inspect.signature(tritonscale.GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    for name in ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"):
        assert ours[name].default == theirs[name].default, name
    assert list(ours)[: len(theirs)] == list(theirs)  # same positional order


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
    loaded = HostState(scale=8.0, growth_tracker=5, counters=[1, 2, 3, 1, 9], norm_stats=[0.5, 4.0])
    device.load_(loaded)
    assert device.to_host() == loaded
    assert addresses == [
        t.data_ptr() for t in (device.scale, device.growth_tracker, device.counters, device.norm_stats)
    ]


def test_from_state_dict_changes_nothing_it_is_given():
    policy = LossScalePolicy(hysteresis=2)
    saved = to_state_dict(policy, HostState(4.0, 3, [1, 0, 2, 0, 7], [1.5, 2.0]))
    snapshot = repr(saved)
    new_policy, host = from_state_dict(saved, LossScalePolicy())
    assert repr(saved) == snapshot and new_policy == policy and new_policy is not policy
    assert host == HostState(4.0, 3, [1, 0, 2, 0, 7], [1.5, 2.0])


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
