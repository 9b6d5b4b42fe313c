"""GradScaler's public per-iteration interface, the one the adapters use (Updater, scale managers,
Lightning): each method against torch.amp.GradScaler's private state for the same calls, or a
hand-worked expectation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.amp.grad_scaler import OptState

from tritonscale import GradScaler, LossScalePolicy, ScalerConfigError


def twins(bad=None, **kw):
    """Our scaler and torch's, each with its own copy of the same parameters and gradients."""
    pairs = []
    for make in (lambda: GradScaler("cpu", backend="torch", **kw), lambda: torch.amp.GradScaler("cpu")):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
        optimizer = torch.optim.SGD(params, lr=0.1)
        scaler = make()
        scaler.scale(sum((p * (i + 1)).sum() for i, p in enumerate(params))).backward()
        if bad is not None:
            params[1].grad[0, 1] = bad
        pairs.append((params, optimizer, scaler))
    return pairs


def torch_stage(scaler, optimizer):
    return scaler._per_optimizer_states[id(optimizer)]["stage"]


def torch_found_inf(scaler, optimizer):
    return sum(v.item() for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def test_optimizer_stage_follows_torchs_stages_through_an_iteration():
    (_, opt, ours), (_, t_opt, theirs) = twins()
    assert ours.optimizer_stage(opt) is None  # nothing recorded yet (torch's defaultdict says READY)
    assert torch_stage(theirs, t_opt) is OptState.READY
    ours.unscale_(opt), theirs.unscale_(t_opt)
    assert ours.optimizer_stage(opt) is torch_stage(theirs, t_opt) is OptState.UNSCALED
    ours.step(opt), theirs.step(t_opt)
    assert ours.optimizer_stage(opt) is torch_stage(theirs, t_opt) is OptState.STEPPED
    ours.update(), theirs.update()
    assert ours.optimizer_stage(opt) is None


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_found_inf_for_is_torchs_flag_on_the_device_and_overflowed_reads_it(bad, forbid_host_reads):
    (_, opt, ours), (_, t_opt, theirs) = twins(bad)
    assert ours.found_inf_for(opt) is None and ours.overflowed(opt) is False  # before any check
    forbid_host_reads.on = True
    ours.unscale_(opt)
    flag = ours.found_inf_for(opt)  # no host read
    forbid_host_reads.on = False
    theirs.unscale_(t_opt)
    assert flag.shape == () and flag.dtype == torch.float32
    assert flag.item() == torch_found_inf(theirs, t_opt) == (0.0 if bad is None else 1.0)
    assert ours.overflowed(opt) is (bad is not None)


def test_overflowed_sums_the_flags_of_every_device_as_torch_does():
    (_, opt, ours), _ = twins()
    ours.unscale_(opt)
    record = ours._per_optimizer_states[id(opt)]
    # Two devices' flags (as a model split across GPUs leaves them): set on the second one only.
    record.found_inf_per_device = {torch.device("cpu"): torch.tensor(0.0), torch.device("meta"): torch.tensor(1.0)}
    assert ours.overflowed(opt) is True
    assert ours.found_inf_for(opt).item() == 1.0


@pytest.mark.parametrize("bad", [None, math.inf])
def test_last_norm_is_the_norm_the_last_update_used_and_the_skip_flag_what_it_decided(bad):
    (params, opt, ours), (t_params, t_opt, theirs) = twins(bad)
    assert ours.last_norm() is None and ours.last_skip_flag().item() is False  # no iteration ended yet
    assert GradScaler("cpu").last_skip_flag() is None  # no state yet (no scale())
    norm = ours.clip_grad_norm_(opt, max_norm=1.0)
    theirs.unscale_(t_opt)
    expected = torch.nn.utils.clip_grad_norm_(t_params, max_norm=1.0)
    ours.step(opt), theirs.step(t_opt)
    scale_before = theirs.get_scale()
    ours.update(), theirs.update()
    assert ours.last_norm() is not None and ours.last_norm().item() == norm.item()
    if bad is None:
        torch.testing.assert_close(norm, expected)
    flag = ours.last_skip_flag()
    assert flag.dtype == torch.bool and flag.shape == ()
    # torch skipped the step exactly when it backed the scale off.
    assert bool(flag) is ours.last_step_skipped() is (theirs.get_scale() < scale_before) is (bad is not None)
    # An iteration without a clip: no norm.
    ours.scale(sum(p.sum() for p in params)).backward()
    ours.step(opt), ours.update()
    assert ours.last_norm() is None


def test_last_skip_flag_of_a_disabled_scaler_is_its_clips_finding():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", enabled=False)
    params[0].grad = torch.tensor([1.0, math.inf, 0.0])
    scaler.step(opt)
    assert scaler.last_skip_flag() is None  # no clip: torch's plain step, nothing decided
    scaler.clip_grad_norm_(opt, max_norm=1.0)
    scaler.step(opt)
    assert scaler.last_skip_flag().item() is True and scaler.last_step_skipped() is True


def test_abandon_iteration_forgets_the_records_and_a_snapshot_undoes_the_updates():
    (params, opt, scaler), _ = twins()
    (_, twin_opt, twin), _ = twins()
    scaler.unscale_(opt)
    scaler.abandon_iteration(opt)  # as if unscale_ had not run: its stage is gone, a new unscale_ is fine
    assert scaler.optimizer_stage(opt) is None
    snapshot = scaler.snapshot()
    stats_before = {k: v.clone() for k, v in scaler.stats().items()}
    params[0].grad[0, 0] = math.inf
    scaler.unscale_(opt)
    scaler.update()  # an overflow's backoff (no step)
    assert scaler.get_scale() == twin.get_scale() / 2
    scaler.abandon_iteration(opt, snapshot)
    assert scaler.state_dict() == twin.state_dict() == snapshot.state
    for name, value in scaler.stats().items():
        assert torch.equal(value, stats_before[name]) or (value.isnan().all() and stats_before[name].isnan().all())
    # ... and it goes on as the twin that saw none of it.
    for s, o in ((scaler, opt), (twin, twin_opt)):
        o.zero_grad()
        s.scale(sum(q.sum() for q in o.param_groups[0]["params"])).backward()
        s.step(o), s.update()
    assert scaler.state_dict() == twin.state_dict()


def test_abandon_iteration_without_an_optimizer_forgets_every_optimizer():
    (_, opt, scaler), _ = twins()
    scaler.unscale_(opt)
    scaler.abandon_iteration()
    assert scaler.optimizer_stage(opt) is None


def test_get_policy_is_a_copy_of_the_policy_in_use():
    scaler = GradScaler("cpu", policy=LossScalePolicy(hysteresis=2, min_scale=1.0, growth_interval=7))
    policy = scaler.get_policy()
    assert policy == LossScalePolicy(hysteresis=2, min_scale=1.0, growth_interval=7)
    assert scaler.get_policy().skip_on_overflow is True
    policy.growth_interval = 3  # a copy: the scaler keeps its own
    assert scaler.get_growth_interval() == 7
    assert GradScaler("cpu", policy=LossScalePolicy.fixed(skip_on_overflow=False)).get_policy().dynamic is False


def test_place_state_makes_the_state_where_asked_once():
    scaler = GradScaler("cpu", init_scale=8.0)
    assert scaler._scale is None
    assert scaler.place_state("cpu") == torch.device("cpu")
    assert scaler.stats()["scale"].item() == 8.0  # placed: stats() works before any scale()
    scale = scaler._scale
    assert scaler.place_state(torch.device("meta")) == torch.device("cpu")  # already placed: stays
    assert scaler._scale is scale


def test_settings_read_back_the_constructors_arguments():
    assert GradScaler("cpu").fold_into_optimizer is True
    assert GradScaler("cpu", fold_into_optimizer=False).fold_into_optimizer is False
    assert GradScaler("cpu").process_group is None


def test_a_growth_factor_past_the_float_range_is_refused_clearly():
    # An int past the float range is a ScalerConfigError naming the knob (it was an OverflowError).
    with pytest.raises(ScalerConfigError, match="growth factor"):
        GradScaler("cpu", growth_factor=10**400)
