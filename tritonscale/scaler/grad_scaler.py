"""GradScaler: a drop-in for torch.amp.GradScaler whose passes are the fused Triton kernels.

One class, as torch's is, its state the fields ``__init__`` sets: a step runs the passes (``passes/``)
on the gradients (``grads/``), records each optimizer's stage in its record (``optimizer_record.py``,
a typed value with torch's dict protocol) and hands the flags to the policy's rule (``policy/``).
``step`` holds the three step protocols side by side in one ``if`` chain, as torch's does
(``step_protocols.py``: what they use). A collective happens only on a line that says so.
Sections: the constructor and ``scale``; one optimizer's iteration; the passes, ``step`` and
``update``; read-outs and settings; checkpoints and copies; torch.amp.GradScaler's own names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..flags import moved_to, read_flag, read_found_inf
from ..grads.groups import Grads, collect_grads
from ..host_reads import refuse_in_capture
from ..passes.backends import check_backend_name, resolve_backend
from ..passes.clip_args import ClipRequest, check_clip_args, kernels_compute
from ..passes.grad_passes import PerDevice, check_grads, clip_grads, torch_unscale_, unscale_and_check_
from ..passes.rank_validation import NOTHING_TO_UNDO, Agreement, RankChecks
from ..passes.rank_combine import gradient_group
from ..passes.step_decision import StepDecision
from ..policy.counters import LAST_SKIPPED
from ..policy.knob_validation import check_backoff_factor, check_growth_factor, check_growth_interval
from ..policy.loss_scale_policy import LossScalePolicy
from ..policy.peer_presets import PeerPreset
from ..policy.runner import PolicyRunner
from ..policy.state import DeviceState, HostState
from ..process_groups import check_process_group
from ..torch_compat import COMPILED_CLIP, has_torch, refuse_compiled_clip
from .checkpoint_codec import ScalerSnapshot, check_picklable, from_state_dict, to_state_dict
from .compile_boundary import call_eagerly, clip_stays_eager, runs_eagerly, update_stays_eager
from .diagnostics import NO_STATS_WHEN_DISABLED, device_stats, one_launch
from .norm_history import NormHistoryOwner
from .optimizer_record import OptimizerRecord, OptState, new_records, unscaled_skip
from .scale_outputs import scale_outputs
from .scaler_args import (
    TORCH_KNOBS,
    check_disabled_policy,
    checked_init_scale,
    cuda_missing,
    missing_state_error,
    noting_passed,
    peer_policy,
    policy_from_torch_args,
    set_scale_,
)
from .step_protocols import (
    StepProtocol,
    guard_direct_step,
    step_fused,
    step_unless,
    unwrap_optimizer,
    warn_grad_scaler_argument,
)

__all__ = ["GradScaler", "OptState"]


class GradScaler:
    """Dynamic loss scaling with a fused unscale / inf-check / clip pass and no host sync.

    torch's constructor, methods and state_dict, plus ``policy=`` (a ``LossScalePolicy``, or a peer's
    preset with its initial scale: ``presets.deepspeed(...)``, "megatron"), :meth:`clip_grad_norm_` and ``backend``
    ("auto", "triton", "torch"). ``process_group``: the group across which ranks hold parts of the
    gradients (ZeRO, pipeline stages; DTensors bring their mesh's, DDP replicas need none).

    Args:
        device: the device the scale lives on, as torch's ("cuda" by default; with no CUDA available
            an enabled "cuda" scaler warns and is disabled, as torch's).
        init_scale: the initial scale (torch's 2**16; not passed, the initial scale of the preset
            given as ``policy``; a tensor of one element is taken too).
        growth_factor: the factor the scale grows by after ``growth_interval`` steps without inf/NaN
            (torch's 2.0; one passed explicitly overrides the policy's).
        backoff_factor: the factor the scale is multiplied by on inf/NaN (torch's 0.5; one passed
            explicitly overrides the policy's).
        growth_interval: the number of steps without inf/NaN before the scale grows (torch's 2000;
            one passed explicitly overrides the policy's).
        enabled: False makes every call a no-op, as torch's (its arguments stay unchecked).
        backend: "auto" (the Triton kernels where they run, else torch's ops), "triton" or "torch".
        policy: a ``LossScalePolicy``, a peer's ``PeerPreset`` (``presets.deepspeed(...)``) or a
            preset's name ("megatron"); None for torch's dynamic policy.
        fold_into_optimizer: whether :meth:`clip_grad_norm_` folds into a fused optimizer's step
            (True by default) rather than writing the gradients.
        compile_policy: True to compile the policy's update as tensor ops, False not to; None (the
            default) runs the policy kernel where it can launch.
        process_group: the group across which ranks hold parts of the gradients; None when they
            are not split.
        knobs: any other ``LossScalePolicy`` knob by name (``hysteresis=2``), overriding the policy's.

    Raises:
        ScalerConfigError: an invalid knob, or an ``init_scale`` outside the policy's bounds.

    Example::

        scaler = tritonscale.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).square().mean()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # fused unscale + inf-check + clip
        scaler.step(optimizer)                                   # skipped on inf/NaN
        scaler.update()
    """

    @noting_passed  # hands __init__ the names of the arguments the caller passed, as ``passed``
    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        backend: str = "auto",
        policy: LossScalePolicy | PeerPreset | str | None = None,
        fold_into_optimizer: bool = True,
        compile_policy: bool | None = None,
        process_group: Any = None,
        passed: frozenset[str] = frozenset(),
        **knobs: Any,
    ) -> None:
        # The constructor's settings.
        self._device = device
        self._backend_name = check_backend_name(backend)
        self._fold = bool(fold_into_optimizer)
        self._process_group = check_process_group(process_group)
        self._runner = PolicyRunner(compile_policy, self._backend_name)
        self._enabled = False if cuda_missing(device, enabled) else enabled  # torch disables it then, too
        # A peer's preset brings its initial scale and knobs; those the caller passed win, even at torch's values.
        policy, policy_init_scale = peer_policy(policy)
        init_scale = init_scale if "init_scale" in passed else policy_init_scale
        torch_knobs = dict(growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
        given = {name: torch_knobs[name] for name in TORCH_KNOBS if name in passed}
        self._policy = policy_from_torch_args(policy, knobs, given)
        if not enabled:  # the norm rules would be ignored: refused (torch's knobs: kept unchecked, as torch's)
            check_disabled_policy(self._policy)
        # Like torch, a disabled scaler keeps its arguments unchecked.
        init_scale = checked_init_scale(init_scale, self._policy) if self._enabled else init_scale
        # The scale and the policy's trackers: Python numbers until the first scale(), then tensors.
        self._host = HostState.initial(init_scale, self._policy)
        self._tensors: DeviceState | None = None
        # This iteration, per optimizer (keyed by id, as torch's), and what the last one left.
        self._per_optimizer_states: dict[int, OptimizerRecord] = new_records()
        self._last_found_inf: torch.Tensor | None = None
        self._last_norm: torch.Tensor | None = None
        self._disabled_skip: torch.Tensor | None = None  # a disabled scaler's last step() skip flag
        self._ranks = RankChecks()  # the call sequence and mismatches across ranks (rank_validation.py)
        self._norm_owner = NormHistoryOwner()  # the one optimizer whose clip norms the policy's history takes

    # ------------------------------------------------------------------ scale
    @runs_eagerly
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or each tensor of a (nested) list/tuple/iterable, by the scale.
        Example: ``scaler.scale(loss).backward()``.

        Args:
            outputs: a tensor, or a (nested) list/tuple/iterable of tensors, to scale.

        Returns:
            the scaled tensor(s), in the same structure; ``outputs`` itself when disabled.
        """
        if not self._enabled:
            return outputs
        return scale_outputs(outputs, self._scale_on)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, made on ``device`` by the first scale() of the scaler's life."""
        if self._tensors is None:
            self._tensors = self._host.to_device(device)
        return self._tensors.scale

    def _state_for(self, funcname: str) -> DeviceState:
        """The device state, which a step needs: torch's error when no scale() has made it."""
        if self._tensors is None:
            raise missing_state_error(funcname)
        return self._tensors

    # ------------------------------------------------------- one optimizer's iteration
    def _record_for(self, inner: torch.optim.Optimizer) -> OptimizerRecord:
        """This iteration's record of ``inner`` (the real optimizer, ``unwrap_optimizer``'s): the
        table's, bound to it (a record torch-protocol code made is bound now), or a new one, which
        enters the table (``_enter``) once the call's own checks pass."""
        record = self._per_optimizer_states.get(id(inner))
        return (OptimizerRecord() if record is None else record).bind(inner)

    def _enter(self, inner: torch.optim.Optimizer, record: OptimizerRecord) -> None:
        """``record`` in the iteration's table: where torch's dict makes its entry, so a call
        refused before leaves none."""
        self._per_optimizer_states[id(inner)] = record

    def _recorded(self, optimizer: Any) -> OptimizerRecord | None:
        """What this iteration recorded for ``optimizer`` (a wrapper's inner one); None if nothing."""
        return self._per_optimizer_states.get(id(unwrap_optimizer(optimizer)))

    def _group(self, grads: Grads, process_group: Any = None) -> Any:
        """The group the gradients are split across (None: this rank holds them whole)."""
        if process_group is None and self._process_group is None and grads.mesh is None:
            return None
        return gradient_group(process_group, self._process_group, grads.mesh_group)

    def _agreement(
        self, optimizer: Any, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What this call's combine row says every rank agrees on (passes/rank_validation.py), the
        device state included: its trackers are hashed on the device."""
        state = self._tensors if self._enabled else None
        scale = state.scale if state is not None else None
        return Agreement(self._ranks, scale, kind, optimizer, self._policy, max_norm, norm_type, state=state)

    # ------------------------------------------------------- gradient passes
    @runs_eagerly
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record inf/NaN on the device:
        one fused read+check+write pass per (device, dtype) group; no host sync. Example:
        ``scaler.unscale_(optimizer)`` after backward (the gradients now hold their true values).

        Args:
            optimizer: the optimizer whose gradients are unscaled (a wrapper's inner one is used).
        """
        if not self._enabled:
            return
        inner = unwrap_optimizer(optimizer)
        record = self._record_for(inner)
        scale = self._state_for("unscale_").scale
        self._enter(inner, record)
        record.not_stepped("unscale_")
        self._flags_pass(inner, record, scale, unscale=True)  # with a process group, the collective
        guard_direct_step(inner, self, note_direct_step)  # a direct optimizer.step() after it is noted

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        process_group: Any = None,
    ) -> torch.Tensor:
        """Unscale, inf-check and clip the optimizer's gradients by their global norm, fused: the
        norm before clipping (0-dim float32 on the gradients' device), as ``unscale_`` followed by
        ``torch.nn.utils.clip_grad_norm_``; it counts as this iteration's ``unscale_`` (after one it
        only clips). ``process_group`` overrides the scaler's: the norm is then the group's, bitwise
        the same on each rank. torch's ``foreach`` has no effect here (one fused pass), and its
        ``error_if_nonfinite=True`` is refused (inf/NaN: step() skips). ``scaler.clip_grad_norm_(opt, 1.0)``.

        Args:
            optimizer: the optimizer whose gradients are clipped.
            max_norm: the largest norm the gradients keep, >= 0 (inf: only measure the norm).
            norm_type: the p of the p-norm, as torch's (2.0 by default; 1, 2 and inf run in the kernels).
            error_if_nonfinite: torch's; only False (the default) is taken.
            foreach: torch's; None, True or False, without effect here.
            process_group: the group whose norm is taken, overriding the scaler's; None keeps the scaler's.

        Returns:
            the total norm of the unscaled gradients before clipping, a 0-dim float32 tensor on the
            gradients' device.

        Raises:
            ValueError: ``error_if_nonfinite=True``, a negative ``max_norm`` or a non-number ``norm_type``.
            TypeError: a ``foreach`` or ``error_if_nonfinite`` that is not a bool (or None for ``foreach``).
        """
        max_norm, norm_type = check_clip_args(max_norm, norm_type, error_if_nonfinite, foreach)
        kernels, inner = kernels_compute(norm_type), unwrap_optimizer(optimizer)
        record = self._record_for(inner)
        if clip_stays_eager(process_group or self._process_group, inner):
            return call_eagerly(self.clip_grad_norm_, optimizer, max_norm, norm_type, process_group=process_group)
        if torch.compiler.is_compiling() and not has_torch(COMPILED_CLIP):
            refuse_compiled_clip()  # raised while Dynamo traces: torch 2.11's cannot trace the clip
        # The norm history is the scaler's: a second optimizer's clip is refused before anything changes.
        self._norm_owner.check(self._policy, inner)
        if not self._enabled:  # bf16: a plain clip, with the inf/NaN check the step after it skips on
            return self._plain_clip(inner, record, max_norm, norm_type, kernels, process_group)
        policy, state = self._policy, self._state_for("clip_grad_norm_")
        self._enter(inner, record)
        record.not_stepped("clip_grad_norm_")
        folds = StepProtocol.of(optimizer, inner).clip_folds(self._fold)  # a fused step divides by scale / clip_coef
        grads = collect_grads(
            inner,
            allow_fp16=folds,
            by_dtype=kernels,  # the norms the kernels do not compute: per tensor
            allow_sparse=not (folds and record.torch_fused),  # torch's fused steps: dense only
            split_replicas=True,
            takes_norm=True,
        )
        group = self._group(grads, process_group)
        request = ClipRequest(
            max_norm,
            norm_type,
            folds,
            not policy.skip_on_overflow,
            limit_of=self._runner.clip_limit(policy, state, max_norm),  # ZClip's adaptive max_norm
            decision=StepDecision(policy, state, record.found_inf_per_device),  # the finalize decides the skip
        )
        agreement = None if group is None else self._agreement(inner, "clip", max_norm, norm_type)
        # The fused pass; with a process group, the collective: one row per rank, the agreement checked.
        pending = record.pending_factor(state.scale)
        backend = self._backend_name
        device, result = clip_grads(grads, pending, request, backend=backend, group=group, agreement=agreement)
        # Folded, the gradients stay scaled until scaler.step: a direct optimizer.step() is refused, else noted.
        guard_direct_step(inner, self, note_direct_step)
        checked = bool(grads.by_dtype or grads.other or grads.replicas) or group is not None  # no gradients: no check
        record.note_clip(device, result, folds, checked, policy.stamp)
        self._norm_owner.claim(policy, inner)
        return result.norm

    def _plain_clip(
        self,
        inner: torch.optim.Optimizer,
        record: OptimizerRecord,
        max_norm: float,
        norm_type: float,
        kernels: bool,
        process_group: Any,
    ) -> torch.Tensor:
        """A disabled scaler's clip: a plain clip (float16 gradients included) with the inf/NaN check
        the next step skips on; the norm."""
        grads = collect_grads(inner, allow_fp16=True, by_dtype=kernels, split_replicas=True, takes_norm=True)
        group = self._group(grads, process_group)
        agreement = self._agreement(inner, "clip", max_norm, norm_type)
        # The pass; with a process group, the collective.
        _, result = clip_grads(
            grads, None, ClipRequest(max_norm, norm_type), backend=self._backend_name, group=group, agreement=agreement
        )
        record.skip = self._ranks.skip(result.found_inf)  # forced on by a mismatch
        self._enter(inner, record)  # the step after it spends the finding
        return result.norm

    # ------------------------------------------------------------------ step
    @runs_eagerly
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done this iteration) and step, skipped on inf/NaN: on the device for
        optimizers that take ``grad_scale``/``found_inf`` (torch's fused ones), else after one host
        read, as torch's. Closures are refused, as in torch. Example: ``scaler.step(optimizer)``.

        Args:
            optimizer: the optimizer to step.
            args: passed on to ``optimizer.step``.
            kwargs: passed on to ``optimizer.step`` (a ``closure`` is refused).

        Returns:
            what ``optimizer.step`` returned; None when the step was skipped.

        Raises:
            RuntimeError: a ``closure`` keyword, or a second step() of the optimizer before update().
            AssertionError: no scale() has made the scale yet (torch's error).
        """
        inner = unwrap_optimizer(optimizer)  # the real optimizer behind a wrapper: its record, its step's attributes
        if not self._enabled:
            return self._disabled_step(optimizer, inner, args, kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        record = self._record_for(inner)
        scale = self._state_for("step").scale
        self._enter(inner, record)
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        protocol = StepProtocol.of(optimizer, inner)
        record.in_step = True  # the direct-step guard lets this step through
        try:
            if protocol is StepProtocol.GRAD_SCALER_ARGUMENT:  # apex, TransformerEngine: it asks this scaler
                warn_grad_scaler_argument(stacklevel=4)  # at the caller of scaler.step()
                retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            elif protocol is StepProtocol.AMP_ATTRIBUTES:  # it divides by grad_scale, skips on found_inf
                still_scaled = record.stage is OptState.READY
                if still_scaled:  # a check only; with a process group, the collective
                    self._flags_pass(inner, record, scale, unscale=False)
                skip = self._skip_flag(record, scale.device, required=False)  # none: torch steps it all the same
                retval = step_fused(optimizer, inner, scale, still_scaled, record.grad_scale, skip, args, kwargs)
            else:  # a plain step: unscaled here, skipped on one host read, as torch's
                if record.stage is OptState.READY:  # with a process group, the collective
                    self._flags_pass(inner, record, scale, unscale=True)
                skip = self._skip_flag(record, scale.device)
                read_skip = read_flag if self._ranks.pending is None else self._ranks.read_skip  # a mismatch raises
                retval = step_unless(optimizer, inner, skip, read_skip, args, kwargs, on_device=False)
        finally:
            record.in_step = False
        record.stage = OptState.STEPPED
        return retval

    def _disabled_step(self, optimizer: Any, inner: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """A disabled scaler's step (bf16): torch's plain step, skipped where the clip before it found
        inf/NaN; it spends that finding. A bf16 loop may never call update(): the step ends the
        iteration for the rank checks."""
        record = self._per_optimizer_states.pop(id(inner), None)
        self._disabled_skip = None if record is None else record.skip  # for last_step_skipped()
        self._ranks.next_iteration()
        if self._disabled_skip is None:
            return optimizer.step(*args, **kwargs)
        return step_unless(optimizer, inner, self._disabled_skip, self._ranks.read_skip, args, kwargs)

    def _flags_pass(
        self, inner: torch.optim.Optimizer, record: OptimizerRecord, scale: torch.Tensor, *, unscale: bool
    ) -> None:
        """unscale_'s pass (``unscale``) or a fused step's read-only check of the still scaled
        gradients, recorded. With a process group, the collective: the group's flags; ranks that
        disagree raise before any write."""
        grads = collect_grads(inner, allow_fp16=not unscale, allow_sparse=unscale or not record.torch_fused)
        group, policy = self._group(grads), self._policy
        agreement = None if group is None else self._agreement(inner)  # a single process: no rank code
        if unscale:
            flags = unscale_and_check_(grads, scale, self._backend_name, group, agreement, policy.skip_on_overflow)
            skip = unscaled_skip(policy, flags, scale.device) if group is None else None
            record.stage = OptState.UNSCALED
        else:  # the check's finalize decides the step's skip where it can (passes/step_decision.py)
            decision = StepDecision(policy, self._tensors, {})
            flags, skip = check_grads(grads, scale, self._backend_name, group, agreement, decision)
        record.note_flags(flags, skip, policy.stamp)

    def _skip_flag(self, record: OptimizerRecord, device: torch.device, required: bool = True) -> torch.Tensor:
        """Decide on the device whether ``record``'s step is skipped (an overflow the policy does not
        let through, or a norm spike); recorded for update(). A finalize decided it already where it
        could (``decided_skip``): then nothing is launched. ``required``: no inf check recorded (no
        gradients) is torch's error; otherwise it reads 0."""
        skip = record.decided_skip_on(device, self._policy)
        if skip is None:
            found_inf = record.found_inf_on(device, required)
            norm = moved_to(record.norm, device) if record.norm is not None else None
            decide = self._runner.rule(self._policy, "skip_decision", device)
            skip = decide(found_inf, norm, self._tensors.norm_stats, spike_stats=self._tensors.spike_stats)
        record.skip = skip if self._ranks.pending is None else self._ranks.skip(skip)  # forced on by a mismatch
        return record.skip

    # ---------------------------------------------------------------- update
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, found_inf: bool | torch.Tensor | None = None
    ) -> None:
        """Back the scale off if a step this iteration saw inf/NaN, else maybe grow it, on the device.
        ``new_scale`` sets the scale instead; ``found_inf`` (a bool or a 0-dim device tensor) adds an
        overflow the caller found itself (a scale manager's). Example: ``scaler.update()``.

        Args:
            new_scale: the scale to set instead of the policy's update (a number or a device tensor);
                None (the default) applies the policy.
            found_inf: an overflow found by the caller, a bool or a 0-dim device tensor (nonzero:
                inf/NaN); None (the default) adds none.

        Raises:
            AssertionError: an enabled scaler with no scale() before it (torch's error).
        """
        if update_stays_eager(self._process_group, self._ranks, self._policy, new_scale):
            return call_eagerly(self.update, new_scale, found_inf=found_inf)
        if not self._enabled:
            self._per_optimizer_states = new_records()
            return
        scale = self._state_for("update").scale
        self._refuse_host_work_in_capture(scale.device, found_inf)
        records = self._per_optimizer_states.values()
        if found_inf is not None:
            record = OptimizerRecord.from_flag(found_inf, scale.device)
            self._skip_flag(record, scale.device)
            records = [*records, record]
        outcome = OptimizerRecord.outcome(records)
        if new_scale is None and self._ranks.pending is None:  # every step's case: no context to enter
            self._last_found_inf, self._last_norm = self._runner.update_(self._policy, self._tensors, outcome)
        else:
            with NOTHING_TO_UNDO if self._ranks.pending is None else self._ranks.unchanged_if_mismatched(self._tensors):
                self._last_found_inf, self._last_norm = self._apply_rule(new_scale, outcome)
        self._per_optimizer_states = new_records()
        self._ranks.next_iteration(scale.device)

    def _apply_rule(self, new_scale: float | torch.Tensor | None, outcome: Any) -> tuple:
        """The policy's update of the device state, or with ``new_scale`` the scale set and the
        iteration counted; the found_inf and norm used."""
        if new_scale is None:
            return self._runner.update_(self._policy, self._tensors, outcome)
        set_scale_(self._tensors.scale, new_scale)
        return self._runner.count_only_(self._policy, self._tensors, outcome)

    def _refuse_host_work_in_capture(self, device: torch.device, found_inf: bool | torch.Tensor | None) -> None:
        """update()'s parts that a CUDA graph would freeze at capture: refused before any change."""
        if self._policy.needs_host_check():
            refuse_in_capture(
                device,
                "update() with a policy that checks on the host (on_min_scale='raise'/'warn', max_consecutive_skips, "
                "raise_at_scale)",
                "capture with on_min_scale='clamp' and neither max_consecutive_skips nor raise_at_scale, or call "
                "update() after each replay, outside the graph",
            )
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            refuse_in_capture(
                device, "update(found_inf=<a Python bool>)", "pass found_inf as a 0-dim device tensor the graph reads"
            )

    # ------------------------------------------------------------- read-outs
    # None communicates, none changes state; each optimizer's comes from its record.
    def optimizer_stage(self, optimizer: torch.optim.Optimizer) -> OptState | None:
        """``optimizer``'s stage in this iteration (torch's ``OptState``); None when nothing was
        recorded for it since the last update(). Example: ``scaler.optimizer_stage(opt) is None``.

        Args:
            optimizer: the optimizer asked about (a wrapper's inner one is used).

        Returns:
            its ``OptState``, or None.
        """
        record = self._recorded(optimizer)
        return record.stage if record is not None else None

    def found_inf_for(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """This iteration's overflow flag for ``optimizer`` (0-dim float32 on the device, nonzero on
        inf/NaN; the process group's, with one); None before its first check. No host read.
        Example: ``flags.append(scaler.found_inf_for(opt))`` after clip_grad_norm_, to log later.

        Args:
            optimizer: the optimizer asked about.

        Returns:
            a 0-dim float32 device tensor (nonzero on inf/NaN), or None before its first check.
        """
        record = self._recorded(optimizer)
        return record.found_inf() if record is not None else None

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`found_inf_for` read on the host (one read); False before the first check.
        Example: ``if scaler.overflowed(opt): ...`` (its step() will skip).

        Args:
            optimizer: the optimizer asked about.

        Returns:
            True when this iteration's check found inf/NaN in its gradients.
        """
        record = self._recorded(optimizer)
        return record is not None and record.overflowed()

    def folded_grad_scale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The divisor (``scale / clip_coef``) a clip folded into ``optimizer``'s fused step, until step()
        hands it over; else None (``p.grad`` then holds the unscaled, clipped gradients). Example, for any
        optimizer: ``d = scaler.folded_grad_scale(opt); g = p.grad if d is None else p.grad / d``.

        Args:
            optimizer: the optimizer asked about.

        Returns:
            the folded divisor as a device tensor, or None.
        """
        record = self._recorded(optimizer)
        return record.folded_grad_scale() if record is not None else None

    def folds_clip_into(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`clip_grad_norm_` hands ``optimizer``'s fused step ``scale / clip_coef``
        (the gradients then stay scaled until :meth:`step`) rather than writing the gradients. A
        disabled scaler's clip is a plain clip: it writes them, and this is False.
        Example: ``if not scaler.folds_clip_into(opt): grads_are_unscaled_after_the_clip()``.

        Args:
            optimizer: the optimizer asked about.

        Returns:
            True when a clip of its gradients folds into its step.
        """
        inner = unwrap_optimizer(optimizer)
        return self._enabled and StepProtocol.of(optimizer, inner).clip_folds(self._fold)

    def last_norm(self) -> torch.Tensor | None:
        """The norm the last update() used (its iteration's last clip_grad_norm_'s), on the device;
        None if that iteration clipped nothing. Example: ``norm = scaler.last_norm()``.

        Returns:
            a 0-dim device tensor, or None.
        """
        return self._last_norm

    def last_skip_flag(self) -> torch.Tensor | None:
        """Whether the last completed iteration skipped its step: a 0-dim bool device tensor, no host
        read (False before the first; None before any state). Example: ``skipped = scaler.last_skip_flag()``.

        Returns:
            a 0-dim bool device tensor, or None.
        """
        if not self._enabled:  # skipped only when the clip_grad_norm_ before it found inf/NaN
            return self._disabled_skip > 0 if self._disabled_skip is not None else None
        return self._ranks.skip(self._tensors.counters[LAST_SKIPPED] > 0) if self._tensors is not None else None

    def _live_skip_counter(self) -> torch.Tensor | None:
        """``live_skip_counter``'s answer (below)."""
        if not self._enabled or self._tensors is None or self._ranks.pending is not None:
            return None
        return self._tensors.counters[LAST_SKIPPED]

    @runs_eagerly
    def last_step_skipped(self) -> bool:
        """Whether the last completed iteration skipped its step (a host read; the device flag is
        ``last_skip_flag()``). Example: ``if not scaler.last_step_skipped(): scheduler.step()``.

        Returns:
            True when the last completed iteration skipped its step (False before any state).

        Raises:
            RankMismatchError: a mismatch across ranks was flagged on the device.
        """
        skipped = self.last_skip_flag()
        if self._enabled:
            self._ranks.raise_if_flagged()
        return skipped is not None and bool(skipped.item())

    @runs_eagerly
    def stats(self) -> dict[str, torch.Tensor]:
        """Per-step statistics as 0-dim device tensors, no host sync: ``scale``, ``growth_tracker``,
        ``norm`` (the last clip_grad_norm_'s, NaN if none), ``found_inf`` (the last update's flag),
        ``skipped`` (0/1), ``skipped_steps``, ``consecutive_skips``, ``hysteresis_left``. They are
        this step's values (device copies), safe to keep and read steps later. Example:
        ``writer.add_scalar("loss_scale", scaler.stats()["scale"], step)`` (the logger syncs; a
        logger that must not: ``tritonscale.StepLog``, docs/training-loop.md).

        Returns:
            a dict from each of those names to its 0-dim device tensor.

        Raises:
            RuntimeError: the scaler is disabled.
            AssertionError: no scale() has made the scale yet (torch's error).
        """
        if not self._enabled:
            raise RuntimeError(NO_STATS_WHEN_DISABLED)
        state = self._state_for("stats")
        gather = one_launch(state.scale.device, self._backend_name)  # the paths a GPU takes: one launch
        return device_stats(
            state.scale, state.growth_tracker, state.counters, self._last_found_inf, self._last_norm, gather=gather
        )

    # ------------------------------------------------------------- settings
    @property
    def backend(self) -> str:
        """The requested backend: "auto", "triton" or "torch" (:meth:`backend_for` names the one that runs).

        Returns:
            the constructor's ``backend``.
        """
        return self._backend_name

    def backend_for(self, device: torch.device | str | None = None) -> str:
        """The backend whose passes run for gradients on ``device``: what "auto" resolved to.

        Args:
            device: where the gradients live; ``None`` for the scaler's device.

        Returns:
            "triton" (the fused kernels) or "torch" (torch's foreach/amp ops). Example:
            ``GradScaler("cpu").backend_for()`` is "torch" unless TRITON_INTERPRET=1 was set before import.

        Raises what the first step would: ``backend="triton"`` on a device Triton cannot run on.
        """
        return resolve_backend(self._backend_name, torch.device(self._device if device is None else device)).name

    @property
    def fold_into_optimizer(self) -> bool:
        """The constructor's: whether clip_grad_norm_ folds into a fused optimizer's step.

        Returns:
            the constructor's ``fold_into_optimizer``, as a bool.
        """
        return self._fold

    @property
    def process_group(self) -> Any:
        """The constructor's ``process_group`` (None: the gradients are not split across ranks).

        Returns:
            the process group, or None.
        """
        return self._process_group

    def get_policy(self) -> LossScalePolicy:
        """A copy of the loss-scale policy in use. Example: ``scaler.get_policy().skip_on_overflow``.

        Returns:
            a new ``LossScalePolicy`` with the same knobs (changing it leaves the scaler's as it is).
        """
        return LossScalePolicy(**self._policy.knobs())

    def place_state(self, device: torch.device | str) -> torch.device:
        """Make the scale and its trackers on ``device`` now, as the first scale() would (state
        already made stays where it is); return their device. Example: ``scaler.place_state("cuda")``.

        Args:
            device: the device to make the state on.

        Returns:
            the ``torch.device`` the state lives on.
        """
        return self._scale_on(torch.device(device)).device

    # ------------------------------------------------ a rank agreement, for adapters
    def rank_agreement(
        self, optimizer: torch.optim.Optimizer, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What every rank must agree on for a collective about ``optimizer`` (this scaler's scale
        and call sequence, the call ``kind``, the clip's ``max_norm``/``norm_type``, the optimizer
        and the policy), for a caller's own combine (``passes/rank_combine.py``'s ``GradAllReduce``).
        Example: ``reducer(params, group, scaler.rank_agreement(opt, "gradient sum", 1.0, 2.0))``.

        Args:
            optimizer: the optimizer the collective is about (a wrapper's inner one is used).
            kind: the name of the call, which every rank must make alike ("flags" by default).
            max_norm: the clip's ``max_norm`` (0.0 by default: no clip).
            norm_type: the clip's ``norm_type`` (0.0 by default: no clip).

        Returns:
            the ``Agreement`` to hand to the combine.
        """
        return self._agreement(unwrap_optimizer(optimizer), kind, max_norm, norm_type)

    # ------------------------------------------------------ checkpoints and copies
    def _host_state(self) -> HostState:
        """The scale and trackers as Python numbers (a host read once they live on the device); a
        rank mismatch flagged on the device raises here, at the read."""
        self._ranks.raise_if_flagged()
        return self._tensors.to_host() if self._tensors is not None else self._host

    @runs_eagerly
    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's five entries, plus this scaler's policy knobs and counters
        (``checkpoint_codec.py``); torch's scaler loads it too. Empty when disabled. A host read.
        Example: ``torch.save({"scaler": scaler.state_dict()}, path)``.

        Returns:
            a dict of Python numbers and the policy's knobs; ``{}`` when disabled.

        Raises:
            RankMismatchError: a mismatch across ranks was flagged on the device.
        """
        return to_state_dict(self._policy, self._host_state()) if self._enabled else {}

    @runs_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of torch.amp.GradScaler, validated before any change;
        knobs and counters a torch checkpoint lacks keep this scaler's. Example:
        ``scaler.load_state_dict(torch.load(path)["scaler"])``.

        Args:
            state_dict: the dict :meth:`state_dict` (or torch's) returned; ignored when disabled.

        Raises:
            ScalerConfigError: a state_dict that is not a dict, lacks torch's entries or holds
                invalid values.
            RuntimeError: an empty state_dict (one saved from a disabled scaler), as torch's.
        """
        if not self._enabled:
            return
        self._policy, self._host = from_state_dict(state_dict, self._policy)  # raises before any change
        self._norm_owner = NormHistoryOwner()  # the loaded history is no optimizer's yet
        if self._tensors is not None:
            self._tensors.load_(self._host)  # in place: the device tensors keep their addresses

    def snapshot(self) -> ScalerSnapshot:
        """The scale, its trackers and policy (a host read) and stats()'s last found_inf and norm:
        what ``abandon_iteration(optimizer, snapshot)`` puts back. Example: ``saved = scaler.snapshot()``.

        Returns:
            a ``ScalerSnapshot`` (its policy and host state None when disabled).
        """
        policy, host = (LossScalePolicy(**self._policy.knobs()), self._host_state()) if self._enabled else (None, None)
        return ScalerSnapshot(policy, host, self._last_found_inf, self._last_norm)

    def abandon_iteration(
        self, optimizer: torch.optim.Optimizer | None = None, snapshot: ScalerSnapshot | None = None
    ) -> None:
        """Forget what this iteration recorded for ``optimizer`` (every one when None); with a
        ``snapshot``, also undo the update()s since it was taken. The gradients stay as they are.
        Example: ``scaler.abandon_iteration(optimizer, scaler.snapshot())``.

        Args:
            optimizer: the optimizer whose record is forgotten; None (the default) for every one.
            snapshot: a :meth:`snapshot` to restore; None (the default) restores nothing.
        """
        if optimizer is None:
            self._per_optimizer_states = new_records()
        else:
            self._per_optimizer_states.pop(id(unwrap_optimizer(optimizer)), None)
        if snapshot is not None:
            if self._enabled and snapshot.host is not None:
                self._policy, self._host = LossScalePolicy(**snapshot.policy.knobs()), snapshot.host.copy()
                if self._tensors is not None:
                    self._tensors.load_(snapshot.host)
            self._last_found_inf, self._last_norm = snapshot.last_found_inf, snapshot.last_norm

    def __getstate__(self) -> dict[str, Any]:
        check_picklable(self._process_group, self._enabled and len(self._per_optimizer_states) != 0)
        state = self.__dict__.copy()  # device tensors do not travel: numbers, made anew at the next scale()
        if self._enabled:
            state["_host"], state["_tensors"] = self._host_state(), None
        state["_norm_owner"] = NormHistoryOwner()  # a copy's optimizers are others: its first clip claims
        return state

    # ----------------------------------------------------- torch.amp.GradScaler's names
    # With torch's meaning, for code that reaches past the public API: Lightning's and Accelerate's
    # checkpoint and clipping code read ``_scale``, ``_growth_tracker``, ``_init_scale``; fairseq-
    # and timm-style loops and ColossalAI/DeepSpeed-style subclasses call
    # ``_lazy_init_scale_growth_tracker``, ``_unscale_grads_``, ``_maybe_opt_step``; apex and
    # TransformerEngine optimizers that take ``step(grad_scaler=...)`` call ``_get_scale_async``,
    # ``_check_inf_per_device`` and ``_found_inf_per_device``. torch's knob accessors too.
    def is_enabled(self) -> bool:
        """Whether the scaler scales, as torch's ``is_enabled``.

        Returns:
            False when built with ``enabled=False`` or disabled for want of CUDA.
        """
        return self._enabled

    @runs_eagerly
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 when disabled.

        Returns:
            the scale, a float.

        Raises:
            RankMismatchError: a mismatch across ranks was flagged on the device.
        """
        if not self._enabled:
            return 1.0
        self._ranks.raise_if_flagged()
        return self._host.scale if self._tensors is None else float(self._tensors.scale.item())

    def get_growth_factor(self) -> float:
        """The policy's growth factor, as torch's ``get_growth_factor``.

        Returns:
            the factor, a float.
        """
        return self._policy.growth_factor

    @runs_eagerly
    def set_growth_factor(self, new_factor: float) -> None:
        """Set the policy's growth factor, as torch's ``set_growth_factor``.

        Args:
            new_factor: the new growth factor, > 1.0 and finite.

        Raises:
            ScalerConfigError: a factor not > 1.0 or not finite.
        """
        self._policy.growth_factor = check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        """The policy's backoff factor, as torch's ``get_backoff_factor``.

        Returns:
            the factor, a float.
        """
        return self._policy.backoff_factor

    @runs_eagerly
    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the policy's backoff factor, as torch's ``set_backoff_factor``.

        Args:
            new_factor: the new backoff factor, in (0, 1).

        Raises:
            ScalerConfigError: a factor outside (0, 1).
        """
        self._policy.backoff_factor = check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        """The policy's growth interval, as torch's ``get_growth_interval``.

        Returns:
            the number of steps without inf/NaN before the scale grows.
        """
        return self._policy.growth_interval

    @runs_eagerly
    def set_growth_interval(self, new_interval: int) -> None:
        """Set the policy's growth interval, as torch's ``set_growth_interval``.

        Args:
            new_interval: the new number of steps without inf/NaN before the scale grows, an int >= 1.

        Raises:
            ScalerConfigError: an interval that is not an int >= 1.
        """
        self._policy.growth_interval = check_growth_interval(new_interval)

    _growth_factor = property(get_growth_factor, set_growth_factor)
    _backoff_factor = property(get_backoff_factor, set_backoff_factor)
    _growth_interval = property(get_growth_interval, set_growth_interval)

    @property
    def _scale(self) -> torch.Tensor | None:
        """The scale tensor (None until the first scale())."""
        return self._tensors.scale if self._tensors is not None else None

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return self._tensors.growth_tracker if self._tensors is not None else None

    @property
    def _counters(self) -> torch.Tensor | None:  # ours, beside torch's trackers
        return self._tensors.counters if self._tensors is not None else None

    @property
    def _norm_stats(self) -> torch.Tensor | None:  # ours, beside torch's trackers
        return self._tensors.norm_stats if self._tensors is not None else None

    @property
    def _init_scale(self) -> float:
        """The scale the first scale() starts from (frameworks assign it too)."""
        return self._host.scale

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._host.scale = value

    @property
    def _init_growth_tracker(self) -> int:
        return self._host.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        self._host.growth_tracker = value

    @runs_eagerly
    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._tensors = self._host.to_device(device)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state_for(funcname)
        return state.scale, state.growth_tracker

    @runs_eagerly
    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._host.growth_tracker if self._tensors is None else int(self._tensors.growth_tracker.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor itself, no host read (None before the first scale())."""
        return self._scale

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(unwrap_optimizer(optimizer))]["found_inf_per_device"]

    @runs_eagerly
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """torch's helper: the gradients times ``inv_scale`` in place with torch's own fused op; a
        found_inf per device (copies of ``found_inf``) returned. Uses no field of the scaler."""
        grads = collect_grads(unwrap_optimizer(optimizer), allow_fp16=allow_fp16, by_dtype=False)
        inv_scales, found_infs = PerDevice(inv_scale), PerDevice(found_inf)
        for device, tensors in grads.other.items():
            torch_unscale_(tensors, found_infs.get(device), inv_scales.get(device))
        return {device: found_infs.get(device) for device in grads.other}

    @runs_eagerly
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless a recorded found_inf is set (a host read, as torch's)."""
        if not read_found_inf(optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None

    @runs_eagerly
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """step(grad_scaler=...)'s check, called by the optimizer inside :meth:`step`: the still
        scaled gradients checked, not written; the flag per device recorded and returned. With a
        process group, the collective of that step. The record is the one its step runs in (the
        optimizer passes itself, which may be the inner one: records are keyed by the real one)."""
        scale = self._state_for("_check_inf_per_device").scale
        inner = unwrap_optimizer(optimizer)
        record = self._record_for(inner)
        self._enter(inner, record)
        self._flags_pass(inner, record, scale, unscale=False)
        return record.found_inf_per_device


def note_direct_step(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` is about to run: its guard's call (``step_protocols.DirectStepGuard``),
    which this iteration's record of it decides (``OptimizerRecord.note_direct_step``: refused after
    a folded clip, else noted). Nothing recorded for it (a copy sharing its hooks, after update()):
    nothing to decide."""
    record = scaler._per_optimizer_states.get(id(optimizer))
    if record is not None and record.optimizer is optimizer:
        record.note_direct_step(optimizer)


def live_skip_counter(scaler: object) -> torch.Tensor | None:
    """The 0-dim int32 device counter ``scaler.last_skip_flag()`` is computed from (the last
    iteration skipped its step iff it is > 0), for a kernel of this package that reads it in its own
    launch (``SkipAwareLR.step``). Internal on purpose: it is a view of the scaler's state, rewritten
    in place by the next ``update()`` -- a caller's value is ``last_skip_flag()``. None for anything
    but a GradScaler of ours, and where the flag is not that counter alone (a disabled scaler, no
    state yet, a rank mismatch pending). Example: ``counter = live_skip_counter(scaler)``."""
    return scaler._live_skip_counter() if isinstance(scaler, GradScaler) else None
