"""The post-backward step in a CUDA graph, by torch's own recipe, refusing what a replay would get wrong.

torch's recipe (docs "CUDA Graphs"): a few warm-up iterations on a side stream, then
``with torch.cuda.graph(g):`` (torch's own capture stream), then ``g.replay()``. ``CapturedStep``
is that recipe around a function of no arguments (scale's tail: ``clip_grad_norm_``, ``step``,
``update``, ``SkipAwareLR.step``) with three checks a bare graph does not make:

* at construction: CUDA is there, and each optimizer's step can be captured (torch's fused
  optimizers, made with ``capturable=True`` where they take it; see ``capture_refusal``).
* at each replay: the captured kernels read and write the tensors at the addresses they had at
  capture, laid out as then. If any moved (``zero_grad(set_to_none=True)``, ``flatten_grads_``
  again, ``p.grad.data = ...``, ``set_``, ``model.to(...)``, a state or a param group replaced,
  ``add_param_group``), a replay would read memory no longer theirs, or step tensors no one reads.
  ``CaptureWatch`` proves, each call, that every slot the step reads (``p.grad``, the parameters,
  the optimizer's state and param groups) still holds the captured object, and that each captured
  tensor still has its address, dtype, number of elements and contiguity; else the call refuses,
  naming what moved and the fix. The captured tensors' storages are kept, so until a recapture the graph writes only
  memory no one else is given.
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

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Any

import torch

from ..scaler.step_protocols import StepProtocol, unwrap_optimizer

__all__ = ["CaptureWatch", "CapturedStep", "capture_refusal"]

MOVED_FIX = (
    "keep them in place between steps (zero_grad(set_to_none=False), the same flatten_grads_ buffer, the "
    "optimizer's state and param groups as they were, a tensor lr changed in place), or call recapture() after "
    "they moved: the next call runs one eager warm-up with them and captures again"
)

_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_NO_STATE: dict = {}  # the state of a parameter the optimizer holds none for (never written)
_LAYOUT_NAMES = ("address", "dtype", "number of elements", "contiguity", "shape", "strides")


def _layout(tensors: list[torch.Tensor], strided: list[torch.Tensor]) -> tuple[list, ...]:
    """Which bytes each tensor's elements are, read how: address, dtype, elements and contiguity
    (as ``OneRun`` proves the scaler's flat runs: a contiguous tensor's elements are the bytes from
    its address on, in order, whatever its shape, and every captured kernel is elementwise), and
    the shape and strides of ``strided``, those not contiguous at the capture."""
    return (
        list(map(_DATA_PTR, tensors)),
        list(map(_DTYPE, tensors)),
        list(map(_NUMEL, tensors)),
        list(map(_IS_CONTIGUOUS, tensors)),
        [t.shape for t in strided],
        [t.stride() for t in strided],
    )


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        params.extend(group["params"])
    return params


def _setting(value: Any) -> Any:
    """A param group's value as compared between calls: a tensor by identity (its layout is watched
    with the others), containers element by element, anything else by equality."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)):
        return tuple(map(_setting, value))
    if isinstance(value, dict):
        return tuple((k, _setting(v)) for k, v in value.items())
    return value


def _settings(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [tuple((k, _setting(v)) for k, v in group.items() if k != "params") for group in optimizer.param_groups]


def _group_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list, dict)):
        return [t for v in (value.values() if isinstance(value, dict) else value) for t in _group_tensors(v)]
    return []


@dataclass
class _Reads:
    """What one optimizer's step read at the capture: the objects in each slot."""

    params: list[torch.Tensor]  # every group's parameters, in order
    grads: list[torch.Tensor | None]  # each parameter's .grad
    states: list[dict]  # each parameter's state dict (_NO_STATE: none)
    values: list[Any]  # the state dicts' values, in order
    settings: list[tuple]  # each param group's other entries (_settings)
    entries: list[list[tuple[Any, Any]]]  # each state dict's (key, value) pairs, to say what moved

    @classmethod
    def now(cls, optimizer: torch.optim.Optimizer) -> _Reads:
        params = _params(optimizer)
        states = list(map(optimizer.state.get, params, repeat(_NO_STATE)))
        values = list(chain.from_iterable(map(dict.values, states)))
        entries = [list(state.items()) for state in states]
        return cls(params, list(map(_GRAD, params)), states, values, _settings(optimizer), entries)


class CaptureWatch:
    """Whether anything ``optimizers``' step reads has moved since the watch was made: a parameter,
    a gradient, a state tensor or a param group's tensor replaced or relaid (``.data = ...``,
    ``set_``, ``model.to(...)``), a gradient set to None, a parameter added, a group's setting changed.

    ``moved`` proves it at each call: every slot (``p.grad``, each group's parameters and settings,
    each state dict and entry) still holds the object it held, compared by identity, and every
    watched tensor still has its address, dtype, number of elements and contiguity (``_layout``),
    read by C-level maps: ~0.25 ms of host CPU for fused AdamW's 148 parameters (741 tensors with
    their gradients, state and lr) on a loaded 2-core EPYC, ~330 ns a tensor (docs/compiling.md).
    Nothing it compares depends on who else holds the tensors (the scaler's cache of flat buffers
    keeps old gradients alive). The tensors' storages are kept (``keep``): their memory is not
    handed to another tensor while a graph may still write it. Example::

        watch = CaptureWatch([opt]); p.grad.data = p.grad.double(); watch.moved  # True

    Args:
        optimizers: the (unwrapped) optimizers whose step is captured.

    Raises:
        ValueError: the parameters hold no gradient (nothing a step would read), or one is sparse.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        self._reads = [_Reads.now(opt) for opt in self._optimizers]
        if all(g is None for reads in self._reads for g in reads.grads):
            raise ValueError("CapturedStep: the optimizers' parameters hold no gradients; capture after a backward")
        self._tensors, self._labels = [], []
        for i, (opt, reads) in enumerate(zip(self._optimizers, self._reads)):
            where = f"optimizer {i} ({type(opt).__name__})"
            for j, (p, g, state) in enumerate(zip(reads.params, reads.grads, reads.states)):
                self._watch(p, f"{where}, parameter {j}")
                if g is not None:
                    self._watch(g, f"{where}, parameter {j}'s gradient")
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        self._watch(value, f"{where}, parameter {j}'s state {key!r}")
            for j, group in enumerate(opt.param_groups):
                for key, value in group.items():
                    for t in _group_tensors(value) if key != "params" else ():
                        self._watch(t, f"{where}, param group {j}'s {key!r}")
        strided = [k for k, t in enumerate(self._tensors) if not t.is_contiguous()]
        self._strided = [self._tensors[k] for k in strided]
        self._strided_labels = [self._labels[k] for k in strided]
        self._layout = _layout(self._tensors, self._strided)
        self.keep = [t.untyped_storage() for t in self._tensors]

    def _watch(self, tensor: torch.Tensor, label: str) -> None:
        if tensor.layout is not torch.strided:
            raise ValueError(f"CapturedStep: {label} is a {tensor.layout} tensor; a capture needs dense tensors")
        self._tensors.append(tensor)
        self._labels.append(label)

    @property
    def moved(self) -> bool:
        """True if anything watched moved since the watch was made (``what_moved`` says what)."""
        for opt, reads in zip(self._optimizers, self._reads):
            params = _params(opt)
            if len(params) != len(reads.params) or not all(map(is_, params, reads.params)):
                return True
            if not all(map(is_, map(_GRAD, params), reads.grads)):
                return True
            states = list(map(opt.state.get, params, repeat(_NO_STATE)))
            if not all(map(is_, states, reads.states)):
                return True
            values = list(chain.from_iterable(map(dict.values, states)))
            if len(values) != len(reads.values) or not all(map(is_, values, reads.values)):
                return True
            if _settings(opt) != reads.settings:
                return True
        return _layout(self._tensors, self._strided) != self._layout

    def what_moved(self) -> str | None:
        """What moved first, for the refusal's message (the slow path of ``moved``).

        Returns:
            The slot or tensor that moved and how, in words; None if nothing did.
        """
        for i, (opt, was) in enumerate(zip(self._optimizers, self._reads)):
            where = f"optimizer {i} ({type(opt).__name__})"
            now = _Reads.now(opt)
            if len(now.params) != len(was.params):
                return (
                    f"{where} has {len(now.params)} parameters, {len(was.params)} at the capture "
                    "(add_param_group, or a group's params changed)"
                )
            for j, (p, q) in enumerate(zip(now.params, was.params)):
                if p is not q:
                    return f"{where}, parameter {j} is another tensor than at the capture"
            for j, (g, h) in enumerate(zip(now.grads, was.grads)):
                if g is not h:
                    if h is None:
                        return f"{where}, parameter {j} has a gradient, none at the capture (a replay does not step it)"
                    what = "is None (zero_grad(set_to_none=True)?)" if g is None else "is a new tensor"
                    return f"{where}, parameter {j}'s gradient {what}"
            for j, (s, t, e, f) in enumerate(zip(now.states, was.states, now.entries, was.entries)):
                if s is not t or len(e) != len(f) or any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(e, f)):
                    return f"{where}, parameter {j}'s optimizer state was replaced (load_state_dict, or an entry set)"
            for j, (s, t) in enumerate(zip(now.settings, was.settings)):
                if s != t:
                    s, t = dict(s), dict(t)
                    changed = [k for k in {**t, **s} if k not in s or k not in t or s[k] != t[k]]
                    return (
                        f"{where}, param group {j}'s {', '.join(map(repr, changed))} changed (a replay uses the "
                        "captured values: change a tensor lr in place)"
                    )
        layout = _layout(self._tensors, self._strided)
        for k, (name, now_, was_) in enumerate(zip(_LAYOUT_NAMES, layout, self._layout)):
            for label, a, b in zip(self._labels if k < 4 else self._strided_labels, now_, was_):
                if a != b:
                    a, b = (hex(a), hex(b)) if name == "address" else (a, b)
                    return f"{label} has a new {name} ({b} at the capture, {a} now)"
        return None


def capture_refusal(optimizer: Any, inner: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step (``inner``: the real optimizer behind it) cannot be captured under
    the scaler, with the fix; None if it can.

    Two things cannot: a param group with ``capturable=False`` (torch's Adam, AdamW and the others
    that take the flag refuse to step inside a capture, fused or not: torch's
    ``_accelerator_graph_capture_health_check``), and a plain step (any optimizer without torch's
    ``grad_scale``/``found_inf`` attributes or ``step(grad_scaler=...)``): the scaler skips it on
    one host read of the overflow flag, which a replay cannot repeat. torch's fused SGD and Adagrad
    take no ``capturable`` flag and capture as they are.

    Args:
        optimizer: the object whose ``step`` the step function calls (a wrapper or the optimizer).
        inner: the optimizer behind it (``unwrap_optimizer``).

    Returns:
        The reason and the fix, or None.
    """
    name = type(inner).__name__
    off = [i for i, group in enumerate(inner.param_groups) if "capturable" in group and not group["capturable"]]
    plain = StepProtocol.of(optimizer, inner) is StepProtocol.PLAIN
    if not off and not plain:
        return None
    why = []
    if off:
        why.append(
            f"its param group(s) {off} have capturable=False (torch's {name}.step refuses inside a capture, "
            "fused or not)"
        )
    if plain:
        why.append(
            "its step is a plain one, which the scaler skips on one host read of the overflow flag (a replay "
            "cannot read it again)"
        )
    defaults = getattr(inner, "defaults", None) or {}
    if not plain:
        fix = "Make it with capturable=True"
    elif "fused" in defaults:
        fix = f"Make it with {name}(..., fused=True{', capturable=True' if 'capturable' in defaults else ''})"
    else:
        fix = (
            "Use an optimizer with a fused step: torch's Adam or AdamW (fused=True, capturable=True), SGD or "
            "Adagrad (fused=True)"
        )
    return f"{name} cannot be captured: {'; and '.join(why)}. {fix}"


def _checked_step_fn(step_fn: Any) -> Callable[[], Any]:
    if not callable(step_fn):
        raise TypeError(
            f"CapturedStep(step_fn, optimizers): step_fn must be a function of no arguments (the post-backward "
            f"step: clip_grad_norm_, step, update), got {type(step_fn).__name__}"
        )
    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return step_fn
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise TypeError(
            f"CapturedStep(step_fn, optimizers): step_fn is called with no arguments, and "
            f"{getattr(step_fn, '__name__', type(step_fn).__name__)} requires {', '.join(required)}; "
            "wrap it: lambda: step_fn(...)"
        )
    return step_fn


def _checked_optimizers(optimizers: Any) -> tuple[list, list[torch.optim.Optimizer]]:
    """The optimizers given (wrappers kept) and the real ones behind them."""
    given = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not given:
        raise ValueError("CapturedStep(step_fn, optimizers): no optimizer given; pass the optimizer(s) the step steps")
    inner = []
    for o in given:
        try:
            inner.append(unwrap_optimizer(o))
        except TypeError:
            what = "a generator (model.parameters()?)" if inspect.isgenerator(o) else type(o).__name__
            raise TypeError(
                f"CapturedStep(step_fn, optimizers): expected a torch.optim.Optimizer (or a list of them), got "
                f"{what}. Pass the optimizer(s) the step steps, whose param groups hold the gradients, parameters "
                "and state the graph reads: CapturedStep(post_backward, optimizer)"
            ) from None
    return given, inner


class CapturedStep:
    """``step_fn`` (no arguments, the post-backward step) run eagerly ``warmup`` times on a side
    stream, then captured with ``torch.cuda.graph`` and replayed at each later call. Each call is
    one step (the capture call replays once, since a capture runs nothing).

    Before each replay it proves that nothing the optimizers' step reads has moved
    (``CaptureWatch``), and refuses otherwise, replaying nothing.

    Args:
        step_fn: a function of no arguments: the post-backward step (``scaler.clip_grad_norm_``,
            ``scaler.step``, ``scaler.update``, ``SkipAwareLR.step``).
        optimizers: the optimizer the step steps, or a list of them (wrappers with ``.optimizer``
            too): their parameters, gradients, state and param groups are what is watched.
        warmup: eager steps before the capture (they build the launch tables, the optimizer's and
            the scaler's state the graph reads), an int >= 1.

    Raises:
        TypeError: ``step_fn`` is not a function of no arguments, or ``optimizers`` holds something
            that is no optimizer (parameters, a module).
        ValueError: a bad ``warmup``, or no optimizer.
        RuntimeError: CUDA is not available, or an optimizer cannot be captured (``capture_refusal``:
            torch's fused optimizers with ``capturable=True`` where they take it can).
    """

    def __init__(
        self, step_fn: Callable[[], Any], optimizers: torch.optim.Optimizer | list, *, warmup: int = 3
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"CapturedStep(warmup={warmup!r}): needs an int >= 1 (eager steps before the capture: they build "
                "the launch tables, the optimizer's state and the scaler's state the graph reads)"
            )
        step_fn = _checked_step_fn(step_fn)
        given, inner = _checked_optimizers(optimizers)
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CapturedStep needs CUDA (a CUDA graph captures CUDA work), and torch.cuda.is_available() is "
                "False; without a GPU call the step function itself each iteration"
            )
        refusals = [r for r in map(capture_refusal, given, inner) if r is not None]
        if refusals:
            raise RuntimeError(f"CapturedStep: {' '.join(refusals)}")
        self.step_fn, self.warmup = step_fn, warmup
        self.optimizers = given
        self._inner = inner
        self.graph: torch.cuda.CUDAGraph | None = None
        self._eager_left = warmup
        self._watch: CaptureWatch | None = None
        self._out: Any = None

    def __call__(self) -> Any:
        """One step: an eager warm-up, the capture (and its replay), or a replay.

        Returns:
            ``step_fn``'s result; at the capture and the replays, the graph's output tensors,
            rewritten by each replay.

        Raises:
            RuntimeError: something the graph reads moved since its capture (nothing is replayed).
        """
        if self._eager_left > 0:
            self._eager_left -= 1
            return self._on_side_stream()
        if self.graph is None:
            self._capture()
        elif self._watch.moved:
            raise RuntimeError(
                f"CapturedStep: the tensors the graph reads have moved since its capture: "
                f"{self._watch.what_moved()}; {MOVED_FIX}. Nothing was replayed."
            )
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
        watch = CaptureWatch(self._inner)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # torch's own capture stream, as its recipe
            out = self.step_fn()
        if watch.moved:  # the captured code replaced what it reads (state made at its first step)
            raise RuntimeError(
                f"CapturedStep: the step moved what it reads while it was captured: {watch.what_moved()}; "
                "warm up with more steps (warmup=...) so that the state it makes exists before the capture. "
                "The capture was dropped."
            )
        self.graph, self._watch, self._out = graph, watch, out
