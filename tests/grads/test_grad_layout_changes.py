"""Gradient memory that moves after a flat buffer or bucket was recognised (flat_grads.py,
grads/flat_runs.py): the step must read and write exactly the optimizer's gradients as they are
now, whatever happened to the memory since an earlier step.

Oracle: torch's own ``GradScaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_`` on twin parameters
holding copies of the same gradient values as separate tensors (tests/oracles/grad_twins.py). Memory around
the optimizer's gradients that is not theirs (another parameter's gradient in the same bucket) must
come out bitwise untouched.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.grad_twins import SCALE, Twins, owned

import tritonscale


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


def laid_out(sizes: tuple[int, ...], layout: str) -> list[torch.nn.Parameter]:
    """Parameters of these sizes whose gradients are views of one ``flatten_grads_`` buffer, or
    back to back in a DDP-style bucket."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    if layout == "flatten_grads_":
        tritonscale.flatten_grads_(params)
    else:
        pooled_bucket(bytearray(1024), params, torch.float32, 0)
    return params


@pytest.mark.parametrize("norm_type", [0.0, -2.0, -float("inf"), 0.5, 3.0])
@pytest.mark.parametrize("layout", ["flatten_grads_", "bucket"])
def test_norm_types_the_kernels_do_not_compute_after_recognition(backend, norm_type, layout):
    params = laid_out((5, 17, 3, 9), layout)
    optimizer = torch.optim.SGD(params, lr=0.0)
    twins = Twins(backend)
    twins.step(optimizer)  # a 2-norm step: the layout is recognised
    for _ in range(2):
        twins.step(optimizer, max_norm=1e-3, norm_type=norm_type)


# ------------------------------------------- metadata rewritten in place, at the same address


def _halved(shape: torch.Size) -> tuple[int, ...]:
    return (max(1, shape[0] // 2), *shape[1:])


def _retype(g: torch.Tensor) -> None:
    """``.data =`` the same bytes in another dtype: float32 read as bfloat16 (twice the elements),
    bfloat16 read as float32 where the layout allows it."""
    if g.dtype is torch.float32 and g.stride()[-1] == 1:
        g.data = g.data.view(torch.bfloat16)
    elif g.dtype is torch.bfloat16 and g.is_contiguous() and g.shape[-1] % 2 == 0 and g.storage_offset() % 2 == 0:
        g.data = g.data.view(torch.float32)


#: Changes a gradient tensor keeps its identity and its address through: only its size, stride or
#: dtype differ. Each stays inside the gradient's own bytes (no overlap with a neighbour).
IN_PLACE = {
    "as_strided_ smaller": lambda g: g.as_strided_(_halved(g.shape), torch.empty(_halved(g.shape)).stride()),
    "as_strided_ every other element": lambda g: g.as_strided_(_halved(g.shape), tuple(2 * s for s in g.stride())),
    "set_ smaller": lambda g: g.set_(g.untyped_storage(), g.storage_offset(), _halved(g.shape)),
    ".data = another dtype": _retype,
}


@pytest.mark.parametrize("change", list(IN_PLACE))
@pytest.mark.parametrize("layout", ["flatten_grads_", "bucket"])
def test_a_gradient_resized_or_retyped_in_place_after_recognition(backend, layout, change):
    # Recognised over two steps, then one gradient's metadata is rewritten over the same memory:
    # the step must read it with its new extent, stride and dtype, as torch does.
    params = laid_out((6, 10, 4, 8), layout)
    optimizer = torch.optim.SGD(params, lr=0.1)
    twins = Twins(backend)
    for _ in range(2):
        twins.step(optimizer)
    params[1].grad.fill_(SCALE)  # still scaled, as a skipped step leaves it: what it gives up must not count
    IN_PLACE[change](params[1].grad)
    for _ in range(2):
        twins.step(optimizer)


# ---------------------------------------------------- random changes of layout (property)


class Model:
    """A conv model whose optimizer owns all parameters but the last; every change below is one a
    training loop makes, or the allocator does under it."""

    def __init__(self, layout: str, seed: int) -> None:
        self.module = conv_model(seed)
        self.params = list(self.module.parameters())
        self.pool = bytearray(8192)
        self.optimizer = torch.optim.SGD(self.params[:-1], lr=0.1)
        self.rng = random.Random(seed)
        self.holders: list[torch.Tensor] = []  # old buckets and buffers kept alive, as a framework might
        for p in self.params:
            p.grad = torch.zeros_like(p)
        if layout == "flatten_grads_":
            self.holders.extend(tritonscale.flatten_grads_(self.params[:-1]))
        else:
            self.holders.append(pooled_bucket(self.pool, self.params, self.dtype, 0))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def owned(self) -> list[torch.nn.Parameter]:
        return owned(self.optimizer)

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
        if p.grad is not None:  # what backward allocates for a gradient that no longer fits
            p.grad = p.grad.clone() if _fits(p) else torch.zeros_like(p)

    def data_assignment(self) -> None:
        p = self.rng.choice(self.owned() or self.params)
        if p.grad is not None:
            p.grad.data = p.grad.data.clone()

    def reflatten(self) -> None:
        for p in self.params:
            if p.grad is not None and not _fits(p):
                p.grad = None  # flatten_grads_ gives it zeros of its parameter's shape
        self.holders.extend(tritonscale.flatten_grads_(self.owned() or self.params[:-1]))

    def nan_around_the_gradients(self) -> None:
        """``buf.fill_(nan)`` on every buffer and bucket, then ``zero_grad(set_to_none=False)``:
        NaN stays wherever no owned gradient is (padding, gaps, memory the gradients left)."""
        for holder in self.holders:
            holder.fill_(math.nan)
        self.optimizer.zero_grad(set_to_none=False)

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

    def resize_in_place(self) -> None:
        """as_strided_ or set_ on one gradient: a smaller or strided extent at the same address."""
        owned = self.owned()
        if owned:
            change = self.rng.choice([name for name in IN_PLACE if name != ".data = another dtype"])
            grad = self.rng.choice(owned).grad
            grad.fill_(SCALE)  # still scaled, as a skipped step leaves it: what it gives up must not count
            IN_PLACE[change](grad)

    def retype_in_place(self) -> None:
        owned = self.owned()
        if owned:
            _retype(self.rng.choice(owned).grad)

    def zero_grad_to_none(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params[:-1]:  # what the next backward does: new, separate gradients
            if p.requires_grad:
                p.grad = torch.zeros_like(p)


def _fits(p: torch.nn.Parameter) -> bool:
    return p.grad.shape == p.shape and p.grad.dtype == p.dtype


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
