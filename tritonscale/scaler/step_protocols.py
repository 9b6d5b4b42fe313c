"""The three step protocols, and the fold: handing the unscale, the clip and the skip to a fused
optimizer's own step.

How an optimizer's step gets the loss scale is decided once per call, from the object whose
``step()`` is called and the real optimizer behind it (``StepProtocol.of``): a fused optimizer's
``grad_scale``/``found_inf`` attributes, the older ``step(grad_scaler=...)``, or a plain step the
scaler unscales for and skips on a host read. ``clip_grad_norm_`` and ``step`` ask the same object;
``GradScaler.step`` holds the three side by side in one ``if`` chain, as torch's ``step`` does, and
this module what they use: the protocol's test, the hand-over of the attributes, the skipped step,
and the guard on a direct ``optimizer.step()``.

Wrapper optimizers: frameworks hand users wrappers that keep the real optimizer in ``.optimizer``
(Accelerate's ``AcceleratedOptimizer``, Fabric's ``_FabricOptimizer``) and call
``scaler.step(wrapper.optimizer)`` themselves. The scaler keys its bookkeeping on the innermost
optimizer (``unwrap_optimizer``), so any mix of wrapper and inner object is unscaled exactly once;
the protocol is the wrapper's, whose ``step`` is the one called.

torch's fused optimizers (Adam, AdamW, SGD and Adagrad with ``fused=True``) set
``_step_supports_amp_scaling`` and read two attributes while they step: ``grad_scale`` (they
divide each gradient by it, in the same pass that updates the parameter) and ``found_inf`` (they
skip the whole update on the device when it is nonzero). The scaler sets both for one ``step``
call and removes them after, as torch.amp.GradScaler does; with ``grad_scale = scale / clip_coef``
the clip rides along and the gradients are never written by the scaler.

So after a folded clip the gradients still hold the loss scale until ``scaler.step(optimizer)``
hands the optimizer its divisor; an ``optimizer.step()`` called directly would apply them about
``scale`` times too large. :class:`DirectStepGuard` makes that a clear error. For every other
optimizer it notes a direct step after unscale_ or the clip, so that the next iteration's clip
refuses as torch's ``unscale_`` does (a loop that never calls ``scaler.step``/``update`` would
otherwise clip still scaled gradients as if unscaled).
"""

from __future__ import annotations

import enum
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..torch_compat import FUSED_ADAGRAD_AMP_SCALING, has_torch

if TYPE_CHECKING:
    from .grad_scaler import GradScaler

#: What a guard hands each step to: the scaler's function (``grad_scaler.note_direct_step``).
OnStep = Callable[["GradScaler", torch.optim.Optimizer], None]


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer at the end of ``optimizer``'s ``.optimizer`` chain (itself if it has none).

    Raises TypeError for an object that is neither an optimizer (something with ``param_groups``)
    nor a wrapper of one, and ValueError for a chain that loops.

    Example::

        inner = unwrap_optimizer(accelerator_wrapped_optimizer)   # the torch.optim.AdamW inside
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"expected an optimizer, got the LR scheduler {type(optimizer).__name__}")
    chain = [optimizer]
    while True:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or inner is chain[-1]:
            break
        if any(inner is seen for seen in chain):
            names = " -> ".join(type(o).__name__ for o in [*chain, inner])
            raise ValueError(f"the .optimizer chain of {type(optimizer).__name__} loops: {names}")
        chain.append(inner)
    real = chain[-1]
    if not hasattr(real, "param_groups"):
        what = (
            type(optimizer).__name__
            if real is optimizer
            else f"{type(optimizer).__name__} (wrapping {type(real).__name__})"
        )
        raise TypeError(f"expected a torch.optim.Optimizer or a wrapper with .optimizer, got {what}{_hint(real)}")
    return real


def _hint(given: Any) -> str:
    """What works instead, for the likely mix-up: parameters (or a module) where the optimizer goes,
    as torch.nn.utils.clip_grad_norm_ takes them."""
    if isinstance(given, (torch.Tensor, torch.nn.Module)) or inspect.isgenerator(given) or isinstance(given, list):
        return (
            ". The scaler's methods take the optimizer, whose param_groups hold the gradients: "
            "scaler.clip_grad_norm_(optimizer, max_norm), unlike torch.nn.utils.clip_grad_norm_(parameters, max_norm)"
        )
    return ""


class StepProtocol(enum.Enum):
    """How a step is handed the loss scale and the skip. Example::

    protocol = StepProtocol.of(optimizer, unwrap_optimizer(optimizer))
    protocol.clip_folds(fold_into_optimizer=True)  # True for torch's fused AdamW
    """

    #: torch's fused optimizers (and any with ``_step_supports_amp_scaling``): they divide by the
    #: ``grad_scale`` attribute and skip on ``found_inf`` themselves, on the device.
    AMP_ATTRIBUTES = "grad_scale and found_inf attributes"
    #: The older protocol (apex, TransformerEngine, torch's own tests): ``step(grad_scaler=...)``.
    GRAD_SCALER_ARGUMENT = "step(grad_scaler=...)"
    #: Any other optimizer: the scaler unscales, and the step is skipped on one host read.
    PLAIN = "plain step"

    @classmethod
    def of(cls, optimizer: Any, inner: torch.optim.Optimizer) -> StepProtocol:
        """The protocol of ``optimizer.step`` (``optimizer``: the object whose step is called, a
        wrapper or the optimizer itself; ``inner``: the real optimizer it steps)."""
        if not takes_amp_scaling(inner):
            return cls.PLAIN
        return cls.GRAD_SCALER_ARGUMENT if takes_grad_scaler_argument(optimizer) else cls.AMP_ATTRIBUTES

    def clip_folds(self, fold_into_optimizer: bool) -> bool:
        """Whether clip_grad_norm_ hands the optimizer ``scale / clip_coef`` instead of writing the
        gradients: a fused optimizer divides by grad_scale itself (float16 gradients are then fine).
        Not with step(grad_scaler=...), which divides by the plain scale: there the gradients are
        unscaled and clipped in place."""
        return fold_into_optimizer and self is StepProtocol.AMP_ATTRIBUTES


def takes_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers that divide by ``grad_scale`` and skip on ``found_inf`` themselves.

    torch's fused optimizers set ``_step_supports_amp_scaling`` in ``__init__`` only, and
    torch.optim.Optimizer pickles ``defaults``, ``state`` and ``param_groups``: a deepcopied,
    unpickled or ``torch.load``ed one has lost the flag but still steps fused (and reads
    ``grad_scale``/``found_inf``). It is recognised by its ``fused`` default, so that a copy
    continues exactly as the original (the fold's division is not the in-place unscale's, bit for bit).
    Before torch 2.12 fused Adagrad declares nothing and torch's GradScaler unscales for it in place:
    so does ours there (``torch_compat``).
    """
    if bool(getattr(optimizer, "_step_supports_amp_scaling", False)):
        return True
    adagrad_declares = has_torch(FUSED_ADAGRAD_AMP_SCALING) or not isinstance(optimizer, torch.optim.Adagrad)
    return is_torch_fused(optimizer) and adagrad_declares


def is_torch_fused(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch's own optimizers made with ``fused=True`` (which take dense gradients only)."""
    defaults = getattr(optimizer, "defaults", None)
    fused = isinstance(defaults, dict) and bool(defaults.get("fused"))
    return fused and type(optimizer).__module__.startswith("torch.optim.")


#: The first half of the key under which a scaler's guard sits in an optimizer's step pre-hooks.
GUARD_KEY = "tritonscale.fold.DirectStepGuard"


class DirectStepGuard:
    """A step pre-hook on an optimizer ``scaler`` unscaled or clipped this iteration: it hands each
    ``optimizer.step()`` to ``on_step(scaler, optimizer)``, the controller's function
    (``grad_scaler.note_direct_step``), whose record of the iteration decides. While a clip
    folded into a fused optimizer is pending and the step is handed no divisor (``grad_scale``,
    which ``scaler.step(optimizer)`` sets for its call), the step raises, changing nothing: the
    gradients still hold the loss scale. Any other step not made by ``scaler.step`` goes ahead, as
    torch lets it, and is noted: the next ``unscale_``/``clip_grad_norm_`` of that optimizer before
    ``update()`` raises torch's error for a second unscale_, naming the fix (the new backward's
    gradients are still scaled, and a clip would take them as unscaled). After ``update()`` or
    ``abandon_iteration()`` nothing is recorded and the hook lets every step through.

    The scaler is held weakly and a copy or a pickle of the hook is inert (``__reduce__``): an
    optimizer copied with its hooks does not drag the scaler along. Example::

        scaler.clip_grad_norm_(optimizer, 1.0)   # fused: installs the guard, writes no gradient
        optimizer.step()                         # RuntimeError naming scaler.step(optimizer)
    """

    __slots__ = ("_scaler", "_on_step")

    def __init__(self, scaler: GradScaler | None = None, on_step: OnStep | None = None) -> None:
        self._scaler = weakref.ref(scaler) if scaler is not None else None
        self._on_step = on_step

    def scaler(self) -> GradScaler | None:
        """The scaler this guard is for; None once it is gone (or in a copy)."""
        return self._scaler() if self._scaler is not None else None

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        scaler = self.scaler()
        if scaler is not None and self._on_step is not None:
            self._on_step(scaler, optimizer)

    def __reduce__(self) -> tuple[type, tuple]:
        return (DirectStepGuard, ())


def guard_direct_step(optimizer: torch.optim.Optimizer, scaler: GradScaler, on_step: OnStep) -> bool:
    """Install ``scaler``'s :class:`DirectStepGuard` on ``optimizer`` (a torch.optim.Optimizer;
    others have no step hooks), handing each step to ``on_step``: its key is the scaler's, so each
    unscale_ and clip sets the same entry.

    A compiled clip runs this once, while Dynamo traces it (``assume_constant_result``; the graph
    is specialised to this optimizer and scaler already): traced as a dict write instead, the hooks'
    first change would recompile the clip. Returns whether the guard is on."""
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if not isinstance(hooks, dict):
        return False
    key = (GUARD_KEY, id(scaler))
    guard = hooks.get(key)
    if guard is None or guard.scaler() is not scaler:  # none yet, or one of a scaler gone since
        hooks[key] = DirectStepGuard(scaler, on_step)
    return True


# What torch.compiler.assume_constant_result sets, set without importing Dynamo: the decorator sets
# only this attribute, after ``import torch._dynamo`` (about 2 s at ``import tritonscale``; the
# no-Dynamo-import test in tests/scaler/test_compile_boundary.py fails with it). That test file
# checks that it is the same mark.
guard_direct_step._dynamo_marked_constant = True  # type: ignore[attr-defined]


def takes_grad_scaler_argument(optimizer: Any) -> bool:
    """The older protocol (apex, TransformerEngine, torch's own tests): ``step(grad_scaler=...)``,
    where the optimizer asks the scaler for the scale and found_inf itself. torch still honours it
    and so do we; such an optimizer gets no fold (it would divide by the plain scale)."""
    step = optimizer.step
    return _declares_grad_scaler(getattr(step, "__func__", step))


def _declares_grad_scaler(step: Any) -> bool:
    # Read from the code object (through functools.wraps wrappers, as inspect.signature would):
    # cheap enough for every step, nothing cached, and Dynamo traces it without a graph break.
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    code = getattr(step, "__code__", None)  # None: a builtin or C step, which declares nothing
    return code is not None and "grad_scaler" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def warn_grad_scaler_argument(stacklevel: int = 3) -> None:
    """torch's deprecation notice for the older protocol, word for word."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=stacklevel,
    )


def grad_scale_for_step(
    optimizer: torch.optim.Optimizer, scale: torch.Tensor, still_scaled: bool, folded: torch.Tensor | None
) -> torch.Tensor | None:
    """The ``grad_scale`` a fused optimizer's step gets: the loss scale when nothing was unscaled
    yet (times the optimizer's own ``grad_scale``, as torch does), the factor clip_grad_norm_
    folded in, or the optimizer's own (None: the gradients hold their true values already)."""
    if still_scaled:  # scale * 1 is the scale: no launch for it
        own = getattr(optimizer, "grad_scale", None)
        return scale if own is None else scale * own
    if folded is not None:
        return folded
    return getattr(optimizer, "grad_scale", None)


def step_with_amp_attributes(
    optimizer: Any,
    inner: torch.optim.Optimizer,
    attributes: dict[str, torch.Tensor | None],
    args: tuple = (),
    kwargs: dict | None = None,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with ``attributes`` (``grad_scale``, ``found_inf``) set on
    ``inner``, the fused optimizer that reads them (``optimizer`` itself, or the one a wrapper
    holds), for that call only; they are removed again, also when the step raises."""
    for name, value in attributes.items():
        setattr(inner, name, value)
    try:
        return optimizer.step(*args, **(kwargs or {}))
    finally:
        for name in attributes:
            if name in vars(inner):
                delattr(inner, name)


def step_fused(
    optimizer: Any,
    inner: torch.optim.Optimizer,
    scale: torch.Tensor,
    still_scaled: bool,
    folded: torch.Tensor | None,
    skip: torch.Tensor,
    args: tuple = (),
    kwargs: dict | None = None,
) -> Any:
    """A fused optimizer's step: ``grad_scale`` (:func:`grad_scale_for_step`) and ``found_inf``
    (``skip``, the step's skip flag) set on ``inner`` for the call."""
    attributes = {"grad_scale": grad_scale_for_step(inner, scale, still_scaled, folded), "found_inf": skip}
    return step_with_amp_attributes(optimizer, inner, attributes, args, kwargs)


def step_unless(
    optimizer: Any,
    inner: torch.optim.Optimizer,
    skip: torch.Tensor,
    read_skip: Callable[[torch.Tensor], bool],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    on_device: bool = True,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` unless ``skip`` (a 0-dim device flag) is set. With
    ``on_device``, an optimizer that takes ``found_inf`` gets ``skip`` as its ``found_inf`` and
    skips on the device; otherwise ``read_skip(skip)`` decides on the host (the one host read)."""
    if on_device and StepProtocol.of(optimizer, inner) is StepProtocol.AMP_ATTRIBUTES:
        return step_with_amp_attributes(optimizer, inner, {"found_inf": skip}, args, kwargs)
    return None if read_skip(skip) else optimizer.step(*args, **(kwargs or {}))
