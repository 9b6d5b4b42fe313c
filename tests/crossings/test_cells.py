"""Every entry point under every context it applies to, eager and single-process, against the
twin (torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_). See tests/crossings/__init__.py."""

from __future__ import annotations

import pytest
import torch
from oracles.scaler_twins import same_bits

from .contexts import BACKENDS, GRADS, SCALES
from .harness import Cell, applies, run_cell
from .policies import POLICIES
from .rows import ROWS
from .stopwatch import stopwatch

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
    # Triton's interpreter evaluates masked-off lanes in numpy too (x / 0 where a kernel selects it away).
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),  # near float32's max
    # torch's schedulers warn when an overflow skipped the first optimizer step (both sides alike).
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning"),
]

CELLS = [
    Cell(row, grads, scale, backend, policy)
    for policy in POLICIES
    for backend in BACKENDS
    for row in ROWS
    for grads in GRADS
    for scale in SCALES
    if applies(row, grads, scale, backend, policy)
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors of a few thousand elements: a second thread only waits for the first (on a loaded
    2-core machine the fused optimizers' kernels took 16 ms a call with two, 1 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cell", CELLS, ids=[cell.id for cell in CELLS])
def test_cell(cell, monkeypatch):
    if cell.backend != "triton_retimed":
        run_cell(cell)
        return
    runs = []
    for favourite in (0, 1):  # the first configuration timed fastest, then the second
        with stopwatch(favourite, monkeypatch):
            runs.append(run_cell(cell))
    for (step, name, first, value), (_, _, second, other) in zip(*runs):
        assert same_bits(first, second), f"{name} of step {step}: {value!r} with one stopwatch, {other!r} with another"
