"""Gradient memory that moves after a flat buffer or bucket was recognised (flat_grads.py,
kernels/flat_runs.py): the step must read and write exactly the optimizer's gradients as they are
now, whatever happened to the memory since an earlier step.

Oracle: torch's own ``GradScaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_`` on twin parameters
holding copies of the same gradient values as separate tensors. Memory around the optimizer's
gradients that is not theirs (another parameter's gradient in the same bucket) must come out
bitwise untouched.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import TORCH_BACKEND_NORM_RTOL

import tritonscale
from tritonscale import GradScaler

SCALE = 2.0**10


class Twins:
    """Our scaler and optimizer next to torch's scaler and clip, one call at a time."""

    def __init__(self, backend: str) -> None:
        self.scaler = GradScaler("cpu", init_scale=SCALE, growth_interval=10**9, backend=backend)
        self.scaler.scale(torch.ones(()))
        self.step_index = 0

    def step(self, optimizer, foreign: list[torch.Tensor] = (), max_norm=0.5, norm_type=2.0) -> None:
        """Fill every gradient the optimizer holds (in place, in whatever memory it is now) with new
        scaled values, then compare ours ``clip_grad_norm_`` with torch's on copies."""
        g = torch.Generator().manual_seed(self.step_index)
        self.step_index += 1
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            p.grad.copy_((torch.randn(p.shape, generator=g) * SCALE).to(p.grad.dtype))
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for t, p in zip(twins, params):
            t.grad = p.grad.clone()
        untouched = [f.clone() for f in foreign]
        theirs = torch.amp.GradScaler("cpu", init_scale=SCALE)
        theirs.scale(torch.ones(()))
        theirs.unscale_(torch.optim.SGD(twins, lr=0.0))
        exact = torch.linalg.vector_norm(torch.stack([t.grad.double().norm(norm_type) for t in twins]), norm_type)
        want = torch.nn.utils.clip_grad_norm_(twins, max_norm, norm_type)
        norm = self.scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
        self.scaler.update()
        dtype = params[0].dtype if params else torch.float32
        if dtype is torch.bfloat16:
            # torch rounds each bfloat16 norm to bfloat16 (2**-9) and so may the torch backend:
            # both against the float64 norm of the same unscaled values, the gradients within
            # a few bfloat16 ulps of torch's.
            torch.testing.assert_close(norm.double(), exact, rtol=2.0**-8, atol=0)
            close = dict(rtol=2.0**-6, atol=0)
        else:
            torch.testing.assert_close(norm, want, rtol=TORCH_BACKEND_NORM_RTOL[dtype], atol=0)
            close = dict(rtol=TORCH_BACKEND_NORM_RTOL[dtype], atol=1e-9)
        for i, (p, t) in enumerate(zip(params, twins)):
            torch.testing.assert_close(p.grad, t.grad, **close, msg=lambda m, i=i: f"gradient {i}: {m}")
        for f, before in zip(foreign, untouched):
            assert torch.equal(f, before), "memory that is not the optimizer's gradients was written"


def conv_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 5))


# ------------------------------------------------------------- the reproductions


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to(memory_format=torch.channels_last),
        lambda m: m.to(torch.bfloat16),
        lambda m: [setattr(p.grad, "data", p.grad.data.clone()) for p in m.parameters()],
    ],
    ids=["channels_last", "bfloat16", "grad.data"],
)
def test_gradients_moved_out_of_a_flat_buffer(backend, move):
    # After flatten_grads_ and two steps, every gradient gets new storage while ``grad._base``
    # still names the old buffer: the step must follow the gradients, not the buffer.
    model = conv_model()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tritonscale.flatten_grads_(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    twins = Twins(backend)
    for _ in range(2):
        twins.step(optimizer)
    move(model)
    for _ in range(2):
        twins.step(optimizer)


def pooled_bucket(pool: bytearray, params, dtype: torch.dtype, offset_bytes: int, order=None) -> torch.Tensor:
    """Give ``params`` gradients back to back in a bucket cut from ``pool`` at ``offset_bytes``:
    memory a caching allocator could hand out again, at the same addresses, in another dtype."""
    order = list(range(len(params))) if order is None else order
    total = sum(params[i].numel() for i in order)
    bucket = torch.frombuffer(pool, dtype=dtype, count=total, offset=offset_bytes)
    at = 0
    for i in order:
        params[i].grad = bucket[at : at + params[i].numel()].view(params[i].shape)
        at += params[i].numel()
    return bucket


def placed_bucket(pool: bytearray, params, dtype: torch.dtype, placements: dict[int, int]) -> None:
    """Give ``params[i]`` a gradient at byte ``placements[i]`` of one bucket cut from ``pool``."""
    size = torch.tensor([], dtype=dtype).element_size()
    bucket = torch.frombuffer(pool, dtype=dtype, count=len(pool) // size)
    for i, at in placements.items():
        params[i].grad = bucket[at // size : at // size + params[i].numel()].view(params[i].shape)


def test_a_bucket_reallocated_at_the_same_addresses_in_another_dtype(backend):
    # The optimizer owns the first three parameters, back to back in a float32 bucket (bytes 0,
    # 24, 64). The bucket is freed and the same memory cut again in bfloat16 (the model went to
    # bfloat16): the owned gradients at the very same addresses and sizes, the fourth
    # parameter's gradient in the gap after the first.
    pool = bytearray(1024)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 10, 4, 6)]
    optimizer = torch.optim.SGD(params[:3], lr=0.0)
    placed_bucket(pool, params, torch.float32, {0: 0, 1: 24, 2: 64, 3: 80})
    twins = Twins(backend)
    for _ in range(2):
        twins.step(optimizer, foreign=[params[3].grad])
    for p in params:
        p.data = p.data.bfloat16()
    placed_bucket(pool, params, torch.bfloat16, {0: 0, 3: 12, 1: 24, 2: 64})
    for _ in range(2):
        twins.step(optimizer, foreign=[params[3].grad])


def test_a_bucket_reallocated_starting_earlier(backend):
    # The same gradients at the same addresses, in a storage that now starts 32 bytes earlier,
    # where the fourth parameter's gradient sits.
    pool = bytearray(1024)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 10, 4, 8)]
    optimizer = torch.optim.SGD(params[:3], lr=0.0)
    pooled_bucket(pool, params, torch.float32, 64)
    twins = Twins(backend)
    for _ in range(2):
        twins.step(optimizer, foreign=[params[3].grad])
    pooled_bucket(pool, params, torch.float32, 64 - 4 * 8, order=[3, 0, 1, 2])
    for _ in range(2):
        twins.step(optimizer, foreign=[params[3].grad])


def test_a_flat_buffer_freed_and_another_dtype_allocated_in_its_place(backend):
    # The real allocator: a float32 buffer freed, a bfloat16 one (likely at the same address).
    params = [torch.nn.Parameter(torch.zeros(4096)) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros_like(p)
    tritonscale.flatten_grads_(params[:3])
    optimizer = torch.optim.SGD(params[:3], lr=0.0)
    twins = Twins(backend)
    for _ in range(2):
        twins.step(optimizer)
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = None  # frees the float32 buffer
    buffer = torch.zeros(4 * 4096, dtype=torch.bfloat16)
    for i, p in enumerate(params):
        p.grad = buffer[i * 4096 : (i + 1) * 4096]
    for _ in range(2):
        twins.step(optimizer, foreign=[params[3].grad])


@pytest.mark.parametrize("norm_type", [0.0, -2.0, -float("inf"), 0.5, 3.0])
@pytest.mark.parametrize("layout", ["flatten_grads_", "bucket"])
def test_norm_types_the_kernels_do_not_compute_after_recognition(backend, norm_type, layout):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 17, 3, 9)]
    if layout == "flatten_grads_":
        tritonscale.flatten_grads_(params)
    else:
        pooled_bucket(bytearray(1024), params, torch.float32, 0)
    optimizer = torch.optim.SGD(params, lr=0.0)
    twins = Twins(backend)
    twins.step(optimizer)  # a 2-norm step: the layout is recognised
    for _ in range(2):
        twins.step(optimizer, max_norm=1e-3, norm_type=norm_type)


# ---------------------------------------------------- random changes of layout (property)


class Model:
    """A conv model whose optimizer owns all parameters but the last; every change below is one a
    training loop makes, or the allocator does under it."""

    def __init__(self, layout: str, seed: int) -> None:
        self.module = conv_model(seed)
        self.params = list(self.module.parameters())
        self.pool = bytearray(8192)
        self.optimizer = torch.optim.SGD(self.params[:-1], lr=0.0)
        self.rng = random.Random(seed)
        self.holders: list[torch.Tensor] = []  # old buckets kept alive, as a framework might
        for p in self.params:
            p.grad = torch.zeros_like(p)
        if layout == "flatten_grads_":
            tritonscale.flatten_grads_(self.params[:-1])
        else:
            self.holders.append(pooled_bucket(self.pool, self.params, self.dtype, 0))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def owned(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def foreign(self) -> list[torch.Tensor]:
        return [self.params[-1].grad] if self.params[-1].grad is not None else []

    # The changes
    def channels_last(self) -> None:
        self.module.to(memory_format=torch.channels_last)

    def to_bfloat16(self) -> None:
        self.module.to(torch.bfloat16)

    def to_float32(self) -> None:
        self.module.to(torch.float32)

    def new_grad(self) -> None:
        p = self.rng.choice(self.owned() or self.params)
        if p.grad is not None:
            p.grad = p.grad.clone()

    def data_assignment(self) -> None:
        p = self.rng.choice(self.owned() or self.params)
        if p.grad is not None:
            p.grad.data = p.grad.data.clone()

    def reflatten(self) -> None:
        tritonscale.flatten_grads_(self.owned() or self.params[:-1])

    def rebucket(self) -> None:
        """Free the bucket and cut another from the same memory: another dtype if the model's
        changed, another start, another order; the foreign gradient lands anywhere in it."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        order = list(range(len(self.params)))
        self.rng.shuffle(order)
        offset = self.rng.choice([0, 0, 16, 64])
        self.holders.append(pooled_bucket(self.pool, self.params, self.dtype, offset, order))

    def add_param_group(self) -> None:
        extra = torch.nn.Parameter(torch.zeros(7, dtype=self.dtype))
        extra.grad = torch.zeros_like(extra)
        self.optimizer.add_param_group({"params": [extra]})

    def freeze(self) -> None:
        owned = self.owned()
        if len(owned) > 1:
            p = self.rng.choice(owned)
            p.requires_grad_(False)
            p.grad = None

    def zero_grad_to_none(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params[:-1]:  # what the next backward does: new, separate gradients
            if p.requires_grad:
                p.grad = torch.zeros_like(p)


CHANGES = [name for name in vars(Model) if not name.startswith("_") and name not in ("dtype", "owned", "foreign")]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["flatten_grads_", "bucket"]),
    changes=st.lists(st.sampled_from(CHANGES), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_layout_changes_after_recognition(backend, layout, changes, seed):
    model = Model(layout, seed)
    twins = Twins(backend)
    for _ in range(2):  # the second step takes the recognised buffer or run
        twins.step(model.optimizer, model.foreign())
    for change in changes:
        getattr(model, change)()
        twins.step(model.optimizer, model.foreign())
        twins.step(model.optimizer, model.foreign())
