"""flatten_grads_ (tritonscale/grads/flat_grads.py): gradients made views of one buffer run as one FLAT range."""

import math

import pytest
import torch
from support.compiled_placements import needs_compiled_clip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.grad_twins import ENTRIES, Twins
from oracles.kernel_cases import (
    DTYPES,
    EDGE_SIZES,
    SETTINGS_SMALL,
    assert_bitwise,
    check_finalize_result,
    check_partials_summary,
    clip_ratio_st,
    dtype_id,
    make_grads,
    max_norm_for,
    norm_types_st,
    run_check,
    scales_st,
    seeds_st,
)

import tritonscale
from tritonscale import GradScaler
from tritonscale.grads.flat_runs import one_run
from tritonscale.kernels import apply_factor_, describe_grads
from tritonscale.kernels.reference import apply_ref, finalize_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@SETTINGS_SMALL
@given(
    sizes=st.lists(st.one_of(st.integers(1, 300), st.sampled_from(EDGE_SIZES[1:])), min_size=1, max_size=5),
    seed=seeds_st,
    scale=scales_st,
    norm_type=norm_types_st,
    clip_ratio=clip_ratio_st,
)
def test_flatten_grads_buffer_is_flat(dtype, sizes, seed, scale, norm_type, clip_ratio):
    """Gradients made views of one buffer by tritonscale.flatten_grads_ run as one FLAT range (the
    zero padding between views included); a subset of the views runs through the table."""
    params = [torch.nn.Parameter(torch.empty(n, dtype=dtype)) for n in sizes]
    for p, g in zip(params, make_grads(sizes, dtype, seed, 1.0)):
        p.grad = g
    (buffer,) = tritonscale.flatten_grads_(params)
    grads = [p.grad for p in params]
    buffer_before = buffer.clone()
    originals = [g.clone() for g in grads]
    max_norm = max_norm_for(grads, scale, norm_type, clip_ratio)
    layout, partials, res, result = run_check(grads, scale, norm_type, max_norm, run=one_run(grads))
    # The whole padded buffer, even for one view: its length is a multiple of 16, so loads vectorise.
    assert layout.flat and layout.first is buffer
    assert layout.numel == buffer.numel()
    check_partials_summary(partials, layout.programs, grads)
    check_finalize_result(res, finalize_ref(grads, scale, norm_type, max_norm), dtype, scale, max_norm)
    apply_factor_(layout, result[3:4])
    for i, (g, e) in enumerate(zip(grads, apply_ref(originals, res[3]))):
        assert_bitwise(g, e, f"view {i}")
    padding = torch.ones(buffer.numel(), dtype=torch.bool)
    for g in grads:
        padding[g.storage_offset() : g.storage_offset() + g.numel()] = False
    assert (buffer[padding] == 0).all(), "padding of the flat buffer is no longer zero"

    if len(grads) > 1:  # every view but the first, the first left alone
        buffer.copy_(buffer_before)
        subset = grads[1:]
        layout, partials, res, result = run_check(subset, scale, norm_type, max_norm, run=one_run(subset))
        # FLAT when the views sit back to back (one run, no padding between them), else the table.
        back_to_back = all(a.storage_offset() + a.numel() == b.storage_offset() for a, b in zip(subset, subset[1:]))
        assert layout.flat == back_to_back
        check_finalize_result(res, finalize_ref(subset, scale, norm_type, max_norm), dtype, scale, max_norm)
        apply_factor_(layout, result[3:4])
        assert_bitwise(grads[0], originals[0], "view outside the group")
        for i, (g, e) in enumerate(zip(subset, apply_ref(originals[1:], res[3]))):
            assert_bitwise(g, e, f"view {i + 1}")


def test_flat_buffer_with_an_empty_parameter_stays_flat():
    # nn.Linear(0, 3) has a [3, 0] weight: its empty view must not knock the group off the FLAT path.
    params = [torch.nn.Parameter(torch.randn(3, 0)), torch.nn.Parameter(torch.randn(40))]
    (buffer,) = tritonscale.flatten_grads_(params)
    grads = [p.grad for p in params]
    layout = describe_grads(grads, run=one_run(grads))
    assert layout.flat and layout.first is buffer


# ------------------------------------------------- buckets and buffers through the scaler
def _bucket_params(n_params, own, dtype=torch.float32, seed=0):
    """Parameters whose gradients sit back to back in one bucket (DDP's gradient_as_bucket_view):
    no flatten_grads_, no padding; the optimizer owns the ``own`` ones."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 2), (5,), (4,), (2, 2), (7,)][:n_params]
    bucket = (torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=g) * 2.0**10).to(dtype)
    params, at = [], 0
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = bucket[at : at + p.numel()].view(shape)
        at += p.numel()
        params.append(p)
    return [p for i, p in enumerate(params) if i in own], bucket


@pytest.mark.parametrize("own", [(0, 1, 2, 3, 4), (1, 2), (0, 3, 4)], ids=["all", "middle", "gapped"])
def test_bucket_views_give_exactly_the_optimizers_norm(backend, own):
    # Oracle: torch's unscale_ + clip_grad_norm_ on copies of the same gradients, as separate tensors.
    params, bucket = _bucket_params(5, own)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    outside = [i for i in range(bucket.numel()) if not any(
        p.grad.storage_offset() <= i < p.grad.storage_offset() + p.numel() for p in params)]  # fmt: skip
    bucket_outside = bucket[outside].clone()
    ours = GradScaler("cpu", init_scale=2.0**10, backend=backend)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for s in (ours, theirs):
        s.scale(torch.ones(()))
    norm = ours.clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 0.5)
    theirs.unscale_(twin_opt := torch.optim.SGD(twins, lr=0.1))
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=2e-6, atol=1e-9)
    assert torch.equal(bucket[outside], bucket_outside)  # other parameters' gradients untouched
    del twin_opt


@pytest.mark.parametrize("layout", ["flatten_grads_", "bucket"])
def test_flat_buffer_is_recognised_without_walking_and_still_correct(backend, monkeypatch, layout):
    from tritonscale.grads import groups

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 17, 3)]
    if layout == "flatten_grads_":
        tritonscale.flatten_grads_(params)
    else:  # views back to back in one bucket, as DDP's gradient_as_bucket_view makes them
        bucket = torch.zeros(25)
        params[0].grad, params[1].grad, params[2].grad = bucket[:5], bucket[5:22], bucket[22:]
    optimizer = torch.optim.SGD(params, lr=1.0)
    hits = []
    known = groups.known_run
    monkeypatch.setattr(groups, "known_run", lambda o: hits.append(known(o)) or hits[-1])
    scaler = GradScaler("cpu", init_scale=2.0**4, backend=backend)
    twins = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 17, 3)]
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    twin_opt = torch.optim.SGD(twins, lr=1.0)
    for s in (scaler, theirs):
        s.scale(torch.ones(()))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, t in zip(params, twins):
            value = torch.randn(p.shape, generator=g) * 2.0**4
            p.grad.copy_(value)  # the views persist (zero_grad(set_to_none=False))
            t.grad = value.clone()
        if step == 2:
            params[1].grad = params[1].grad.clone()  # no longer a view: the buffer must not be used
        norm = scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        theirs.unscale_(twin_opt)
        want = torch.nn.utils.clip_grad_norm_(twins, 1.0)
        theirs.step(twin_opt)
        theirs.update()
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        for p, t in zip(params, twins):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)
    assert [h is not None for h in hits] == [False, True, False]  # step 1 recognised the buffer


def test_flat_buffer_shortcut_keeps_torchs_fp16_refusal(backend):
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(2)]
    tritonscale.flatten_grads_(params)
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler = GradScaler("cpu", backend=backend)
    scaler.scale(torch.ones(()))
    scaler.clip_grad_norm_(torch.optim.AdamW(params, fused=True), 1.0)  # the fold reads fp16: allowed
    for _ in range(2):  # the second call goes through the remembered buffer
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler.unscale_(optimizer)


@pytest.mark.parametrize("layout", ["flatten_grads_", "bucket"])
def test_a_long_run_is_normed_as_accurately_as_its_views(layout):
    # One float32 norm over 8M elements is off by ~2e-4 relative on the CPU; the torch backend's
    # norm of a run must stay as accurate as torch's norms of the separate gradients (~1e-8).
    torch.manual_seed(0)
    values = [torch.randn(4096) * 2.0**8 for _ in range(2000)]
    params = [torch.nn.Parameter(torch.zeros(4096)) for _ in values]
    if layout == "flatten_grads_":
        for p, v in zip(params, values):
            p.grad = v.clone()
        tritonscale.flatten_grads_(params)
    else:
        bucket = torch.cat(values)
        for i, p in enumerate(params):
            p.grad = bucket[i * 4096 : (i + 1) * 4096]
    exact = torch.linalg.vector_norm(torch.cat(values).double()).item() / 2.0**8
    scaler = GradScaler("cpu", init_scale=2.0**8, backend="torch")
    scaler.scale(torch.ones(()))
    optimizer = torch.optim.SGD(params, lr=0.0)
    for _ in range(2):  # the second call takes the remembered buffer (flatten_grads_)
        for p, v in zip(params, values):
            p.grad.copy_(v)  # the scaled gradients again (the call before unscaled them in place)
        norm = scaler.clip_grad_norm_(optimizer, 1e9).item()
        scaler._per_optimizer_states.clear()
        assert abs(norm - exact) / exact < 1e-6


# ------------------------------------------------- the buffer written whole
def _padding(buffer: torch.Tensor, params) -> torch.Tensor:
    """Mask of the buffer's elements that are no parameter's gradient."""
    mask = torch.ones(buffer.numel(), dtype=torch.bool)
    for p in params:
        mask[p.grad.storage_offset() : p.grad.storage_offset() + p.grad.numel()] = False
    return mask


def _nan_then_zero_grad(buffer, optimizer, params, g) -> None:
    """``buf.fill_(nan)``, then ``zero_grad(set_to_none=False)`` and a backward into the views."""
    values = [p.grad.clone() for p in params]
    buffer.fill_(math.nan)
    optimizer.zero_grad(set_to_none=False)
    for p, v in zip(params, values):
        p.grad.add_(v)


#: What a user does to the buffer flatten_grads_ returned, after the gradients are in it.
WHOLE_BUFFER_WRITES = {
    "nothing": lambda buffer, optimizer, params, g: None,
    # DP-SGD style: noise of the gradients' magnitude added to the whole buffer.
    "noise": lambda buffer, optimizer, params, g: buffer.add_(
        (torch.randn(buffer.shape, generator=g) * max(p.grad.abs().max().item() for p in params if p.numel())).to(
            buffer.dtype
        )
    ),
    "nan, then zero_grad": _nan_then_zero_grad,
    "inf in the padding": lambda buffer, optimizer, params, g: buffer.masked_fill_(_padding(buffer, params), math.inf),
    "nan in the padding": lambda buffer, optimizer, params, g: buffer.masked_fill_(_padding(buffer, params), math.nan),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda sizes: any(n % 16 for n in sizes)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    writes=st.lists(st.sampled_from(list(WHOLE_BUFFER_WRITES)), min_size=2, max_size=4),
    entry=st.sampled_from(ENTRIES),
    seed=st.integers(0, 2**16),
)
def test_a_flat_buffer_written_whole_counts_only_the_gradients(backend, sizes, dtype, writes, entry, seed):
    # Only the gradients' elements count, whatever the padding holds: the norm, found_inf, the
    # gradients, the parameters after the step and the scale after update() are torch's on plain
    # copies of the gradients. The first step walks the gradients; later ones prove the buffer again.
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
    (buffer,) = tritonscale.flatten_grads_(params)
    optimizer = torch.optim.SGD(params, lr=0.1)
    twins = Twins(backend)
    g = torch.Generator().manual_seed(seed)
    for name in writes:
        write = WHOLE_BUFFER_WRITES[name]
        twins.step(optimizer, entry=entry, write=lambda write=write: write(buffer, optimizer, params, g))


@pytest.mark.parametrize("entry", ["clip", "unscale"])
def test_nan_left_in_the_padding_reads_nothing_on_the_host(backend, forbid_host_reads, entry):
    # buf.fill_(nan) once, then zero_grad(set_to_none=False) every step: the padding keeps NaN
    # unless the step clears it, and it must, on the device: no step skipped, torch's scale.
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 17, 3)]
    (buffer,) = tritonscale.flatten_grads_(params)
    optimizer = torch.optim.SGD(params, lr=0.1)
    buffer.fill_(math.nan)
    twins = Twins(backend, armed=forbid_host_reads.armed)

    def zero_grad_then_backward() -> None:
        values = [p.grad.clone() for p in params]
        optimizer.zero_grad(set_to_none=False)
        for p, v in zip(params, values):
            p.grad.add_(v)

    for _ in range(3):
        twins.step(optimizer, entry=entry, write=zero_grad_then_backward)


@needs_compiled_clip
def test_a_compiled_clip_counts_only_the_gradients_of_a_flat_buffer(backend):
    # Traced, the Triton backend's custom ops lay the buffer out at run time (whole, as eager):
    # NaN and noise left in the padding must not count there either.
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 17, 3)]
    (buffer,) = tritonscale.flatten_grads_(params)
    optimizer = torch.optim.SGD(params, lr=0.1)
    twins = Twins(backend)
    twins.clip = torch.compile(twins.scaler.clip_grad_norm_, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for name in ["nan in the padding", "noise", "nan, then zero_grad", "inf in the padding"]:
        write = WHOLE_BUFFER_WRITES[name]
        twins.step(optimizer, write=lambda write=write: write(buffer, optimizer, params, g))
