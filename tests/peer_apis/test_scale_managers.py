"""Scale managers (MindSpore's Fixed/DynamicLossScaleManager, TF1's Fixed/ExponentialUpdateLossScaleManager).

Each manager's scale is checked step for step against the hand-written reference of its original
(tests/oracles/scale_rules.py) and against hand-worked sequences, through ``update_loss_scale`` with a
bool and with device tensors (which must read nothing on the host), and through its GradScaler in a
real training loop against a GradScaler configured directly and torch's own.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from oracles.scale_rules import MindSporeRef, TensorFlowExponentialRef, f32, overflow_pattern

import tritonscale
from tritonscale import (
    DynamicLossScaleManager,
    ExponentialUpdateLossScaleManager,
    FixedLossScaleManager,
    GradScaler,
    LossScalePolicy,
    ScalerConfigError,
    host_reads,
)
from tritonscale.peer_apis import scale_managers

#: The forms update_loss_scale takes a flag in: a Python bool, or one-element tensors.
FORMS = ["bool", "bool-tensor", "float-tensor", "int-tensor-1d"]


def flag(value: bool, form: str) -> bool | torch.Tensor:
    if form == "bool":
        return value
    if form == "bool-tensor":
        return torch.tensor(value)
    if form == "float-tensor":
        return torch.tensor(float(value))
    return torch.tensor([int(value)], dtype=torch.int32)


def mindspore_update(manager, overflow, form, guard):
    """One update_loss_scale(overflow) with every host read forbidden."""
    with guard.armed():
        manager.update_loss_scale(flag(overflow, form))


def tf_update(manager, overflow, form, guard):
    """TF1 passes the negation: finite_grads."""
    with guard.armed():
        manager.update_loss_scale(flag(not overflow, form))


class Loop:
    """A one-parameter loop whose gradient is made inf on request."""

    def __init__(self, scaler):
        self.param = torch.nn.Parameter(torch.ones(8))
        self.opt = torch.optim.SGD([self.param], lr=1e-3)
        self.scaler = scaler

    def step(self, overflow):
        self.opt.zero_grad()
        self.scaler.scale(self.param.sum()).backward()
        if overflow:
            self.param.grad[3] = math.inf
        self.scaler.step(self.opt)
        self.scaler.update()


# ============================================================== MindSpore DynamicLossScaleManager
def test_dynamic_manager_defaults_are_mindspores():
    manager = DynamicLossScaleManager()
    assert manager.get_loss_scale() == 2.0**24 and isinstance(manager.get_loss_scale(), float)
    assert (manager.scale_factor, manager.scale_window, manager.bad_step_max) == (2, 2000, 1000)
    assert manager.get_drop_overflow_update() is True
    assert manager.grad_scaler.get_growth_interval() == 2000
    assert repr(manager) == "DynamicLossScaleManager(init_loss_scale=16777216.0, scale_factor=2, scale_window=2000)"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed, factor, window", [(0, 2, 3), (1, 4, 1), (2, 2, 5)])
def test_dynamic_manager_follows_mindspore_step_for_step(forbid_host_reads, form, seed, factor, window):
    manager = DynamicLossScaleManager(2**12, factor, window)
    ref = MindSporeRef(2**12, factor, window)
    for i, overflow in enumerate(overflow_pattern(seed, p=0.4)):
        mindspore_update(manager, overflow, form, forbid_host_reads)
        ref.update(overflow)
        assert manager.get_loss_scale() == ref.scale, f"step {i}"
    assert manager.grad_scaler._scale.device.type == "cpu"


def test_dynamic_manager_counts_scale_window_from_the_last_overflow():
    # Worked by hand from MindSpore's rule: grow when (cur_iter - last_overflow_iter) % 3 == 0.
    # Counting from the start instead would grow at iteration 3, counting all good steps at 4.
    manager = DynamicLossScaleManager(16, 2, 3)
    scales = []
    for overflow in [False, True, False, False, False, False, False, False]:
        manager.update_loss_scale(overflow)
        scales.append(manager.get_loss_scale())
    assert scales == [16, 8, 8, 8, 16, 16, 16, 32]


def test_dynamic_manager_never_goes_below_one():
    manager = DynamicLossScaleManager(4, 2, 100)
    scales = []
    for _ in range(4):
        manager.update_loss_scale(True)
        scales.append(manager.get_loss_scale())
    assert scales == [2, 1, 1, 1]
    thirds = DynamicLossScaleManager(2, 3, 1)  # max(2 * (1/3), 1)
    thirds.update_loss_scale(True)
    assert thirds.get_loss_scale() == 1.0
    thirds.update_loss_scale(False)  # and it grows again from the floor
    assert thirds.get_loss_scale() == 3.0


def test_dynamic_manager_grows_without_clamp_up_to_float32s_largest_power():
    # MindSpore's rule has no upper bound: the scale grows past 2**24, 2**64, ... up to 2**127.
    manager = DynamicLossScaleManager(2**100, 2, 1)
    ref = MindSporeRef(2**100, 2, 1)
    for exponent in range(101, 128):
        manager.update_loss_scale(False)
        ref.update(False)
        assert manager.get_loss_scale() == ref.scale == 2.0**exponent
    # The next growth leaves float32's range. MindSpore's Python manager holds 2**128 as an int,
    # a loss scale that is inf once it multiplies a float32 loss (MindSpore's update cell stores
    # inf); ours keeps the largest finite power, so that an overflow can still back it off.
    manager.update_loss_scale(False)
    ref.update(False)
    assert ref.scale == 2**128 and f32(ref.scale) == math.inf
    assert manager.get_loss_scale() == 2.0**127
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 2.0**126


@pytest.mark.parametrize("form", FORMS)
def test_dynamic_manager_raises_once_more_than_1000_overflows_come_in_a_row(form):
    manager = DynamicLossScaleManager(2**10, 2, 50)
    ref = MindSporeRef(2**10, 2, 50)
    # A good step restarts the count: 999 overflows, a good step, then 1000 overflows pass.
    for overflow in [True] * 999 + [False] + [True] * 1000:
        manager.update_loss_scale(flag(overflow, form))
        ref.update(overflow)
    assert manager.get_loss_scale() == ref.scale == 1.0
    # The 1001st in a row raises, after the update (MindSpore's order).
    with pytest.raises(RuntimeError, match="too many"):
        ref.update(True)
    with pytest.raises(RuntimeError, match=r"1001 overflows in a row, more than bad_step_max=1000"):
        manager.update_loss_scale(flag(True, form))
    assert manager.grad_scaler.stats()["consecutive_skips"].item() == ref.bad_step == 1001
    with pytest.raises(RuntimeError, match=r"1002 overflows in a row"):  # each further overflow too
        manager.update_loss_scale(flag(True, form))
    manager.update_loss_scale(flag(False, form))  # a good step ends the run of overflows
    manager.update_loss_scale(flag(True, form))


def test_dynamic_manager_checks_the_limit_with_one_host_read_per_1000_updates(monkeypatch):
    # The GPU path (on the CPU the policy rule reads its state on the host, where that is free).
    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))
    manager = DynamicLossScaleManager(2**10, 2, 50, device="cpu")
    overflow, good = torch.tensor(True), torch.tensor(False)
    for _ in range(1000):
        manager.update_loss_scale(overflow)
    assert reads == []  # 1000 in a row cannot be more than 1000
    with pytest.raises(RuntimeError, match="1001 overflows"):
        manager.update_loss_scale(overflow)
    reads.clear()
    for _ in range(3000):
        manager.update_loss_scale(good)
    assert len(reads) == 3  # not one per update


def test_dynamic_manager_raises_in_a_loop_driven_by_its_grad_scaler():
    manager = DynamicLossScaleManager(2**10, 2, 50, backend="torch")
    loop = Loop(manager.grad_scaler)
    for _ in range(1000):
        loop.step(overflow=True)
    with pytest.raises(RuntimeError, match="1001 overflows in a row"):
        loop.step(overflow=True)


def test_dynamic_manager_limit_follows_a_loaded_state_dict():
    manager = DynamicLossScaleManager(2**10, 2, 50)
    for _ in range(999):
        manager.update_loss_scale(True)
    restored = DynamicLossScaleManager(2**10, 2, 50)
    restored.grad_scaler.load_state_dict(manager.grad_scaler.state_dict())
    restored.update_loss_scale(True)  # the 1000th in a row
    with pytest.raises(RuntimeError, match="1001 overflows"):
        restored.update_loss_scale(True)
    unpickled = pickle.loads(pickle.dumps(manager))
    unpickled.update_loss_scale(True)
    with pytest.raises(RuntimeError, match="1001 overflows"):
        unpickled.update_loss_scale(True)


def test_dynamic_manager_with_scale_factor_one_keeps_its_scale():
    manager = DynamicLossScaleManager(64, 1, 2)
    ref = MindSporeRef(64, 1, 2)
    for overflow in overflow_pattern(4, steps=30, p=0.5):
        manager.update_loss_scale(overflow)
        ref.update(overflow)
        assert manager.get_loss_scale() == ref.scale == 64
    assert manager.get_drop_overflow_update() is True


# ============================================================== TF1 ExponentialUpdateLossScaleManager
def test_exponential_manager_defaults_are_tf1s():
    manager = ExponentialUpdateLossScaleManager(2**15, 1000)
    policy = manager.grad_scaler._policy
    assert (policy.growth_factor, policy.backoff_factor, policy.growth_interval, policy.hysteresis) == (
        2.0,
        f32(0.8),
        1000,
        2,
    )
    assert manager.get_loss_scale() == 2.0**15 and manager.get_drop_overflow_update() is True


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "seed, incr_n, decr_n, incr_ratio, decr_ratio",
    [(0, 3, 2, 2, 0.5), (1, 3, 2, 2, 0.8), (2, 2, 3, 3, 0.7), (3, 1, 1, 1.5, 0.8)],
)
def test_exponential_manager_follows_tf1_step_for_step(forbid_host_reads, form, seed, incr_n, decr_n, incr_ratio,
                                                       decr_ratio):  # fmt: skip
    # Ratios like 0.8 are not exact in float32: the scale must still equal TF1's float32 products.
    manager = ExponentialUpdateLossScaleManager(2**10, incr_n, decr_n, incr_ratio, decr_ratio)
    ref = TensorFlowExponentialRef(2**10, incr_n, decr_n, incr_ratio, decr_ratio)
    for i, overflow in enumerate(overflow_pattern(seed, p=0.5)):
        tf_update(manager, overflow, form, forbid_host_reads)
        ref.update(overflow)
        assert manager.get_loss_scale() == ref.scale, f"step {i}"


def test_exponential_manager_counters():
    # Worked by hand from TF1's rule, incr_every_n_steps=3, decr_every_n_nan_or_inf=2.
    manager = ExponentialUpdateLossScaleManager(16, 3, 2, 2, 0.5)
    scales = []
    for finite in [True, True, False, True, False, True, True, True]:
        manager.update_loss_scale(finite_grads=finite)
        scales.append(manager.get_loss_scale())
    # Step 3's bad step zeroes the good count (no growth at step 4); step 4's good step leaves
    # the bad count, so step 5 is the second bad step and decreases; the change zeroes both, and
    # three good steps grow the scale at step 8.
    assert scales == [16, 16, 16, 16, 8, 8, 8, 16]
    manager = ExponentialUpdateLossScaleManager(16, 3, 3, 2, 0.5)
    scales = []
    for finite in [True, True, False, True, True, True]:
        manager.update_loss_scale(finite)
        scales.append(manager.get_loss_scale())
    assert scales == [16, 16, 16, 16, 16, 32]  # the bad step restarted the good count


def test_exponential_manager_grows_only_while_the_result_is_finite():
    manager = ExponentialUpdateLossScaleManager(2**126, 1, 2, 3, 0.5)
    ref = TensorFlowExponentialRef(2**126, 1, 2, 3, 0.5)
    for _ in range(3):
        manager.update_loss_scale(True)
        ref.update(False)
        assert manager.get_loss_scale() == ref.scale == 1.5 * 2.0**127  # 3 * 2**126, then kept
    # A growth refused as non-finite still zeroes both counters (TF1 resets them in either case):
    # the bad step before it no longer counts, so two more bad steps are needed to decrease.
    manager = ExponentialUpdateLossScaleManager(2**127, 2, 2, 2, 0.5)
    scales = []
    for finite in [False, True, True, False, False]:
        manager.update_loss_scale(finite)
        scales.append(manager.get_loss_scale())
    assert scales == [2.0**127] * 4 + [2.0**126]


def test_exponential_manager_never_goes_below_one():
    manager = ExponentialUpdateLossScaleManager(2, 10, 1, 2, 0.8)
    ref = TensorFlowExponentialRef(2, 10, 1, 2, 0.8)
    scales = []
    for _ in range(5):
        manager.update_loss_scale(False)
        ref.update(True)
        scales.append(manager.get_loss_scale())
        assert scales[-1] == ref.scale
    two, eight = f32(2 * f32(0.8)), f32(f32(2 * f32(0.8)) * f32(0.8))
    assert scales == [two, eight, f32(eight * f32(0.8)), 1.0, 1.0]  # 1.024 * 0.8 < 1: floored


# ============================================================== FixedLossScaleManager
@pytest.mark.parametrize(
    "args, kwargs, scale, drop",
    [
        ((), {}, 128.0, True),  # MindSpore's defaults
        ((5000,), {}, 5000.0, True),  # TF1: FixedLossScaleManager(loss_scale); its optimizer drops overflows
        ((1024.0, False), {}, 1024.0, False),
        ((), {"loss_scale": 2, "drop_overflow_update": False}, 2.0, False),
    ],
)
def test_fixed_manager_takes_both_originals_signatures(args, kwargs, scale, drop):
    manager = FixedLossScaleManager(*args, **kwargs)
    assert manager.get_loss_scale() == scale and manager.get_drop_overflow_update() is drop
    assert manager.grad_scaler._policy.dynamic is False


def test_fixed_manager_update_is_a_no_op_in_both_meanings(forbid_host_reads):
    manager = FixedLossScaleManager(512.0)
    with forbid_host_reads.armed():
        for value in (True, False, torch.tensor(True), torch.tensor([0.0])):
            manager.update_loss_scale(value)  # MindSpore: overflow
            manager.update_loss_scale(overflow=value)
            manager.update_loss_scale(finite_grads=value)  # TF1
    assert manager.get_loss_scale() == 512.0
    assert manager.grad_scaler._scale is None  # nothing even placed the state
    with pytest.raises(TypeError, match="one of overflow"):
        manager.update_loss_scale()
    with pytest.raises(TypeError, match="one of overflow"):
        manager.update_loss_scale(True, finite_grads=True)
    with pytest.raises(TypeError, match="finite_grads must be a bool or a one-element tensor"):
        manager.update_loss_scale(finite_grads=1)


def test_loss_scale_is_the_float32_value_before_and_after_the_state_is_placed():
    manager = FixedLossScaleManager(1000.1)
    assert manager.get_loss_scale() == f32(1000.1) != 1000.1
    manager.grad_scaler.scale(torch.ones(()))
    assert manager.get_loss_scale() == f32(1000.1)


@pytest.mark.parametrize("drop", [True, False])
def test_drop_overflow_update_in_a_real_loop(backend, drop):
    manager = FixedLossScaleManager(1024.0, drop, backend=backend)
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.25)
    scaler = manager.grad_scaler
    scaler.scale((param * 2.0).sum()).backward()
    param.grad[1] = math.inf
    scaler.step(opt)
    scaler.update()
    assert manager.get_loss_scale() == 1024.0 and scaler.last_step_skipped() is drop
    if drop:
        assert torch.equal(param.detach(), torch.ones(4))
    else:  # the step went ahead: the finite entries moved by lr * 2, the overflowed one is not finite
        assert param[0].item() == param[2].item() == param[3].item() == 0.5
        assert not math.isfinite(param[1].item())


# ============================================================== end to end: the fused loop
INF_AT = (2, 3, 6)


def train(scaler, clip, steps=8):
    """A tiny model trained a few steps through ``scaler`` (a GradScaler's API), with an inf
    injected into a gradient at the steps in INF_AT; returns the parameters and the scales."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    scales = []
    for i in range(steps):
        x, y = torch.randn(5, 4, generator=data), torch.randn(5, 3, generator=data)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i in INF_AT:
            model.weight.grad[0, 0] = math.inf
        if clip:
            scaler.clip_grad_norm_(opt, max_norm=0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales


def train_by_hand(manager, steps=8):
    """The originals' own loop: scale the loss by get_loss_scale(), check the gradients, step only
    if they are finite, and tell the manager (MindSpore: overflow; TF1: finite_grads)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(5, 4, generator=data), torch.randn(5, 3, generator=data)
        opt.zero_grad()
        scale = manager.get_loss_scale()
        (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
        if i in INF_AT:
            model.weight.grad[0, 0] = math.inf
        finite = torch.stack([p.grad.isfinite().all() for p in model.parameters()]).all()
        for p in model.parameters():
            p.grad.div_(scale)
        if finite:
            opt.step()
        if isinstance(manager, ExponentialUpdateLossScaleManager):
            manager.update_loss_scale(finite)
        else:
            manager.update_loss_scale(~finite)
    return [p.detach().clone() for p in model.parameters()]


def reference_scales(ref, steps=8) -> list[float]:
    """The reference's scale after each of ``steps`` updates, overflowing at INF_AT."""
    scales = []
    for i in range(steps):
        ref.update(i in INF_AT)
        scales.append(ref.scale)
    return scales


def assert_same(a, b):
    """Equal parameters (lists of tensors), bit for bit, NaN where the other has NaN."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def assert_same_run(a, b):
    """Two ``train`` results: the same parameters and the same scales."""
    assert_same(a[0], b[0])
    assert a[1] == b[1]


def test_mindspore_dynamic_manager_end_to_end(backend):
    make = lambda: DynamicLossScaleManager(2**10, 2, 2, backend=backend)
    ref = MindSporeRef(2**10, 2, 2)
    expected = reference_scales(ref)
    params, scales = train(make().grad_scaler, clip=False)
    assert scales == expected
    # torch's own GradScaler: the same rule while the floor is not reached.
    torch_params, torch_scales = train(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), clip=False)
    assert torch_scales == expected
    assert_same(params, torch_params)
    assert_same(params, train_by_hand(make()))
    direct = GradScaler("cpu", init_scale=2**10, growth_interval=2, min_scale=1.0, backend=backend)
    assert_same_run(train(make().grad_scaler, clip=True), train(direct, clip=True))


def test_tf1_exponential_manager_end_to_end(backend):
    make = lambda: ExponentialUpdateLossScaleManager(2**10, 2, 2, 2, 0.5, backend=backend)
    ref = TensorFlowExponentialRef(2**10, 2, 2, 2, 0.5)
    expected = reference_scales(ref)
    params, scales = train(make().grad_scaler, clip=False)
    assert scales == expected
    assert_same(params, train_by_hand(make()))
    policy = LossScalePolicy(
        growth_interval=2, hysteresis=2, hysteresis_refill_on_backoff=True, min_scale=1.0
    )  # written out, not the preset
    direct = GradScaler("cpu", init_scale=2**10, policy=policy, backend=backend)
    assert_same_run(train(make().grad_scaler, clip=True), train(direct, clip=True))


@pytest.mark.parametrize("drop", [True, False])
def test_fixed_manager_end_to_end(backend, drop):
    manager = FixedLossScaleManager(2**8, drop, backend=backend)
    direct = GradScaler("cpu", init_scale=2**8, dynamic=False, skip_on_overflow=drop, backend=backend)
    result = train(manager.grad_scaler, clip=True)
    assert result[1] == [2.0**8] * 8
    assert all(p.isfinite().all() for p in result[0]) is drop  # overflowed steps went ahead or not
    assert_same_run(train(direct, clip=True), result)


def test_manager_follows_its_grad_scaler_across_both_ways_of_driving_it():
    manager = DynamicLossScaleManager(2**6, 2, 2, backend="torch")
    ref = MindSporeRef(2**6, 2, 2)
    loop = Loop(manager.grad_scaler)
    for i, overflow in enumerate(overflow_pattern(6, steps=40, p=0.4)):
        if i % 3:
            loop.step(overflow)  # the fused loop: scale, step, update
        else:
            manager.update_loss_scale(overflow)  # the manager's own update
        ref.update(overflow)
        assert manager.get_loss_scale() == manager.grad_scaler.get_scale() == ref.scale


# ============================================================== API, devices, errors
def test_exports_and_update_cell():
    assert tritonscale.FixedLossScaleManager is scale_managers.FixedLossScaleManager
    assert tritonscale.DynamicLossScaleManager is scale_managers.DynamicLossScaleManager
    assert tritonscale.ExponentialUpdateLossScaleManager is scale_managers.ExponentialUpdateLossScaleManager
    for manager in (FixedLossScaleManager(), DynamicLossScaleManager(), ExponentialUpdateLossScaleManager(8, 10)):
        assert isinstance(manager, scale_managers.LossScaleManager)
        assert isinstance(manager.grad_scaler, GradScaler) and manager.grad_scaler.is_enabled()
        assert manager.get_update_cell() is manager.grad_scaler


def test_device_placement():
    lazy = DynamicLossScaleManager(8, 2, 2)
    assert lazy.grad_scaler._scale is None  # nothing placed yet
    lazy.update_loss_scale(torch.tensor(True))
    assert lazy.grad_scaler._scale.device == torch.device("cpu")  # the flag's device
    placed = ExponentialUpdateLossScaleManager(8, 2, device="cpu")
    assert placed.grad_scaler._scale.device == torch.device("cpu")  # made at construction
    with pytest.raises(ScalerConfigError, match="device"):
        FixedLossScaleManager(device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            DynamicLossScaleManager(device="cuda")
    with pytest.raises(ValueError, match="backend"):
        DynamicLossScaleManager(backend="fastest")


@pytest.mark.parametrize(
    "make, error, match",
    [
        # MindSpore FixedLossScaleManager / TF1 FixedLossScaleManager: loss_scale >= 1
        (lambda: FixedLossScaleManager(0.5), ScalerConfigError, "loss_scale must be a finite number >= 1, got 0.5"),
        (lambda: FixedLossScaleManager("big"), TypeError, "loss_scale must be a number"),
        (lambda: FixedLossScaleManager(True), TypeError, "loss_scale must be a number"),
        (lambda: FixedLossScaleManager(np.bool_(True)), TypeError, "loss_scale must be a number"),
        (lambda: FixedLossScaleManager(float("nan")), ScalerConfigError, "loss_scale"),
        (lambda: FixedLossScaleManager(2**200), ScalerConfigError, "past float32's range"),
        (lambda: FixedLossScaleManager(128.0, "no"), TypeError, "drop_overflow_update must be a bool"),
        # MindSpore DynamicLossScaleManager
        (lambda: DynamicLossScaleManager(0.5), ScalerConfigError, "init_loss_scale must be a finite number >= 1"),
        (lambda: DynamicLossScaleManager(float("inf")), ScalerConfigError, "init_loss_scale"),
        (lambda: DynamicLossScaleManager(scale_window=0), ScalerConfigError, "scale_window must be a positive int"),
        (lambda: DynamicLossScaleManager(scale_window=2.0), TypeError, "scale_window must be an int"),
        (lambda: DynamicLossScaleManager(scale_window=True), TypeError, "scale_window must be an int"),
        (lambda: DynamicLossScaleManager(scale_window=np.float64(2.0)), TypeError, "scale_window must be an int"),
        (lambda: DynamicLossScaleManager(scale_factor=np.bool_(True)), TypeError, "scale_factor must be a number"),
        (lambda: DynamicLossScaleManager(scale_factor=0), ScalerConfigError, "scale_factor must be > 0"),
        (lambda: DynamicLossScaleManager(scale_factor=-2), ScalerConfigError, "scale_factor must be > 0"),
        (lambda: DynamicLossScaleManager(scale_factor=0.5), ScalerConfigError, "scale_factor must be >= 1"),
        (lambda: DynamicLossScaleManager(scale_factor=1 + 1e-12), ScalerConfigError, "rounds to 1.0 in float32"),
        (lambda: DynamicLossScaleManager(scale_factor=float("inf")), ScalerConfigError, "scale_factor"),
        (lambda: DynamicLossScaleManager(scale_factor="2"), TypeError, "scale_factor must be a number"),
        # TF1 ExponentialUpdateLossScaleManager
        (lambda: ExponentialUpdateLossScaleManager(8), TypeError, "incr_every_n_steps"),
        (lambda: ExponentialUpdateLossScaleManager(0.5, 10), ScalerConfigError, "init_loss_scale"),
        (lambda: ExponentialUpdateLossScaleManager(8, 0), ScalerConfigError, "incr_every_n_steps must be a positive"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, 1.5), TypeError, "decr_every_n_nan_or_inf must be an int"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, 2**31), ScalerConfigError, "below 2\\*\\*31"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, incr_ratio=1), ScalerConfigError, "incr_ratio must be"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, decr_ratio=1.0), ScalerConfigError, "decr_ratio must be"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, decr_ratio=0), ScalerConfigError, "decr_ratio must be"),
        (lambda: ExponentialUpdateLossScaleManager(8, 10, decr_ratio=None), TypeError, "decr_ratio must be"),
    ],
)
def test_bad_constructor_arguments_raise_naming_them(make, error, match):
    with pytest.raises(error, match=match):
        make()


NUMPY_TYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


@pytest.mark.parametrize("kind", NUMPY_TYPES, ids=lambda kind: kind.__name__)
def test_managers_take_numpy_numbers_as_their_python_values(kind):
    # Scales and growth factors (integer values: every type holds them), counts as integer types,
    # the TF1 backoff ratio as float types. Oracle: the originals' rules on the Python numbers, and
    # the same manager built from them (numpy's own .item(): its GradScaler's state_dict, its repr).
    count = kind if np.issubdtype(kind, np.integer) else np.int32
    ratio = np.float32 if np.issubdtype(kind, np.integer) else kind
    cases = [
        (DynamicLossScaleManager, (2**12, 2, 3), (kind, kind, count), MindSporeRef),
        (ExponentialUpdateLossScaleManager, (2**10, 3, 2, 2, 0.5), (kind, count, count, kind, ratio),
         TensorFlowExponentialRef),
        (FixedLossScaleManager, (1024,), (kind,), None),
    ]  # fmt: skip
    for cls, values, kinds, reference in cases:
        numbers = [k(v) for k, v in zip(kinds, values)]
        plain = [n.item() for n in numbers]
        manager, twin = cls(*numbers), cls(*plain)
        assert repr(manager) == repr(twin)
        for i, overflow in enumerate(overflow_pattern(0, steps=20, p=0.4)):
            for m in (manager, twin):
                m.update_loss_scale(overflow if cls is not ExponentialUpdateLossScaleManager else not overflow)
            if reference is not None:
                reference = reference(*plain) if isinstance(reference, type) else reference
                reference.update(overflow)
                assert manager.get_loss_scale() == reference.scale, f"{cls.__name__} step {i}"
            assert manager.grad_scaler.state_dict() == twin.grad_scaler.state_dict(), f"{cls.__name__} step {i}"


BAD_FLAGS = [
    (1, TypeError),
    (None, TypeError),
    ("yes", TypeError),
    (0.0, TypeError),
    (torch.ones(2), ValueError),
    (torch.tensor(1j), ValueError),
]


@pytest.mark.parametrize("bad, error", BAD_FLAGS, ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
@pytest.mark.parametrize("kind", ["dynamic", "exponential"])
def test_bad_update_argument_raises_and_changes_nothing(kind, bad, error):
    make = {
        "dynamic": lambda: DynamicLossScaleManager(2**8, 2, 2),
        "exponential": lambda: ExponentialUpdateLossScaleManager(2**8, 2),
    }[kind]
    fresh = make()
    with pytest.raises(error, match="must be a bool or a one-element"):
        fresh.update_loss_scale(bad)
    assert fresh.grad_scaler._scale is None  # not even placed
    manager, twin = make(), make()
    for value in (True, False):
        manager.update_loss_scale(value)
        twin.update_loss_scale(value)
    before = manager.grad_scaler.state_dict()
    with pytest.raises(error, match="must be a bool or a one-element"):
        manager.update_loss_scale(bad)
    assert manager.grad_scaler.state_dict() == before  # scale, growth tracker, counters
    for value in (False, True, True, False, False):  # and it goes on as the twin that saw no error
        manager.update_loss_scale(value)
        twin.update_loss_scale(value)
        assert manager.grad_scaler.state_dict() == twin.grad_scaler.state_dict()
