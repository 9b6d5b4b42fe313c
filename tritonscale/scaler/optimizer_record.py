"""One optimizer's record of an iteration: a typed value with torch's dict protocol.

torch's GradScaler keeps a ``defaultdict`` from ``id(optimizer)`` to a dict holding the optimizer's
``stage`` (READY -> UNSCALED -> STEPPED) and its ``found_inf_per_device``, made by the first call
that meets the optimizer in an iteration and dropped at ``update()``. Ours holds an
:class:`OptimizerRecord` in that place: the same two entries by key (``record["stage"]``), so code
written for torch's scaler reads and writes them as it does there, plus this scaler's own fields as
attributes: the step's skip flag, the clip's norm, the divisor a clip folded into a fused step, the
skip the clip's finalize decided, and what the direct-step guard noted.

A record is data and the rules about its own fields (the stage's errors, the pending factor, the
direct-step decision, the read-outs). It holds no reference to a scaler: ``GradScaler`` runs the
passes and the step and writes their results here (``scaler/grad_scaler.py``). Its optimizer it
holds weakly, as torch's table holds none: an optimizer dropped in the middle of an iteration is
not kept alive by the scaler until its update().
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

# torch's own enum, not a copy: frameworks test ``record["stage"] is OptState.UNSCALED`` with the
# OptState they import from torch, and that must hold for our records too.
from torch.amp.grad_scaler import OptState

from ..flags import flags_on, read_found_inf, summed_flag
from ..passes.backends.base import CheckResult
from ..policy.loss_scale_policy import LossScalePolicy
from ..policy.runner import IterationOutcome
from .step_protocols import is_torch_fused

__all__ = ["OptState", "OptimizerRecord", "new_records", "unscaled_skip", "weak"]

#: torch's error for a second unscale_ in an iteration, word for word.
_UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."


@dataclass
class OptimizerRecord:
    """One optimizer's iteration (all tensors stay on the device): what torch's dict holds, by key
    too (``record["stage"]``, ``record["found_inf_per_device"]``), plus this scaler's own fields. A
    record torch-protocol code makes in the table (``scaler._per_optimizer_states[id(opt)]``) is
    unbound (no optimizer) until the first call of the scaler that meets the optimizer binds it."""

    stage: OptState = OptState.READY
    #: inf/NaN flags per gradient device: they drive the skip and the policy's backoff. With a
    #: process group they are already the group's: the pass that made them combined them, on a
    #: line of unscale_/clip_grad_norm_/step, so reading them never communicates.
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    #: The step's skip flag on the scale's device: an overflow (unless the policy lets it
    #: through) or a norm spike. For a disabled scaler: what its clip found.
    skip: torch.Tensor | None = None
    #: The unscaled total norm, when clip_grad_norm_ ran.
    norm: torch.Tensor | None = None
    #: What clip_grad_norm_ folded into a fused optimizer's step: scale / clip_coef.
    grad_scale: torch.Tensor | None = None
    #: The step's skip flag as a pass's finalize decided it (None: the step decides), and the stamp
    #: of the policy it decided by: a policy replaced since (load_state_dict), or a knob of it set
    #: since (each set takes a new stamp, loss_scale_policy.py), decides again.
    decided_skip: torch.Tensor | None = field(default=None, repr=False, compare=False)
    decided_by: object = field(default=None, repr=False, compare=False)
    #: The real optimizer (``unwrap_optimizer``'s), held weakly; None while unbound.
    optimizer_ref: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    #: One of torch's own fused optimizers (which take dense gradients only), found at binding.
    torch_fused: bool = field(default=False, repr=False, compare=False)
    #: ``scaler.step`` is running this optimizer's step (a step its guard sees then is not direct).
    in_step: bool = field(default=False, repr=False, compare=False)
    #: The optimizer stepped, not through ``scaler.step``, after this iteration's unscale_ or clip
    #: (its guard saw it: :meth:`note_direct_step`); the next unscale_/clip before update() is refused.
    stepped_directly: bool = field(default=False, repr=False, compare=False)

    _TORCH_KEYS: ClassVar[tuple[str, ...]] = ("stage", "found_inf_per_device")

    @classmethod
    def from_flag(cls, found_inf: bool | torch.Tensor, device: torch.device) -> OptimizerRecord:
        """A record holding only an overflow flag the caller found itself (``update(found_inf=...)``):
        a bool, or a one-element tensor (nonzero: overflow) moved to ``device`` without a host read."""
        if isinstance(found_inf, torch.Tensor):
            if found_inf.numel() != 1 or found_inf.is_complex():
                raise ValueError(
                    f"found_inf must be a bool or a one-element tensor, got shape {tuple(found_inf.shape)}"
                )
            flag = (found_inf.detach().to(device, non_blocking=True).reshape(()) != 0).float()
        elif isinstance(found_inf, bool):
            flag = torch.tensor(float(found_inf), device=device)
        else:
            raise TypeError(f"found_inf must be a bool or a one-element tensor, got {type(found_inf).__name__}")
        return cls(found_inf_per_device={device: flag})

    @staticmethod
    def outcome(records: Iterable[OptimizerRecord]) -> IterationOutcome:
        """What ``records`` (the iteration's, in order) hand the policy's rule (one walk: every
        update() makes it)."""
        found_infs, skips, norms = [], [], []
        for r in records:
            found_infs.extend(r.found_inf_per_device.values())
            if r.skip is not None:
                skips.append(r.skip)
            if r.norm is not None:
                norms.append(r.norm)
        return IterationOutcome(found_infs, skips, norms)

    # ---------------------------------------------------------------- the optimizer
    def bind(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """This record, bound to ``optimizer`` (the real one) if it is not bound yet; returned."""
        if self.optimizer_ref is None:
            self.optimizer_ref, self.torch_fused = weak(optimizer), is_torch_fused(optimizer)
        return self

    @property
    def optimizer(self) -> Any:
        """The real optimizer whose iteration this is (None once it is gone, or while unbound)."""
        return self.optimizer_ref() if self.optimizer_ref is not None else None

    # ---------------------------------------------------------------- the stage
    def not_stepped(self, funcname: str) -> None:
        """torch's errors for an unscale_/clip_grad_norm_ after this iteration's step(), and for a
        second unscale_ (``unscale_``; a clip after one only clips), which a clip after a direct
        ``optimizer.step()`` is too: its gradients are a new backward's, still scaled."""
        if self.stage is OptState.STEPPED:
            raise RuntimeError(f"{funcname}() is being called after step().")
        if self.stage is OptState.UNSCALED and (funcname == "unscale_" or self.stepped_directly):
            raise RuntimeError(_UNSCALED_TWICE + (self._direct_step_fix() if self.stepped_directly else ""))

    def _direct_step_fix(self) -> str:
        name = type(self.optimizer).__name__
        return (
            f" {name}.step() was called directly after this iteration's unscale_()/clip_grad_norm_(), and no "
            "scaler.update() ended the iteration, so the gradients of the new backward still hold the loss "
            "scale. Step through the scaler every iteration: scaler.step(optimizer) (it skips a step whose "
            "gradients overflowed), then scaler.update(). Nothing was changed."
        )

    def note_direct_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step of this optimizer, seen by its guard (``step_protocols.DirectStepGuard``) after this
        iteration's unscale_ or clip: one that ``scaler.step`` is not running is direct. Refused,
        changing nothing, where a folded clip is pending and no divisor is handed over (the gradients
        still hold the loss scale); otherwise it goes ahead, as torch lets it, and is noted for
        :meth:`not_stepped`."""
        if self.in_step or self.stage is not OptState.UNSCALED:
            return
        if self.folded_grad_scale() is not None and getattr(optimizer, "grad_scale", None) is None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() called directly after scaler.clip_grad_norm_() folded the "
                "unscale and the clip into this fused optimizer's step: its gradients still hold the loss "
                "scale and would be applied that many times too large. Step it with scaler.step(optimizer), "
                "then scaler.update(); p.grad / scaler.folded_grad_scale(optimizer) reads the unscaled, "
                "clipped gradients, and GradScaler(..., fold_into_optimizer=False) makes the clip write "
                "them. Nothing was changed."
            )
        self.stepped_directly = True

    def pending_factor(self, scale: torch.Tensor) -> torch.Tensor:
        """What the gradients still have to be divided by: the scale before any pass, 1 after
        unscale_ or an applied clip, or what an earlier clip folded in (so a second clip sees true
        values)."""
        pending = scale if self.stage is OptState.READY else self.grad_scale
        return pending if pending is not None else torch.ones_like(scale)

    # ------------------------------------------------------------- the passes' results
    def note_flags(self, flags: dict[torch.device, torch.Tensor], skip: torch.Tensor | None, stamp: object) -> None:
        """An unscale_'s or a check's flags per device, and the skip its finalize decided (None: the
        step decides) under the policy of ``stamp``."""
        self.found_inf_per_device, self.decided_skip, self.decided_by = flags, skip, stamp

    def note_clip(self, device: torch.device, result: CheckResult, folds: bool, checked: bool, stamp: object) -> None:
        """An enabled clip's results on ``device``: its divisor when it ``folds``, its flag merged
        into the iteration's where its pass ``checked`` gradients, its norm, and the skip its finalize
        decided (None: the step decides) under the policy of ``stamp``. The stage becomes UNSCALED."""
        if folds and result.grad_scale is not None:
            self.grad_scale = result.grad_scale
        if checked:
            found = self.found_inf_per_device
            merged = result.skip is not None or device not in found  # a deciding finalize merged them
            found[device] = result.found_inf if merged else torch.maximum(found[device], result.found_inf)
        self.norm, self.stage = result.norm, OptState.UNSCALED
        self.decided_skip, self.decided_by = result.skip, stamp

    def decided_skip_on(self, device: torch.device, policy: LossScalePolicy) -> torch.Tensor | None:
        """The skip a finalize decided, if it still holds: on ``device``, under ``policy`` as it is."""
        skip = self.decided_skip
        return skip if skip is not None and skip.device == device and self.decided_by == policy.stamp else None

    # ------------------------------------------------------------------ read-outs
    def found_inf(self) -> torch.Tensor | None:
        """The flags summed into one 0-dim flag on the first one's device; None before the first
        check. Reads and communicates nothing."""
        return summed_flag(self.found_inf_per_device.values())

    def overflowed(self) -> bool:
        """:meth:`found_inf` read on the host (one read); False before the first check."""
        flag = self.found_inf()
        return flag is not None and read_found_inf([flag])

    def folded_grad_scale(self) -> torch.Tensor | None:
        """The divisor a clip folded into a fused step, until the step hands it over; else None."""
        return self.grad_scale if self.stage is OptState.UNSCALED else None

    def found_inf_on(self, device: torch.device, required: bool = True) -> torch.Tensor:
        """The flags as one 0-dim flag on ``device``. None recorded (no gradients): torch's error if
        ``required``, else 0."""
        flags = self.found_inf_per_device
        if len(flags) == 1:  # one device's 0-dim flag there already (nearly every step): as flags_on gives it
            (flag,) = flags.values()
            if flag.dim() == 0 and flag.device == device:
                return flag
        found_inf = flags_on(device, flags.values())
        if found_inf is None:
            if required:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        return found_inf

    # ------------------------------------------------------------- torch's dict protocol
    def __getitem__(self, key: str) -> Any:
        """torch's dict protocol: ``["found_inf_per_device"]`` is how torch-protocol code (fused
        optimizers' ``_maybe_opt_step``, frameworks) reads the flags that decide a step."""
        if key not in self._TORCH_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._TORCH_KEYS:
            raise KeyError(key)
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in self._TORCH_KEYS


def bare_record() -> OptimizerRecord:
    """What the table makes for an optimizer it has not met (the ``defaultdict``'s factory)."""
    return OptimizerRecord()


def new_records() -> defaultdict[int, OptimizerRecord]:
    """An iteration's empty table, keyed by ``id(optimizer)``. Its factory is a function, not the class:
    torch 2.11's Dynamo fails on ``defaultdict(OptimizerRecord)`` in a compiled ``update()``."""
    return defaultdict(bare_record)


def unscaled_skip(
    policy: LossScalePolicy, flags: dict[torch.device, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The skip of a step after ``unscale_`` (no norm): ``skip_decision``'s ``found_inf > 0`` as a
    float32 flag is the one flag of the scale's ``device`` itself, which the unscale pass only ever
    sets to 1.0 (kernels/apply_pass.py, torch's ``_amp_foreach_non_finite_check_and_unscale_``):
    nothing to launch. None (the step decides) for a policy that lets overflows through, or flags
    on another device or on several."""
    flag = flags.get(device)
    if not policy.skip_on_overflow or flag is None or len(flags) != 1:
        return None
    return flag


def weak(optimizer: Any) -> Callable[[], Any]:
    """A weak reference to ``optimizer``; a strong one for an object that takes none (``__slots__``)."""
    try:
        return weakref.ref(optimizer)
    except TypeError:
        return lambda: optimizer
