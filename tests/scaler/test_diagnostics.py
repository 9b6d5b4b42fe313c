"""Diagnostics: device-side stats without syncs, non-finite gradient names (ScaleHistory: tests/loop/)."""

from __future__ import annotations

import math

import pytest
import torch

from tritonscale import GradScaler, ScaleHistory, nonfinite_grads


def run_steps(scaler, model, opt, pattern, history=None):
    for bad in pattern:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if bad:
            model[1].weight.grad[0, 0] = math.nan
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if history is not None:
            history.record(scaler)


def make(backend, fused=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    return model, opt, GradScaler("cpu", init_scale=64.0, backend=backend)


def test_stats_are_device_tensors_read_without_sync(backend, forbid_host_reads):
    model, opt, scaler = make(backend)
    run_steps(scaler, model, opt, [False, True, True])
    forbid_host_reads.on = True
    stats = scaler.stats()  # must not read anything on the host
    forbid_host_reads.on = False
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert float(stats["scale"]) == 16.0 and int(stats["skipped_steps"]) == 2
    assert int(stats["consecutive_skips"]) == 2 and int(stats["skipped"]) == 1
    assert float(stats["found_inf"]) == 1.0 and math.isnan(float(stats["norm"]))
    assert scaler.last_step_skipped()
    run_steps(scaler, model, opt, [False])
    assert not scaler.last_step_skipped() and int(scaler.stats()["consecutive_skips"]) == 0
    assert float(scaler.stats()["norm"]) > 0


def test_nonfinite_grads_names_the_culprits():
    model, _, _ = make("torch")
    model(torch.ones(1, 4)).sum().backward()
    assert nonfinite_grads(model) == []
    model[1].weight.grad[1, 2] = math.inf
    model[0].bias.grad[0] = math.nan
    assert nonfinite_grads(model) == ["0.bias", "1.weight"]
    assert nonfinite_grads(model.named_parameters()) == ["0.bias", "1.weight"]
    assert nonfinite_grads(list(model.parameters())) == ["1", "2"]


@pytest.mark.parametrize(
    "values",
    [[1.0, 2.0, 3.0], [3e38, 3e38, 1.0], [math.inf, -math.inf, 1.0], [1.0, 2.0, math.nan], [1.0, 2.0, -math.inf]],
    ids=["finite", "sum-overflows", "inf-minus-inf", "nan", "-inf"],
)
@pytest.mark.parametrize("layout", ["coo-uncoalesced", "coo", "csr"])
def test_nonfinite_grads_reads_a_sparse_gradient_as_its_dense_form(values, layout):
    # Oracle: torch.isfinite on the dense form (the first two values share an index, summed there).
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2], [1, 1, 0]]), torch.tensor(values), (3, 2))
    grad = {"coo-uncoalesced": grad, "coo": grad.coalesce(), "csr": grad.to_dense().to_sparse_csr()}[layout]
    param = torch.nn.Parameter(torch.zeros(3, 2).to_sparse_csr() if layout == "csr" else torch.zeros(3, 2))
    param.grad = grad
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.grad = torch.zeros(2)
    expected = ["1"] if not torch.isfinite(grad.to_dense()).all() else []
    assert nonfinite_grads([plain, param]) == expected
    assert param.grad is grad and (layout == "csr" or grad.is_coalesced() == (layout == "coo"))  # left as it was


def overflowed_backward(backend):
    """One good step, then a scaled backward whose gradients hold an inf: (model, opt, scaler)."""
    model, opt, scaler = make(backend)
    run_steps(scaler, model, opt, [False])
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    model[1].weight.grad[0, 0] = math.inf
    return model, opt, scaler


def test_skipped_clip_step_keeps_the_culprits_visible(backend):
    model, opt, scaler = overflowed_backward(backend)
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped() and nonfinite_grads(model) == ["1.weight"]


def test_lr_scheduler_stays_in_step_with_skipped_steps(backend):
    model, opt, scaler = make(backend)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pattern = [False, True, False, True, True, False]
    for bad in pattern:
        run_steps(scaler, model, opt, [bad])
        if not scaler.last_step_skipped():
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** pattern.count(False))


def _torch_twin(pattern):
    """torch.amp.GradScaler over the same steps: its scale and growth tracker after each update."""
    model, opt, _ = make("torch")
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    seen = []
    for bad in pattern:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if bad:
            model[1].weight.grad[0, 0] = math.nan
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        seen.append((scaler.get_scale(), int(scaler._growth_tracker)))
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
def test_stats_kept_and_read_steps_later_are_their_own_steps_values(backend, fused):
    # An asynchronous logger keeps each step's dict and reads it later: every value must be the
    # one of its step (they were live views of the state the next update() overwrites).
    pattern = [False, True, False, False, True, False, False, False, False, False]
    model, opt, _ = make(backend, fused)
    scaler = GradScaler("cpu", init_scale=64.0, growth_interval=2, backend=backend)
    kept, read_then = [], []
    for bad in pattern:
        run_steps(scaler, model, opt, [bad])
        stats = scaler.stats()
        kept.append(stats)
        read_then.append({name: value.item() for name, value in stats.items()})
    read_later = [{name: value.item() for name, value in stats.items()} for stats in kept]
    assert repr(read_later) == repr(read_then)  # repr: an overflowed step's norm is NaN
    assert [(s["scale"], int(s["growth_tracker"])) for s in read_later] == _torch_twin(pattern)
    assert [s["skipped"] for s in read_later] == [float(bad) for bad in pattern]


def test_stats_after_update_with_new_scale_on_an_overflowed_step_agree(backend):
    _, opt, scaler = overflowed_backward(backend)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update(new_scale=8.0)
    stats = scaler.stats()
    assert stats["scale"].item() == 8.0
    assert stats["skipped"].item() == 1 and stats["found_inf"].item() == 1  # the step it counted
    assert torch.equal(stats["norm"], norm)  # that step's clip, not the one before


def test_stats_of_a_disabled_scaler_says_it_is_disabled():
    model, opt, _ = make("torch")
    scaler = GradScaler("cpu", enabled=False)
    loss = scaler.scale(model(torch.ones(2, 4)).sum())  # the script does use scale()
    loss.backward()
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    for call in (scaler.stats, lambda: ScaleHistory().record(scaler)):
        with pytest.raises(RuntimeError, match="enabled=False") as caught:
            call()
        assert "scaler.scale" not in str(caught.value)
