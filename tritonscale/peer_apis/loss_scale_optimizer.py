"""LossScaleOptimizer: loss scaling in the shape of TensorFlow's and Keras's optimizer wrapper.

The wrapper *is* a torch optimizer to the code around it (``param_groups``, ``state``,
``zero_grad``, ``add_param_group``, ``state_dict``, LR schedulers, step hooks), and its ``step()``
is a whole scaled step: the fused unscale / inf-check (/ clip) of a ``GradScaler``, the inner
optimizer's step (skipped on inf/NaN), and the policy's scale update. Nothing of the rule lives
here: the scale, its policy and the passes are the wrapped ``GradScaler``'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..passes.clip_args import check_max_norm, check_norm_type
from ..policy.loss_scale_policy import LossScalePolicy
from ..policy.peer_presets import PeerPreset
from ..scaler.compile_boundary import runs_eagerly
from ..scaler.grad_scaler import GradScaler
from ..scaler.scaler_args import noting_passed

#: The key under which state_dict() carries the scaler's state beside the inner optimizer's.
SCALER_KEY = "loss_scaler"
#: torch.optim.Optimizer's hook registries, kept on the wrapper itself (not the inner optimizer).
_HOOK_DICTS = tuple(
    f"_optimizer_{kind}_{when}_hooks" for kind in ("step", "state_dict", "load_state_dict") for when in ("pre", "post")
)
#: What an LR scheduler sets on the instance: ``step``, a wrapper that calls this very object
#: (through a weak reference), and its ``_opt_called`` flag. A copy keeping them would step the
#: original; torch.optim.Optimizer's own pickling leaves them out too.
_SCHEDULER_PATCHES = ("step", "_opt_called")


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wrap any torch optimizer so that its step is a loss-scaled (and optionally clipped) step.

    One-call form: ``backward_and_step(loss)`` or ``minimize(loss_fn)``. Split form:
    ``scaled_backward(loss)`` (as often as gradients accumulate), then ``step()`` (alias
    ``apply()``): unscale + inf/NaN check (+ clip by ``max_norm``) + the inner step, skipped on
    overflow, + the scale update. With a fused inner optimizer (``fused=True``) the unscale and the
    clip fold into its step: no gradient write, no host sync.

    Gradients left from a step are unscaled, or still scaled where the unscale folded into a fused
    step, so they must never meet the next scaled backward. ``minimize`` (Keras's) steps on its own
    loss's gradients only; ``backward_and_step`` and ``scaled_backward`` accumulate into ``.grad``
    as torch's loop does, so call ``zero_grad()`` once per iteration with them.

    ``policy``: a ``LossScalePolicy`` (torch's rule by default), or a peer's preset with its initial
    scale -- ``tritonscale.presets.keras()`` for Keras 3's, ``presets.tf_keras()`` for tf.keras 2's.

    Args:
        optimizer: the torch optimizer to wrap (not a ``LossScaleOptimizer``).
        policy: a ``LossScalePolicy``, a ``PeerPreset`` or a preset's name; None (the default) for
            torch's rule. Not with ``scaler``.
        max_norm: clip the gradients to this total norm in ``step()``; None (the default): no clip.
        norm_type: the norm's order (2.0).
        init_scale: the initial scale of the scaler built here (torch's 2**16; not passed, the
            initial scale of the preset given as ``policy``).
        backend: the built scaler's backend: "auto" (the default), "triton" or "torch".
        scaler: a ``GradScaler`` to use in place of one built here (on the device of the optimizer's
            first parameter); its policy is the rule.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer, or is already a ``LossScaleOptimizer``.
        ValueError: both ``policy`` and ``scaler``, a negative ``max_norm``, a non-number ``norm_type``,
            or (with no ``scaler``) an optimizer with no parameters.
        ScalerConfigError: the built ``GradScaler`` refuses ``policy`` or ``init_scale``.

    Example::

        optimizer = tritonscale.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=1.0)
        loss = loss_fn(model(x), y)
        optimizer.backward_and_step(loss)       # or: optimizer.scaled_backward(loss); optimizer.step()
        optimizer.zero_grad()
    """

    @noting_passed  # hands __init__ the names of the arguments the caller passed, as ``passed``
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        policy: LossScalePolicy | PeerPreset | str | None = None,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        init_scale: float = 2.0**16,
        backend: str = "auto",
        scaler: GradScaler | None = None,
        passed: frozenset[str] = frozenset(),
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError("optimizer is already a LossScaleOptimizer: wrapping it twice would scale twice")
        self.max_norm = None if max_norm is None else check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        if scaler is None:
            device = _device_of(optimizer)
            given = {"init_scale": init_scale} if "init_scale" in passed else {}  # else the preset's, or torch's
            scaler = GradScaler(device.type, backend=backend, policy=policy, **given)
        elif policy is not None:
            raise ValueError("pass either policy= or scaler= (whose policy it is), not both")
        self.optimizer = optimizer  # the real one: GradScaler unwraps wrappers through .optimizer
        self.scaler = scaler
        self._backward_since_step = False
        self._init_optimizer_parts()

    def _init_optimizer_parts(self) -> None:
        """What torch.optim.Optimizer.__init__ sets up besides the parameters (those are the inner
        optimizer's): the wrapper's own hooks, empty, and step() patched to run them and be profiled."""
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ---------------------------------------- deepcopy, pickle, torch.save
    def __getstate__(self) -> dict[str, Any]:
        """The wrapper whole: the inner optimizer, the scaler (which pickles between iterations, as
        torch's does) and the settings. torch.optim.Optimizer's would save ``param_groups``,
        ``state`` and ``defaults`` only, which here are properties of the inner optimizer, and its
        __setstate__ would then read them before ``optimizer`` exists. Hooks and an LR scheduler's
        patches of this instance (which call the original) are left out, as torch.optim.Optimizer
        leaves its own out: the copy steps itself. Example: ``copy.deepcopy((model, optimizer,
        scheduler))`` continues exactly as the original would."""
        left_out = (*_HOOK_DICTS, *_SCHEDULER_PATCHES)
        return {name: value for name, value in self.__dict__.items() if name not in left_out}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_optimizer_parts()

    # ----------------------------------------------- the inner optimizer's view
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's ``param_groups`` (setting it sets the inner optimizer's).

        Returns:
            the inner optimizer's list of parameter groups.
        """
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's ``state`` (setting it sets the inner optimizer's).

        Returns:
            the inner optimizer's per-parameter state.
        """
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's ``defaults`` (setting it sets the inner optimizer's).

        Returns:
            the inner optimizer's default hyperparameters.
        """
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The inner optimizer's ``add_param_group``.

        Args:
            param_group: the group to add, as ``torch.optim.Optimizer.add_param_group`` takes it.
        """
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's zero_grad; it also drops a pending ``scaled_backward``, whose
        gradients it discards (``step()`` then wants a new one).

        Args:
            set_to_none: set the gradients to None rather than to zero (True).
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._backward_since_step = False

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.optimizer!r}, max_norm={self.max_norm})"

    # ------------------------------------------------------------- the steps
    def scaled_backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """``(loss * scale).backward()``; call once per micro-batch, then ``step()``.

        Args:
            loss: the loss to scale and backpropagate.
            **backward_kwargs: passed to ``backward()`` (``retain_graph=True`` ...).
        """
        self.scaler.scale(loss).backward(**backward_kwargs)
        self._backward_since_step = True

    @runs_eagerly
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor | None:
        """Unscale + inf/NaN check (+ clip), the inner step unless it overflowed, the scale update.

        Returns the gradient norm before clipping (a 0-dim device tensor) when ``max_norm`` is set,
        else None. A closure cannot work here (its ``backward()`` would not be scaled): use
        ``minimize(loss_fn)``.

        Args:
            closure: must be None (the optimizer interface's argument; a closure is refused).

        Returns:
            the gradient norm before clipping (a 0-dim device tensor) when ``max_norm`` is set, else None.

        Raises:
            RuntimeError: a ``closure``, or no ``scaled_backward`` since the last step or ``zero_grad()``.
        """
        if closure is not None:
            raise RuntimeError(
                "LossScaleOptimizer.step() takes no closure: the closure's backward() would not be "
                "scaled; use minimize(loss_fn), or scaled_backward(loss) then step()"
            )
        if not self._backward_since_step:
            raise RuntimeError(
                "LossScaleOptimizer.step() without scaled_backward(loss) since the last step or "
                "zero_grad(): gradients from a plain loss.backward() would be divided by the loss scale"
            )
        norm = None
        if self.max_norm is not None:
            norm = self.scaler.clip_grad_norm_(self.optimizer, self.max_norm, self.norm_type)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._backward_since_step = False
        return norm

    def apply(self) -> torch.Tensor | None:
        """The split form's second half (TensorFlow's ``apply_gradients``): same as ``step()``.

        Returns:
            what ``step()`` returns: the gradient norm before clipping when ``max_norm`` is set, else None.

        Raises:
            RuntimeError: no ``scaled_backward`` since the last step or ``zero_grad()``.
        """
        return self.step()

    def backward_and_step(self, loss: torch.Tensor) -> torch.Tensor | None:
        """``scaled_backward(loss)`` then ``step()``: torch's ``scaler.scale(loss).backward();
        scaler.step(optimizer); scaler.update()`` in one call.

        Like torch's loop it accumulates into ``.grad``: a ``scaled_backward`` before it adds its
        micro-batch to this step, and leftover gradients are added too, so call ``zero_grad()``
        each iteration (``set_to_none=False`` where gradients are views of a flat buffer, which
        clearing them here would cut loose). ``minimize`` clears them itself. Example::

            optimizer.zero_grad()
            optimizer.backward_and_step(loss_fn(model(x), y))

        Args:
            loss: the loss of this (last) micro-batch.

        Returns:
            what ``step()`` returns: the gradient norm before clipping when ``max_norm`` is set, else None.
        """
        self.scaled_backward(loss)
        return self.step()

    def minimize(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Keras's ``minimize``: compute the loss with ``loss_fn()``, then a whole scaled step on the
        gradients of this loss only (fresh, as Keras's tape computes them); returns the loss.

        The wrapped optimizer's gradients are set to None (as ``zero_grad()`` does) after
        ``loss_fn()`` returns and before the scaled backward; if ``loss_fn`` or the backward
        raises, the gradients are as before. A pending ``scaled_backward`` is an error (its
        gradients would be lost): ``step()`` or ``zero_grad()`` first. After the step the
        gradients stay in ``.grad`` (unscaled; still scaled where the unscale folded into a fused
        step) for inspection, as after ``step()``. Example::

            optimizer.minimize(lambda: loss_fn(model(x), y))  # no zero_grad() needed

        Args:
            loss_fn: a function of no arguments returning the loss.

        Returns:
            the loss ``loss_fn()`` returned.

        Raises:
            TypeError: ``loss_fn`` is not callable.
            RuntimeError: a ``scaled_backward`` is pending.
        """
        if not callable(loss_fn):
            raise TypeError(f"minimize() takes a function returning the loss, got {type(loss_fn).__name__}")
        if self._backward_since_step:
            raise RuntimeError(
                "LossScaleOptimizer.minimize() with a scaled_backward(loss) pending: minimize() steps on "
                "fresh gradients of its own loss and would discard the accumulated ones; call step() to "
                "take that step first, or zero_grad() to discard them"
            )
        loss = loss_fn()
        self._fresh_scaled_backward(loss)
        self.step()
        return loss

    def _fresh_scaled_backward(self, loss: torch.Tensor) -> None:
        """``scaled_backward(loss)`` into gradients set to None first; if it raises, each parameter
        gets its previous gradient back (the same tensor: a set-to-None backward never writes it)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        left = [p.grad for p in params]
        self.optimizer.zero_grad(set_to_none=True)
        try:
            self.scaled_backward(loss)
        except BaseException:
            for param, grad in zip(params, left):
                param.grad = grad
            raise

    # ----------------------------------------------------------- what it says
    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host read).

        Returns:
            the scaler's ``get_scale()``.
        """
        return self.scaler.get_scale()

    @property
    def step_applied(self) -> torch.Tensor:
        """1.0 if the last step was applied (or none was taken yet), 0.0 if it was skipped: a device
        tensor, no sync; with a disabled scaler too (skipped where its clip found inf/NaN).

        Returns:
            a 0-dim float32 tensor, 1.0 or 0.0.
        """
        skipped = self.scaler.last_skip_flag()
        return torch.ones(()) if skipped is None else (~skipped).to(torch.float32)

    def last_step_applied(self) -> bool:
        """Whether the last step was applied (a host read).

        Returns:
            True if the last step was applied, False if it was skipped.
        """
        return not self.scaler.last_step_skipped()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict, with the scaler's under ``"loss_scaler"``.

        Returns:
            the inner optimizer's ``state_dict()`` and, under ``"loss_scaler"``, the scaler's.
        """
        return {**self.optimizer.state_dict(), SCALER_KEY: self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load both, or nothing. The scaler's load checks everything before it changes anything;
        if the inner optimizer's load then fails, the scaler gets its previous state back.

        Args:
            state_dict: a ``state_dict()`` of a ``LossScaleOptimizer``.

        Raises:
            KeyError: ``state_dict`` has no ``"loss_scaler"``.
        """
        state_dict = dict(state_dict)
        if SCALER_KEY not in state_dict:
            raise KeyError(f"state_dict has no {SCALER_KEY!r}: not saved from a LossScaleOptimizer")
        scaler_state = state_dict.pop(SCALER_KEY)
        previous = self.scaler.state_dict()
        self.scaler.load_state_dict(scaler_state)
        try:
            self.optimizer.load_state_dict(state_dict)
        except BaseException:
            self.scaler.load_state_dict(previous)
            raise


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    raise ValueError("the optimizer has no parameters")
