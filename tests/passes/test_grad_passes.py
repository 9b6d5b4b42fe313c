"""grads/groups.py + grad_passes.py: what torch's GradScaler accepts beyond the kernels' dtypes and
layouts (float64, non-dense and sparse gradients, every norm type) goes through torch ops in the
same pass, with torch as the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from oracles.tolerances import NORM_RTOL

from tritonscale import GradScaler

SCALE = 2.0**6


def strided_like(g):
    view = torch.zeros(*g.shape[:-1], 2 * g.shape[-1], dtype=g.dtype)[..., ::2]
    view.copy_(g)
    return view


def uncoalesced(g):
    # Each value split into two entries at the same index: the sum is g, the coalesced form too.
    s = g.to_sparse()
    idx, vals = s.indices(), s.values()
    return torch.sparse_coo_tensor(torch.cat([idx, idx], 1), torch.cat([vals * 0.25, vals * 0.75]), g.shape)


ODD = {
    "float64": lambda g: g.double(),
    "strided": strided_like,
    "sparse": lambda g: g.to_sparse(),
    "sparse-uncoalesced": uncoalesced,
}


def run(scaler, odd, call, bad=None, norm_type=2.0, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5, 3))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    grads = [torch.randn(6, 4) * 3 * SCALE, torch.randn(5, 3) * 3 * SCALE]
    if bad is not None:
        grads[1][2, 1] = bad
    params[0].grad = grads[0]
    params[1].grad_dtype = None
    params[1].grad = ODD[odd](grads[1])
    norm = None
    if call == "clip":
        if isinstance(scaler, GradScaler):
            norm = scaler.clip_grad_norm_(optimizer, 0.5, norm_type)
        else:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
    elif call == "unscale_":
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return norm, scaler.get_scale(), [p.detach().clone() for p in params]


@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("call", ["step", "unscale_", "clip"])
@pytest.mark.parametrize("odd", list(ODD))
def test_gradients_beyond_the_kernels_train_like_torch(backend, odd, call, bad):
    ours = run(GradScaler("cpu", init_scale=SCALE, backend=backend), odd, call, bad)
    if call == "clip" and odd.startswith("sparse"):
        # torch's clip_grad_norm_ has no sparse kernel: the oracle is the same step with the
        # gradient dense (ours clips a sparse gradient by the norm of its coalesced values).
        theirs = run(torch.amp.GradScaler("cpu", init_scale=SCALE), "float64", call, bad)
    else:
        theirs = run(torch.amp.GradScaler("cpu", init_scale=SCALE), odd, call, bad)
    if theirs[0] is not None:
        assert math.isfinite(float(ours[0])) == math.isfinite(float(theirs[0]))
        if math.isfinite(float(theirs[0])):
            assert float(ours[0]) == pytest.approx(float(theirs[0]), rel=1e-5)
    assert ours[1] == theirs[1]  # the same skip and backoff
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_type", [0.5, 1.0, 2.0, 3.0, math.inf, -math.inf, 0.0])
@pytest.mark.parametrize("odd", ["float64", "strided"])
def test_every_norm_type_torch_takes(backend, odd, norm_type):
    ours = run(GradScaler("cpu", init_scale=SCALE, backend=backend), odd, "clip", norm_type=norm_type)
    theirs = run(torch.amp.GradScaler("cpu", init_scale=SCALE), odd, "clip", norm_type=norm_type)
    assert float(ours[0]) == pytest.approx(float(theirs[0]), rel=1e-5)
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", ["clip", "step"])
def test_sparse_gradient_with_a_fused_optimizer_is_refused_before_anything_changes(backend, call):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 3))]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    params[0].grad = torch.randn(4, 3)
    params[1].grad = uncoalesced(torch.randn(5, 3))
    grad_objects = [p.grad for p in params]
    values = [p.grad.clone() for p in params]
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] has a sparse gradient"):
        scaler.clip_grad_norm_(optimizer, 1.0) if call == "clip" else scaler.step(optimizer)
    assert all(p.grad is g for p, g in zip(params, grad_objects))  # not even coalesced
    assert torch.equal(params[0].grad, values[0]) and torch.equal(params[1].grad.to_dense(), values[1].to_dense())
    assert scaler._per_optimizer_states[id(optimizer)]["stage"].name == "READY"


class _SparseAmpSGD(torch.optim.SGD):
    """An optimizer of torch's grad_scale/found_inf protocol that steps sparse gradients: divides
    by grad_scale, skips on found_inf (as the fused optimizers do), and records what it was handed."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        # grad_scale None: torch's GradScaler after unscale_ (the gradients are unscaled already).
        scale = self.grad_scale if self.grad_scale is not None else torch.ones(())
        self.handed = (scale.clone(), self.found_inf.clone())
        if self.found_inf.item() == 0:
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    p.add_((p.grad.float() / scale).to(p.dtype), alpha=-self.param_groups[0]["lr"])


@pytest.mark.parametrize(
    "values", [[16.0, 32.0, 64.0], [64000.0, 32.0, 64000.0], [16.0, math.inf, 64.0]], ids=["finite", "sum-inf", "inf"]
)
def test_sparse_fp16_gradient_with_an_amp_scaling_optimizer_steps_as_in_torch(backend, values):
    # The step() half of PyTorch's test_grad_scaling_unscale_sparse: an optimizer that takes
    # grad_scale/found_inf gets a float16 sparse gradient with a duplicated index. torch coalesces
    # it (64000 + 64000 overflows float16 only then), checks the coalesced values and hands the
    # scale and the flag over; the optimizer skips on inf. Oracle: torch's GradScaler.
    index = torch.tensor([[0, 1, 0], [2, 0, 2]])
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=4.0), GradScaler("cpu", init_scale=4.0, backend=backend)):
        param = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.float16))
        optimizer = _SparseAmpSGD([param], lr=0.5)
        param.grad = torch.sparse_coo_tensor(index, torch.tensor(values), (2, 3), dtype=torch.float16)
        scaler.scale(torch.ones(()))
        scaler.step(optimizer)
        scaler.update()
        grad, scale = param.grad, scaler.get_scale()
        results.append((*optimizer.handed, grad.is_coalesced(), grad.indices(), grad.values(), param, scale))
    theirs, ours = results
    for a, b in zip(theirs, ours):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (theirs, ours)
    assert float(ours[1]) == (0.0 if values[0] == 16.0 and math.isfinite(values[1]) else 1.0)


def _embedding_step(scaler, bad: float | None):
    """One scaled step of an nn.Embedding(sparse=True) + Linear under _SparseAmpSGD, clipped to 0.5;
    for torch's scaler, whose clip_grad_norm_ has no sparse kernel, the sparse gradient made dense
    first. Returns the norm, the parameters and the next scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    optimizer = _SparseAmpSGD(model.parameters(), lr=0.5)
    scaler.scale(model(torch.tensor([1, 3, 3, 7])).pow(2).sum()).backward()  # index 3 twice: uncoalesced
    embedding = model[0].weight
    if bad is not None:
        embedding.grad._values()[1, 2] = bad
    if isinstance(scaler, GradScaler):
        norm = scaler.clip_grad_norm_(optimizer, 0.5)
    else:
        embedding.grad = embedding.grad.to_dense()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()
    return float(norm), [p.detach().clone() for p in model.parameters()], scaler.get_scale()


@pytest.mark.parametrize("bad", [None, math.inf], ids=["finite", "inf"])
def test_sparse_gradients_clip_with_a_custom_amp_scaling_optimizer(backend, bad):
    # Not one of torch's fused optimizers: the clip folds (hands it scale / clip_coef) and it
    # steps its sparse gradient itself; the same as without the fold, and as torch.
    folded = _embedding_step(GradScaler("cpu", init_scale=2.0**8, backend=backend), bad)
    in_place = _embedding_step(GradScaler("cpu", init_scale=2.0**8, backend=backend, fold_into_optimizer=False), bad)
    theirs = _embedding_step(torch.amp.GradScaler("cpu", init_scale=2.0**8), bad)
    for ours in (folded, in_place):
        assert ours[2] == theirs[2]  # the same skip and backoff
        if bad is None:
            assert ours[0] == pytest.approx(theirs[0], rel=NORM_RTOL[torch.float32])
        for a, b in zip(ours[1], theirs[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_gradient_overlapping_itself_is_refused_before_anything_changes(backend):
    # torch's unscale_ fails on it halfway ("more than one element of the written-to tensor refers
    # to a single memory location"), after unscaling the gradients before it; ours refuses first.
    params = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(3, 4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", init_scale=3.0, backend=backend)
    scaler.scale(torch.ones(()))
    params[0].grad = torch.randn(100) * 1000
    params[1].grad = torch.randn(3, 1).expand(3, 4)
    before = [p.grad.clone() for p in params]
    for call in (lambda: scaler.unscale_(optimizer), lambda: scaler.clip_grad_norm_(optimizer, 1e-3)):
        with pytest.raises(ValueError, match=r"\['params'\]\[1\] has a gradient whose elements share memory"):
            call()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [None, math.inf], ids=["finite", "inf"])
def test_the_unscale_pass_unscales_and_checks_as_torchs_unscale_grads(backend, bad):
    """``unscale_and_check_`` (the pass; torch's private ``_unscale_grads_`` is another function, the
    controller's view) divides every gradient by the scale and flags inf/NaN as torch's does."""
    from tritonscale.grads.groups import collect_grads
    from tritonscale.passes import grad_passes

    assert not hasattr(grad_passes, "unscale_grads_")  # one name, one meaning: torch's is the scaler's method
    torch.manual_seed(0)
    grads = [torch.randn(5) * SCALE, torch.randn(3, 2, dtype=torch.float64) * SCALE]
    if bad is not None:
        grads[1][1, 0] = bad
    ours, theirs = ([torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    found = grad_passes.unscale_and_check_(
        collect_grads(torch.optim.SGD(ours, lr=1.0), allow_fp16=False), torch.tensor(SCALE), backend
    )
    expected = torch.amp.GradScaler("cpu")._unscale_grads_(
        torch.optim.SGD(theirs, lr=1.0), torch.tensor(1 / SCALE), torch.zeros(()), False
    )
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[d], expected[d]) for d in found)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)
