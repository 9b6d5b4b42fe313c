"""Gradients past 2**31 elements: the elements there are checked, counted in the norm and unscaled.

The compiled proof is tests/test_compile_targets.py (every offset of the check and apply kernels
computed in 64 bits, in the PTX and the LLVM IR); these tests run the passes on values that sit
past the bound and compare them with torch ops on the same elements.

Cheap constructions, so that nothing walks or touches 2**31 elements:

* the kernels through the interpreter: a 4 GiB float16 buffer from ``torch.empty`` (pages nothing
  writes take no memory on Linux) described by a tensor table whose entry has its real size,
  2**31 + CHUNK + 1000 elements, while the chunk rows list only its last three chunks, which
  straddle 2**31. The kernels then form ``address + start`` from a start of 2**31 - CHUNK, 2**31
  and 2**31 + CHUNK and ``numel - start`` from the 2**31+ size, with three programs;
* the public step on both backends: gradients that are views of such a buffer at storage
  offsets past 2**31 (back to back, so both backends read them as one run cut from the buffer).

Memory: only the pages written are resident, ~260 KiB of each buffer (measured: the two 4 GiB
buffers with their tails written add ~3 MiB to the process's RSS). The FLAT path past 2**31 is out
of the interpreter's reach (its programs walk every block below the bound first, ~2**19 of them):
the compile tests prove its offsets, tests/test_gpu.py runs it on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import tritonscale
from tritonscale.kernels import apply_factor_, check_pass
from tritonscale.kernels.check_pass import PARTIAL_ROWS
from tritonscale.kernels.finalize import finalize
from tritonscale.kernels.launch_config import CHUNK
from tritonscale.kernels.tensor_table import GradLayout

BOUND = 2**31
NUMEL = BOUND + CHUNK + 1000  # the last chunk is partial: its blocks are masked
FIRST = BOUND - CHUNK  # first element the chunk rows cover
STARTS = (BOUND - CHUNK, BOUND, BOUND + CHUNK)


@pytest.fixture(scope="module")
def big() -> torch.Tensor:
    """A float16 buffer of NUMEL elements of which only [FIRST, NUMEL) is ever written."""
    return torch.empty(NUMEL, dtype=torch.float16)


@pytest.fixture(scope="module")
def big_bf16() -> torch.Tensor:
    """The same in bfloat16: gradients a scaler unscales in place (float16 ones are refused, as
    torch refuses them)."""
    return torch.empty(NUMEL, dtype=torch.bfloat16)


def _fill_tail(big: torch.Tensor, seed: int) -> torch.Tensor:
    """Values in [FIRST, NUMEL): small before 2**31, larger past it (most of the norm lies there);
    returns a copy of them (the oracle's input)."""
    gen = torch.Generator().manual_seed(seed)
    tail = torch.randn(NUMEL - FIRST, generator=gen, dtype=torch.float32)
    tail[BOUND - FIRST :] *= 64.0
    big[FIRST:] = tail.to(big.dtype)
    return big[FIRST:].clone()


def _layout(big: torch.Tensor) -> GradLayout:
    tensors = torch.tensor([[big.data_ptr(), big.numel()]], dtype=torch.int64)
    chunks = torch.tensor([[0, start] for start in STARTS], dtype=torch.int64)
    # `first` only gives the element type: the kernels reach the buffer through the table alone.
    element_type = torch.zeros(1, dtype=big.dtype)
    return GradLayout(element_type, False, len(STARTS), tensors, chunks, len(STARTS), NUMEL - FIRST)


def _norm_and_found(layout: GradLayout, scale: float) -> tuple[float, float]:
    partials = torch.zeros(PARTIAL_ROWS, layout.programs, dtype=torch.float32)
    check_pass(layout, partials, norm=2)
    found_inf, norm = finalize(partials, layout.programs, torch.tensor([scale]), norm=2)[:2].tolist()
    return norm, found_inf


def test_check_pass_counts_the_elements_past_2_31(big):
    tail = _fill_tail(big, seed=0)
    norm, found_inf = _norm_and_found(_layout(big), scale=1024.0)
    expected = torch.linalg.vector_norm(tail.double()).item() / 1024.0
    assert found_inf == 0.0
    assert norm == pytest.approx(expected, rel=1e-6)
    # Most of it lies past 2**31: a pass that missed those elements would be far off.
    past = torch.linalg.vector_norm(tail[BOUND - FIRST :].double()).item() / 1024.0
    assert past > 0.99 * expected


@pytest.mark.parametrize("where", [BOUND, NUMEL - 1], ids=["at-2**31", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_check_and_unscale_find_a_nonfinite_past_2_31(big, where, bad):
    _fill_tail(big, seed=1)
    big[where] = bad
    layout = _layout(big)
    norm, found_inf = _norm_and_found(layout, scale=1.0)
    assert found_inf == 1.0
    assert (norm != norm) if bad != bad else norm == float("inf")  # NaN stays NaN, inf inf
    found = torch.zeros(1, dtype=torch.float32)
    apply_factor_(layout, torch.tensor([8.0]), invert=True, found_inf=found)
    assert found.item() == 1.0


def test_unscale_writes_the_elements_past_2_31(big):
    tail = _fill_tail(big, seed=2)
    before = big[FIRST - 1].clone()  # the element just before the covered chunks: not written
    found = torch.zeros(1, dtype=torch.float32)
    apply_factor_(_layout(big), torch.tensor([1024.0]), invert=True, found_inf=found)
    expected = (tail.float() * (1.0 / 1024.0)).half()  # one float32 product, rounded once
    assert torch.equal(big[FIRST:].view(torch.int16), expected.view(torch.int16))
    assert found.item() == 0.0
    assert big[FIRST - 1].view(torch.int16) == before.view(torch.int16)


# --- the public step: gradients at storage offsets past 2**31 -----------------------------------


def _twins(big: torch.Tensor, sizes: tuple[int, ...], start: int):
    """Parameters whose gradients are back-to-back views of ``big`` from element ``start`` on, and
    twins with the same gradients in their own memory (torch's side)."""
    ours, theirs, offset = [], [], start
    for size in sizes:
        p, q = (torch.nn.Parameter(torch.zeros(size, dtype=big.dtype)) for _ in range(2))
        p.grad = big[offset : offset + size]
        q.grad = p.grad.clone()
        ours.append(p)
        theirs.append(q)
        offset += size
    return ours, theirs


@pytest.mark.parametrize("bad", [None, float("inf")], ids=["finite", "inf"])
def test_step_on_gradients_past_2_31(big_bf16, backend, bad):
    """Gradients at storage offsets past 2**31 (the last one wholly past it, the one before
    straddling it): unscale_ writes every element and finds an inf in the very last one, the norm
    counts them, and the step goes as torch's GradScaler and clip_grad_norm_ take it on the same
    values."""
    sizes = (3000, 4000, 4096)
    _fill_tail(big_bf16, seed=3)
    ours, theirs = _twins(big_bf16, sizes, start=BOUND - 5000)
    if bad is not None:
        for params in (ours, theirs):
            params[-1].grad[-1] = bad
    assert ours[1].grad.storage_offset() < BOUND < ours[1].grad.storage_offset() + sizes[1]
    assert ours[-1].grad.storage_offset() > BOUND
    scaler = tritonscale.GradScaler("cpu", init_scale=1024.0, backend=backend)
    reference = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt, ref_opt = torch.optim.SGD(ours, lr=0.1), torch.optim.SGD(theirs, lr=0.1)
    scaler.scale(torch.ones(()))  # the gradients are set by hand: a scale() starts the iteration
    reference.scale(torch.ones(()))
    scaler.unscale_(opt)
    reference.unscale_(ref_opt)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad.view(torch.int16), q.grad.view(torch.int16))
    # The norm of the unscaled values, in float64 (bfloat16 norms are rounded to bfloat16 per
    # tensor by torch's clip on the CPU and per row by the torch backend: a bfloat16 tolerance).
    exact = torch.linalg.vector_norm(torch.cat([q.grad.double() for q in theirs])).item()
    norm = scaler.clip_grad_norm_(opt, max_norm=1e9)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1e9)
    if bad is None:
        assert norm.item() == pytest.approx(exact, rel=2**-8) and ref_norm.item() == pytest.approx(exact, rel=2**-8)
    else:
        assert norm.item() == ref_norm.item() == exact == float("inf")
    scaler.step(opt)
    reference.step(ref_opt)
    scaler.update()
    reference.update()
    assert scaler.get_scale() == reference.get_scale() == (512.0 if bad is not None else 1024.0)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
