"""rank_validation.RankChecks' iteration count: a single process ends its iterations without a tensor
op, and the count reads as the number of iterations ended wherever it is read (a row, a pickle).
Oracle: the number of next_iteration() calls."""

from __future__ import annotations

import pickle

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tritonscale.passes.rank_validation import RankChecks


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_ending_iterations_eagerly_runs_no_tensor_op():
    ranks = RankChecks()
    with _Ops() as seen:
        for _ in range(10):
            ranks.next_iteration(torch.device("cpu"))
    assert seen.ops == []
    assert int(ranks.iteration) == 10
    ranks.next_iteration()
    copy = pickle.loads(pickle.dumps(ranks))
    assert int(copy.iteration) == 11 and int(ranks.iteration) == 11
    copy.next_iteration()
    assert int(copy.iteration) == 12 and int(ranks.iteration) == 11
