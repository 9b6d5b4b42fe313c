"""Count the device launches a step's phases make on the GPU paths, on the CPU.

One home for the counting: ``tests/support/launches.py`` (the launch-count tests), ``bench/launch_table.py``
(the docs' table) and ``bench/host_time.py`` (the host-time bar, which replaces every Triton launch
by ``no_op_launches``) import it.

A GPU runs each aten op that computes as at least one kernel (or a copy), and each Triton launch as
one. On the CPU the same code dispatches the same aten ops, and the Triton interpreter runs the same
launches, so with the host-read switch off (``forbid_host_reads``: the paths a GPU takes) the count
here is the count a GPU makes (``../shared/PERFORMANCE.md``, "Counting the GPU path's launches"):

* every aten op dispatched under a ``TorchDispatchMode``, except those that launch nothing on a
  GPU: views and metadata (``alias``, ``view``, ``select``, ...), allocations (``empty*``), and
  host-side reads of metadata;
* every Triton launch (``GridExecutor.__call__``, the interpreter's grid launch), without the aten
  ops the interpreter itself dispatches to run the program on the CPU.

Example::

    counter = LaunchCounter()
    with counter.phase("update"):
        scaler.update()
    counter.counts == {"update": 1}
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that allocate or describe memory without computing: no kernel on a GPU.
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "detach",
    "lift_fresh",
    "_local_scalar_dense",  # a host read, not a launch (the host-read switch refuses it anyway)
    "set_",
    "resize_",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "_record_function_enter_new",  # the profiler's markers around an optimizer step
    "_record_function_exit",
}


def launches_nothing(func) -> bool:
    """True for an aten op that makes no kernel on a GPU: a view, a metadata op, an allocation."""
    schema = func._schema
    if func.is_view or any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns):
        return True
    return func._overloadpacket.__name__.removesuffix("_") in NO_KERNEL or func._overloadpacket.__name__ in NO_KERNEL


class _AtenCounter(TorchDispatchMode):
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.owner.inside_triton and not launches_nothing(func):
            self.owner.record(f"aten.{func._overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


class LaunchCounter:
    """Launches per named phase (``counts``) and what they were (``ops``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.ops: dict[str, list[str]] = {}
        self.inside_triton = False
        self._phase: str | None = None

    def record(self, what: str) -> None:
        if self._phase is not None:
            self.counts[self._phase] += 1
            self.ops.setdefault(self._phase, []).append(what)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside under ``name`` (a phase may be entered again: counts add up)."""
        from triton.runtime.interpreter import GridExecutor

        original = GridExecutor.__call__
        counter = self

        def launch(executor, *args, **kwargs):
            if counter.inside_triton:  # a launch from inside a program: not a thing a GPU does
                return original(executor, *args, **kwargs)
            counter.record(f"triton.{executor.fn.__name__}")
            counter.inside_triton = True
            try:
                return original(executor, *args, **kwargs)
            finally:
                counter.inside_triton = False

        self.counts.setdefault(name, 0)
        self._phase = name
        GridExecutor.__call__ = launch
        try:
            with _AtenCounter(self):
                yield
        finally:
            GridExecutor.__call__ = original
            self._phase = None


@contextlib.contextmanager
def no_op_launches() -> Iterator[Counter[str]]:
    """Inside, every Triton launch (the interpreter's ``InterpretedFunction.run``, what
    ``kernel[grid](...)`` calls) only counts, by kernel name, into the yielded Counter and returns:
    the Python around a launch runs, the kernel does not. Used to time the GPU paths' host work on
    the CPU, where the interpreter's run time would stand for device time no GPU host pays."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    launched: Counter[str] = Counter()

    def run(fn, *args, grid, warmup, **kwargs):
        if not warmup:
            launched[fn.fn.__name__] += 1

    InterpretedFunction.run = run
    try:
        yield launched
    finally:
        InterpretedFunction.run = original


#: How a counted step clips (``count_scaled_step``'s ``clip``): ours (``clip_grad_norm_``), torch's
#: (``unscale_`` + ``torch.nn.utils.clip_grad_norm_``), ``unscale_`` alone, or nothing.
CLIPS = ("ours", "torch", "unscale", "none")


def count_scaled_step(scaler: Any, optimizer: Any, params: list, clip: str = "ours", steps: int = 3) -> LaunchCounter:
    """Run ``steps`` scaled steps over ``params`` (their gradients set to None first, as
    ``zero_grad``'s default: they move every step) and count the last one per phase: "scale",
    "clip" (what ``clip`` names, to a max_norm of 1.0; empty for "none"), "step", "update". The one
    step both the launch-count tests and the docs' table (``launch_table.py``) count. Example:
    ``count_scaled_step(scaler, opt, params).counts["update"] == 1``."""
    if clip not in CLIPS:
        raise ValueError(f"clip must be one of {CLIPS}, got {clip!r}")
    counter = LaunchCounter()
    for i in range(steps):
        phase = counter.phase if i == steps - 1 else (lambda name: contextlib.nullcontext())
        for p in params:
            p.grad = None
        loss = sum((p * p).sum() for p in params)
        with phase("scale"):
            scaled = scaler.scale(loss)
        scaled.backward()
        with phase("clip"):
            if clip in ("torch", "unscale"):
                scaler.unscale_(optimizer)
            if clip == "torch":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif clip == "ours":
                scaler.clip_grad_norm_(optimizer, 1.0)
        with phase("step"):
            scaler.step(optimizer)
        with phase("update"):
            scaler.update()
    return counter


def total(counter: LaunchCounter) -> int:
    return sum(counter.counts.values())


__all__ = ["CLIPS", "LaunchCounter", "count_scaled_step", "launches_nothing", "no_op_launches", "total"]
