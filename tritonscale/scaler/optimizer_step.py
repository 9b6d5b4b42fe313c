"""One optimizer's part of an iteration: one object, of one kind per step protocol.

The scaler makes the object when it first meets the optimizer in an iteration (``unscale_``,
``clip_grad_norm_``, ``step``; keyed by the real optimizer behind any wrapper) and drops it at
``update()``, as torch keeps its per-optimizer dict. The object is that optimizer's record --
its stage READY -> UNSCALED -> STEPPED, the inf/NaN flags per device, the step's skip flag, the
clip's norm and what the clip folded -- and everything done with it: the passes over its
gradients (``unscale``, the read-only ``check`` of a fused step, ``clip``), the ``step``, and
the read-outs of its iteration. The controller keeps what every optimizer shares (settings, the
device state, the policy's rule, the rank checks) and hands itself to these methods; the object
reads from it only those shared things (``scaler._state_for``, ``_group``, ``_agreement``,
``_policy``, ``_rules``, ``_ranks``, ``_backend_name``, ``_fold``, ``_norm_owner``, ``_tensors``).

The kinds (``StepProtocol``, ``passes/step_protocols.py``, decides which):

* ``PlainStep``: any optimizer. The clip writes the unscaled, clipped gradients; the step unscales
  first if nothing did, and is skipped on one host read of the skip flag (as torch's).
* ``FusedStep``: torch's fused optimizers (``grad_scale``/``found_inf``). The clip folds
  ``scale / clip_coef`` into the step (the gradients stay scaled, a direct ``optimizer.step()`` is
  guarded), and the step hands the optimizer its divisor and the skip flag, on the device.
* ``ArgumentStep``: ``step(grad_scaler=...)``; the optimizer asks the scaler itself.
* ``DisabledStep``: ``enabled=False`` (bf16): the clip is a plain clip with its inf/NaN check, and
  the step after it skips on that finding, which the step spends.

Code written for torch's GradScaler reads ``scaler._per_optimizer_states[id(opt)]["stage"]`` (and
``["found_inf_per_device"]``), and may create an entry there for an optimizer the scaler has not
met (the table is a ``defaultdict`` of bare records, as torch's is): the first call that meets the
optimizer adopts such a record into its kind, carrying its stage and flags.
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

from ..flags import flags_on, moved_to, read_flag, read_found_inf, summed_flag
from ..grads.groups import collect_grads
from ..passes.clip_args import ClipRequest
from ..passes.grad_passes import check_grads, clip_grads, unscale_and_check_
from ..passes.step_decision import StepDecision
from ..passes.step_protocols import (
    StepProtocol,
    guard_direct_step,
    is_torch_fused,
    step_fused,
    step_unless,
    step_with_grad_scaler_argument,
)
from ..policy.runner import IterationOutcome

__all__ = ["OptState", "OptimizerRecord", "OptimizerStep", "direct_step", "step_kind", "unscaled_skip", "weak"]

#: torch's error for a second unscale_ in an iteration, word for word.
_UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."


@dataclass
class OptimizerRecord:
    """One optimizer's bookkeeping for the current iteration (all tensors stay on the device): what
    torch's dict holds, by key too (``record["stage"]``), plus this scaler's own fields. A bare
    record is what torch-protocol code makes in the table; the kinds below are records too."""

    stage: OptState = OptState.READY
    #: inf/NaN flags per gradient device: they drive the skip and the policy's backoff. With a
    #: process group they are already the group's: the pass that made them combined them, on a
    #: line of unscale_/clip_grad_norm_/step, so reading them never communicates.
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    #: The step's skip flag on the scale's device: an overflow (unless the policy lets it
    #: through) or a norm spike.
    skip: torch.Tensor | None = None
    #: The unscaled total norm, when clip_grad_norm_ ran.
    norm: torch.Tensor | None = None
    #: What clip_grad_norm_ folded into a fused optimizer's step: scale / clip_coef.
    grad_scale: torch.Tensor | None = None

    _TORCH_KEYS: ClassVar[tuple[str, ...]] = ("stage", "found_inf_per_device")

    @classmethod
    def from_flag(cls, found_inf: bool | torch.Tensor, device: torch.device) -> OptimizerStep:
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
        return OptimizerStep(found_inf_per_device={device: flag})

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


@dataclass
class OptimizerStep(OptimizerRecord):
    """An optimizer's iteration (see the module docstring); the base holds what every kind does
    alike. ``optimizer``: the real optimizer (``unwrap_optimizer``'s); None for a record that
    carries only a caller's flag (``update(found_inf=...)``). Made by :meth:`adopt`."""

    #: The step's skip flag as the clip's finalize decided it (None: the step decides), and the
    #: stamp of the policy it decided by: a policy replaced since (load_state_dict), or a knob of it
    #: set since (each set takes a new stamp, loss_scale_policy.py), decides again.
    decided_skip: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _decided_by: Any = field(default=None, repr=False, compare=False)
    #: The real optimizer, held weakly (as torch's table holds none): an optimizer dropped in the
    #: middle of an iteration is not kept alive by the scaler until its update().
    _optimizer: Any = field(default=None, repr=False, compare=False)
    #: One of torch's own fused optimizers (which take dense gradients only), found once.
    _torch_fused: bool = field(default=False, repr=False, compare=False)
    #: ``scaler.step`` is running this optimizer's step (a step its guard sees then is not direct).
    _in_step: bool = field(default=False, repr=False, compare=False)
    #: The optimizer stepped, not through ``scaler.step``, after this iteration's unscale_ or clip
    #: (its guard saw it: ``direct_step``); the next unscale_/clip before update() is refused.
    _stepped_directly: bool = field(default=False, repr=False, compare=False)

    #: The clip hands the fused step ``scale / clip_coef`` instead of writing the gradients.
    folds: ClassVar[bool] = False

    @classmethod
    def adopt(cls, optimizer: Any, record: OptimizerRecord | None) -> OptimizerStep:
        """This kind for ``optimizer``, carrying what ``record`` (a bare one, or another kind's, made
        earlier in the iteration) holds."""
        made = cls() if record is None else cls(
            record.stage, record.found_inf_per_device, record.skip, record.norm, record.grad_scale
        )  # fmt: skip
        made._optimizer, made._torch_fused = weak(optimizer), is_torch_fused(optimizer)
        made._stepped_directly = getattr(record, "_stepped_directly", False)
        return made

    @property
    def optimizer(self) -> Any:
        """The real optimizer whose iteration this is (None once it is gone, or for a caller's flag)."""
        return self._optimizer() if self._optimizer is not None else None

    @classmethod
    def clip_folds(cls, fold_into_optimizer: bool) -> bool:
        return cls.folds and fold_into_optimizer

    # -------------------------------------------------------------- the passes
    def _open(self, scaler: Any) -> None:
        """Enter the iteration's table (``scaler._per_optimizer_states``), once a call's own
        preconditions hold: where torch's dict makes its entry, so a call refused before leaves none."""
        scaler._per_optimizer_states[id(self.optimizer)] = self

    def not_stepped(self, funcname: str) -> None:
        """torch's errors for an unscale_/clip_grad_norm_ after this iteration's step(), and for a
        second unscale_ (``unscale_``; a clip after one only clips), which a clip after a direct
        ``optimizer.step()`` is too: its gradients are a new backward's, still scaled."""
        if self.stage is OptState.STEPPED:
            raise RuntimeError(f"{funcname}() is being called after step().")
        if self.stage is OptState.UNSCALED and (funcname == "unscale_" or self._stepped_directly):
            raise RuntimeError(_UNSCALED_TWICE + (self._direct_step_fix() if self._stepped_directly else ""))

    def _direct_step_fix(self) -> str:
        name = type(self.optimizer).__name__
        return (
            f" {name}.step() was called directly after this iteration's unscale_()/clip_grad_norm_(), and no "
            "scaler.update() ended the iteration, so the gradients of the new backward still hold the loss "
            "scale. Step through the scaler every iteration: scaler.step(optimizer) (it skips a step whose "
            "gradients overflowed), then scaler.update(). Nothing was changed."
        )

    def direct_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step of this optimizer, seen by its guard (``step_protocols.DirectStepGuard``) after this
        iteration's unscale_ or clip: one that ``scaler.step`` is not running is direct. Refused,
        changing nothing, where a folded clip is pending and no divisor is handed over (the gradients
        still hold the loss scale); otherwise it goes ahead, as torch lets it, and is noted for
        :meth:`not_stepped`."""
        if self._in_step or self.stage is not OptState.UNSCALED:
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
        self._stepped_directly = True

    def unscale(self, scaler: Any) -> None:
        """``unscale_``: divide the gradients by the scale in place, with the inf/NaN check."""
        scale = scaler._state_for("unscale_").scale
        self._open(scaler)
        self.not_stepped("unscale_")
        self._flags_pass(scaler, scale, unscale=True)
        guard_direct_step(self.optimizer, scaler, direct_step)  # a direct optimizer.step() after it is noted

    def check(self, scaler: Any, scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """A fused step's read-only inf/NaN check of the still scaled gradients, recorded."""
        self._open(scaler)
        self._flags_pass(scaler, scale, unscale=False)
        return self.found_inf_per_device

    def _flags_pass(self, scaler: Any, scale: torch.Tensor, *, unscale: bool) -> None:
        """unscale_'s pass (``unscale``) or the read-only check. With a process group, the
        collective: the group's flags; ranks that disagree raise before any write."""
        sparse_ok = unscale or not self._torch_fused
        grads = collect_grads(self.optimizer, allow_fp16=not unscale, allow_sparse=sparse_ok)
        group, backend = scaler._group(grads), scaler._backend_name
        agreement = None if group is None else scaler._agreement(self.optimizer)  # a single process: no rank code
        policy = scaler._policy
        if unscale:
            flags = unscale_and_check_(grads, scale, backend, group, agreement, policy.skip_on_overflow)
            skip = unscaled_skip(policy, flags, scale.device) if group is None else None
            self.stage = OptState.UNSCALED
        else:  # the check's finalize decides the step's skip where it can (passes/step_decision.py)
            decision = StepDecision(policy, scaler._tensors, {})
            flags, skip = check_grads(grads, scale, backend, group, agreement, decision)
        self.found_inf_per_device, self.decided_skip, self._decided_by = flags, skip, policy.stamp

    def clip(self, scaler: Any, max_norm: Any, norm_type: float, kernels: bool, process_group: Any) -> torch.Tensor:
        """``clip_grad_norm_``: unscale (what is still pending), check and clip in one fused pass;
        the norm before clipping. A clip that raises leaves the record as it was."""
        policy, inner = scaler._policy, self.optimizer
        scale = scaler._state_for("clip_grad_norm_").scale
        self._open(scaler)
        self.not_stepped("clip_grad_norm_")
        folds = self.clip_folds(scaler._fold)
        limit_of = scaler._rules.clip_limit(policy, scaler._tensors, max_norm)  # ZClip's adaptive max_norm
        # The step's skip decided in the clip's finalize where it can (passes/step_decision.py).
        decision = StepDecision(policy, scaler._tensors, self.found_inf_per_device)
        request = ClipRequest(
            max_norm, norm_type, folds, not policy.skip_on_overflow, limit_of=limit_of, decision=decision
        )
        sparse_ok = not (folds and self._torch_fused)  # torch's fused steps: dense only
        grads = collect_grads(
            inner, allow_fp16=folds, kernels=kernels, allow_sparse=sparse_ok, split_replicas=True, takes_norm=True
        )
        group = scaler._group(grads, process_group)
        checked = bool(grads.kernel or grads.other or grads.replicas) or group is not None  # no gradients: no inf check
        # With a process group, the collective: one row per rank, the agreement checked (rank_validation.py).
        device, result = clip_grads(
            grads,
            self.pending_factor(scale),
            request,
            backend=scaler._backend_name,
            group=group,
            agreement=None if group is None else scaler._agreement(inner, "clip", max_norm, norm_type),
        )
        # Folded, the gradients stay scaled until scaler.step: a direct optimizer.step() is refused;
        # otherwise it is noted (not_stepped).
        guard_direct_step(inner, scaler, direct_step)
        if folds and result.grad_scale is not None:
            self.grad_scale = result.grad_scale
        if checked:
            found = self.found_inf_per_device
            merged = result.skip is not None or device not in found  # a deciding finalize merged them
            found[device] = result.found_inf if merged else torch.maximum(found[device], result.found_inf)
        self.norm, self.stage = result.norm, OptState.UNSCALED
        self.decided_skip, self._decided_by = result.skip, policy.stamp
        scaler._norm_owner.claim(policy, inner)
        return result.norm

    def pending_factor(self, scale: torch.Tensor) -> torch.Tensor:
        """What the gradients still have to be divided by: the scale before any pass, 1 after
        unscale_ or an applied clip, or what an earlier clip folded in (so a second clip sees true
        values)."""
        pending = scale if self.stage is OptState.READY else self.grad_scale
        return pending if pending is not None else torch.ones_like(scale)

    # ---------------------------------------------------------------- the step
    def step(self, scaler: Any, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``scaler.step(optimizer)`` (``optimizer``: the object whose step is called): unscale or
        check if nothing did, decide the skip on the device, step unless skipped."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = scaler._state_for("step").scale
        self._open(scaler)
        if self.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._in_step = True
        try:
            retval = self._take_step(scaler, optimizer, scale, args, kwargs)
        finally:
            self._in_step = False
        self.stage = OptState.STEPPED
        return retval

    def _take_step(self, scaler: Any, optimizer: Any, scale: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError  # each kind's own

    def skip_flag(self, scaler: Any, device: torch.device, required: bool = True) -> torch.Tensor:
        """Decide on the device whether this step is skipped (an overflow the policy does not let
        through, or a norm spike); remember it for update(). The clip's finalize decided it already
        where it could (``decided_skip``): then nothing is launched. ``required``: no inf check
        recorded (no gradients) is torch's error; otherwise it reads 0."""
        skip = self.decided_skip
        if skip is None or skip.device != device or self._decided_by != scaler._policy.stamp:
            found_inf = self.found_inf_on(device, required)
            norm = moved_to(self.norm, device) if self.norm is not None else None
            policy, state = scaler._policy, scaler._tensors
            decide = scaler._rules.rule(policy, "skip_decision", device)
            skip = decide(found_inf, norm, state.norm_stats, spike_stats=state.spike_stats)
        self.skip = skip if scaler._ranks.pending is None else scaler._ranks.skip(skip)  # forced on by a mismatch
        return self.skip


@dataclass
class PlainStep(OptimizerStep):
    """Any optimizer: the scaler unscales, and the step is skipped on one host read (as torch's)."""

    def _take_step(self, scaler: Any, optimizer: Any, scale: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        if self.stage is OptState.READY:
            self._flags_pass(scaler, scale, unscale=True)  # with a group: the collective
        skip = self.skip_flag(scaler, scale.device)
        # The one host read; where a rank mismatch is pending, reading the skip raises it.
        read_skip = read_flag if scaler._ranks.pending is None else scaler._ranks.read_skip
        return step_unless(optimizer, self.optimizer, skip, read_skip, args, kwargs, on_device=False)


@dataclass
class FusedStep(OptimizerStep):
    """torch's fused optimizers: they divide by ``grad_scale`` and skip on ``found_inf`` themselves,
    on the device; the clip folds into that division."""

    folds: ClassVar[bool] = True

    def _take_step(self, scaler: Any, optimizer: Any, scale: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        still_scaled = self.stage is OptState.READY
        if still_scaled:  # the optimizer divides by grad_scale itself: a check only
            self._flags_pass(scaler, scale, unscale=False)  # with a group: the collective
        # No gradients: torch steps a fused optimizer all the same; update() then raises.
        skip = self.skip_flag(scaler, scale.device, required=False)
        return step_fused(optimizer, self.optimizer, scale, still_scaled, self.grad_scale, skip, args, kwargs)


@dataclass
class ArgumentStep(OptimizerStep):
    """``step(grad_scaler=...)`` (apex, TransformerEngine, torch's tests): the optimizer calls the
    scaler's ``_check_inf_per_device`` and ``_get_scale_async`` itself."""

    def _take_step(self, scaler: Any, optimizer: Any, scale: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        return step_with_grad_scaler_argument(optimizer, scaler, args, kwargs)


@dataclass
class DisabledStep(OptimizerStep):
    """``enabled=False`` (bf16): torch's plain step, unless the clip before it found inf/NaN."""

    def clip(self, scaler: Any, max_norm: Any, norm_type: float, kernels: bool, process_group: Any) -> torch.Tensor:
        """A plain clip (float16 gradients included) with the inf/NaN check the next step skips on."""
        grads = collect_grads(self.optimizer, allow_fp16=True, kernels=kernels, split_replicas=True, takes_norm=True)
        group = scaler._group(grads, process_group)
        agreement = scaler._agreement(self.optimizer, "clip", max_norm, norm_type)
        _, result = clip_grads(
            grads,
            None,
            ClipRequest(max_norm, norm_type),
            backend=scaler._backend_name,
            group=group,
            agreement=agreement,
        )
        self.skip = scaler._ranks.skip(result.found_inf)  # forced on by a mismatch
        self._open(scaler)  # the step after it spends the finding
        return result.norm

    def step(self, scaler: Any, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """The step spends the clip's finding; a bf16 loop may never call update(), so the step ends
        the iteration for the rank checks."""
        scaler._per_optimizer_states.pop(id(self.optimizer), None)
        scaler._disabled_skip = self.skip  # for last_step_skipped()
        scaler._ranks.next_iteration()
        if self.skip is None:
            return optimizer.step(*args, **kwargs)
        return step_unless(optimizer, self.optimizer, self.skip, scaler._ranks.read_skip, args, kwargs)


_KINDS = {StepProtocol.PLAIN: PlainStep, StepProtocol.AMP_ATTRIBUTES: FusedStep}
_KINDS[StepProtocol.GRAD_SCALER_ARGUMENT] = ArgumentStep


def step_kind(optimizer: Any, inner: torch.optim.Optimizer, enabled: bool) -> type[OptimizerStep]:
    """The kind of ``optimizer``'s iteration (``optimizer``: the object a call was given, a wrapper
    or the optimizer itself; ``inner``: the real optimizer): a disabled scaler's, or its protocol's."""
    return _KINDS[StepProtocol.of(optimizer, inner)] if enabled else DisabledStep


def unscaled_skip(policy: Any, flags: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The skip of a step after ``unscale_`` (no norm): ``skip_decision``'s ``found_inf > 0`` as a
    float32 flag is the one flag of the scale's ``device`` itself, which the unscale pass only ever
    sets to 1.0 (kernels/apply_pass.py, torch's ``_amp_foreach_non_finite_check_and_unscale_``):
    nothing to launch. None (the step decides) for a policy that lets overflows through, or flags
    on another device or on several."""
    flag = flags.get(device)
    if not policy.skip_on_overflow or flag is None or len(flags) != 1:
        return None
    return flag


def direct_step(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` is about to run: its guard's call (``step_protocols.DirectStepGuard``),
    which this iteration's record of it decides (``OptimizerStep.direct_step``: refused after a
    folded clip, else noted). Nothing recorded for it (a copy sharing its hooks, after update()):
    nothing to decide."""
    record = scaler._per_optimizer_states.get(id(optimizer))
    if isinstance(record, OptimizerStep) and record.optimizer is optimizer:
        record.direct_step(optimizer)


def weak(optimizer: Any) -> Callable[[], Any]:
    """A weak reference to ``optimizer``; a strong one for an object that takes none (``__slots__``)."""
    try:
        return weakref.ref(optimizer)
    except TypeError:
        return lambda: optimizer
