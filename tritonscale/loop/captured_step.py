"""The post-backward step in a CUDA graph, by torch's own recipe, refusing to replay stale gradients.

torch's recipe (docs "CUDA Graphs"): a few warm-up iterations on a side stream, then
``with torch.cuda.graph(g):`` (torch's own capture stream), then ``g.replay()``. ``CapturedStep``
is that recipe around a function of no arguments (scale's tail: ``clip_grad_norm_``, ``step``,
``update``, ``SkipAwareLR.step``) with two checks a bare graph does not make:

* the captured kernels read the gradients at the addresses they had at capture. If the gradients
  move (``zero_grad(set_to_none=True)``, ``flatten_grads_`` again, a new buffer), a replay would
  read memory no longer theirs. ``GradWatch`` notices it at a cost that does not grow with the
  number of tensors: a weak reference per captured gradient, whose callback raises a flag when that
  tensor is dropped; a replay checks the one flag, and refuses, naming the fix. The captured
  gradients' storages are kept alive, so until then the graph writes into memory no one else gets.
* what a replay cannot advance is refused inside the capture by the code that keeps it
  (``host_reads.refuse_in_capture``): host checks of the policy, a float lr, ``StepLog.record``.

Example (a GPU; ``opt`` a fused optimizer with ``capturable=True``, ``compile_policy=False``)::

    def post_backward():
        scaler.clip_grad_norm_(opt, 1.0); scaler.step(opt); scaler.update(); sched.step()

    step = CapturedStep(post_backward, opt, warmup=3)
    for x, y in batches:
        opt.zero_grad(set_to_none=False)        # the gradients stay where the graph reads them
        scaler.scale(loss_fn(model(x), y)).backward()
        step()                                  # 3 eager warm-ups, then the capture, then replays
        log.record(scaler)                      # outside the graph: this step's stats()
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CapturedStep", "GradWatch"]

MOVED_FIX = (
    "keep them in place between steps (zero_grad(set_to_none=False), the same flatten_grads_ buffer), or call "
    "recapture() after the gradients moved: the next call runs one eager warm-up with them and captures again"
)


class GradWatch:
    """Whether any gradient held by ``optimizers``' parameters when watched has been dropped since.

    A weak reference per gradient, with a callback that sets one flag; ``moved`` reads the flag (no
    loop over tensors). The gradients' storages are kept (``keep``): their memory is not handed to
    another tensor while a graph may still write it. Example::

        watch = GradWatch([opt]); p.grad = None; watch.moved  # True
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        grads = [p.grad for opt in optimizers for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            raise ValueError("CapturedStep: the optimizers' parameters hold no gradients; capture after a backward")
        self._moved = [False]
        flag = self._moved

        def dropped(_ref: Any, flag: list[bool] = flag) -> None:
            flag[0] = True

        self._refs = [weakref.ref(g, dropped) for g in grads]
        self.keep = [g.untyped_storage() for g in grads]

    @property
    def moved(self) -> bool:
        return self._moved[0]


class CapturedStep:
    """``step_fn`` (no arguments, the post-backward step) run eagerly ``warmup`` times on a side
    stream, then captured with ``torch.cuda.graph`` and replayed at each later call. Each call is
    one step (the capture call replays once, since a capture runs nothing). Returns ``step_fn``'s
    result: at the replays, the graph's output tensors, rewritten by each replay."""

    def __init__(
        self, step_fn: Callable[[], Any], optimizers: torch.optim.Optimizer | list, *, warmup: int = 3
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"CapturedStep(warmup={warmup!r}): needs an int >= 1 (eager steps before the capture: they build "
                "the launch tables, the optimizer's state and the scaler's state the graph reads)"
            )
        self.step_fn, self.warmup = step_fn, warmup
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.graph: torch.cuda.CUDAGraph | None = None
        self._eager_left = warmup
        self._watch: GradWatch | None = None
        self._out: Any = None

    def __call__(self) -> Any:
        if self._eager_left > 0:
            self._eager_left -= 1
            return self._on_side_stream()
        if self.graph is None:
            self._capture()
        elif self._watch.moved:
            raise RuntimeError(f"CapturedStep: the gradients the graph reads have moved since its capture; {MOVED_FIX}")
        self.graph.replay()
        return self._out

    def recapture(self) -> None:
        """Drop the graph: the next call runs one eager warm-up step (building the new gradients'
        tables) and the one after captures again."""
        self.graph, self._watch, self._out, self._eager_left = None, None, None, 1

    def _on_side_stream(self) -> Any:
        """One eager step on a side stream, as torch's recipe warms up (ordered both ways)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.step_fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self) -> None:
        self._watch = GradWatch(self.optimizers)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # torch's own capture stream, as its recipe
            self._out = self.step_fn()
        self.graph = graph
