"""GradScaler: a drop-in for torch.amp.GradScaler whose passes are the fused Triton kernels.

One class, as torch's is; its state the fields ``__init__`` sets. A step runs the passes
(``passes/``) on the optimizer's gradients (``grads/``), records each optimizer's stage
(``optimizer_record.py``) and hands the flags to the policy's rule (``policy/``). A collective
(with a process group) happens only on a line of ``unscale_``, ``clip_grad_norm_``, ``step`` or
``update`` that says so; nothing reads the host but get_scale()/state_dict() and step() for an
optimizer that cannot take found_inf. torch's private names are the last section of the class;
the checkpoint format is ``checkpoint_codec.py``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ..flags import read_flag, read_found_inf
from ..grads.grad_groups import Grads, collect_grads
from ..passes import step_protocols
from ..passes.backends import check_backend_name
from ..passes.clip_args import ClipRequest, check_max_norm, check_norm_type, kernels_compute
from ..passes.grad_passes import PerDevice, check_grads, clip_grads, torch_unscale_, unscale_grads_
from ..passes.rank_checks import Agreement, RankChecks
from ..passes.rank_combine import gradient_group
from ..passes.step_protocols import StepProtocol, unwrap_optimizer
from ..policy.knob_checks import check_backoff_factor, check_growth_factor, check_growth_interval
from ..policy.loss_scale_policy import LAST_SKIPPED, LossScalePolicy
from ..policy.policy_runner import PolicyRunner
from ..policy.policy_state import DeviceState, HostState
from ..process_groups import check_process_group
from .checkpoint_codec import ScalerSnapshot, from_state_dict, to_state_dict
from .compile_boundary import call_eagerly, clip_stays_eager, runs_eagerly, update_stays_eager
from .diagnostics import NO_STATS_WHEN_DISABLED, device_stats
from .optimizer_record import OptimizerRecord, OptState
from .scale_outputs import scale_outputs
from .scaler_args import TORCH_INIT_SCALE, checked_init_scale, cuda_missing, policy_from_torch_args, set_scale_
from .unscaled_step import clip_unscaled, step_unscaled

__all__ = ["GradScaler", "OptState"]


class GradScaler:
    """Dynamic loss scaling with a fused unscale / inf-check / clip pass and no host sync.

    Same constructor, methods and state_dict as ``torch.amp.GradScaler``; adds
    :meth:`clip_grad_norm_` and the keyword-only ``backend`` ("auto", "triton" or "torch").
    ``process_group``: the torch.distributed group across which each rank holds a part of the
    gradients (ZeRO-style partitions, pipeline stages); the norm and found_inf are then the
    group's, in one collective per step. DTensor (FSDP2) gradients bring their mesh's group;
    replicated gradients (DDP) need none.

    Example::

        scaler = tritonscale.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).square().mean()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # fused unscale + inf-check + clip
        scaler.step(optimizer)                                   # skipped on inf/NaN
        scaler.update()
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = TORCH_INIT_SCALE,
        growth_factor: float = LossScalePolicy.growth_factor,
        backoff_factor: float = LossScalePolicy.backoff_factor,
        growth_interval: int = LossScalePolicy.growth_interval,
        enabled: bool = True,
        *,
        backend: str = "auto",
        policy: LossScalePolicy | None = None,
        fold_into_optimizer: bool = True,
        compile_policy: bool | None = None,
        process_group: Any = None,
        **knobs: Any,
    ) -> None:
        # The constructor's settings.
        self._device = device
        self._backend_name = check_backend_name(backend)
        self._fold = bool(fold_into_optimizer)
        self._process_group = check_process_group(process_group)
        self._rules = PolicyRunner(compile_policy)
        self._enabled = False if cuda_missing(device, enabled) else enabled  # torch disables it then, too
        self._policy = policy_from_torch_args(policy, knobs, growth_factor, backoff_factor, growth_interval)
        # Like torch, a disabled scaler keeps its arguments unchecked.
        init_scale = checked_init_scale(init_scale, self._policy) if self._enabled else init_scale
        # The scale and the policy's trackers: Python numbers until the first scale(), then tensors.
        self._host = HostState.initial(init_scale, self._policy)
        self._tensors: DeviceState | None = None
        # This iteration, per optimizer (keyed by id, as torch's), and what the last one left.
        self._per_optimizer_states: dict[int, OptimizerRecord] = defaultdict(OptimizerRecord)
        self._last_found_inf: torch.Tensor | None = None
        self._last_norm: torch.Tensor | None = None
        self._disabled_skip: torch.Tensor | None = None  # a disabled scaler's last step() skip flag
        self._ranks = RankChecks()  # the call sequence and mismatches across ranks (rank_checks.py)

    # ------------------------------------------------------------------ scale
    @runs_eagerly
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or each tensor of a (nested) list/tuple/iterable, by the scale.
        Example: ``scaler.scale(loss).backward()``."""
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
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._tensors

    # ------------------------------------------------------- gradient passes
    def _group(self, grads: Grads, process_group: Any = None) -> Any:
        """The group the gradients are split across (None: this rank holds them whole)."""
        if process_group is None and self._process_group is None and grads.mesh is None:
            return None
        return gradient_group(process_group, self._process_group, grads.mesh_group)

    @runs_eagerly
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record inf/NaN on the device:
        one fused read+check+write pass per (device, dtype) group; no host sync. Example:
        ``scaler.unscale_(optimizer)`` after backward (the gradients now hold their true values)."""
        if not self._enabled:
            return
        optimizer = unwrap_optimizer(optimizer)
        scale = self._state_for("unscale_").scale
        record = self._per_optimizer_states[id(optimizer)].not_stepped("unscale_")
        if record.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        self._flags_pass(optimizer, record, scale, unscale=True)

    def _flags_pass(self, inner: Any, record: OptimizerRecord, scale: torch.Tensor, *, unscale: bool) -> None:
        """The flags pass of unscale_ (``unscale``: the fused unscale + check, float16 refused) or of
        a fused step (the read-only check of still-scaled gradients, sparse ones refused for torch's
        fused optimizers), recorded. With a process group, the collective: the flags made the
        group's, and ranks that disagree raise before a gradient is written."""
        sparse_ok = unscale or not step_protocols.is_torch_fused(inner)
        grads = collect_grads(inner, allow_fp16=not unscale, allow_sparse=sparse_ok)
        group, agreement, backend = self._group(grads), self._agreement(inner), self._backend_name
        if unscale:
            flags = unscale_grads_(grads, scale, backend, group, agreement, self._policy.skip_on_overflow)
            record.stage = OptState.UNSCALED
        else:
            flags = check_grads(grads, scale, backend, group, agreement)
        record.found_inf_per_device = flags

    def _agreement(
        self, optimizer: Any, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What this call's combine row says every rank agrees on (passes/rank_checks.py)."""
        scale = self._tensors.scale if self._enabled and self._tensors is not None else None
        return Agreement(self._ranks, scale, kind, optimizer, self._policy, max_norm, norm_type)

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0, *, process_group: Any = None
    ) -> torch.Tensor:
        """Unscale, inf-check and clip the optimizer's gradients by their global norm, fused.

        Returns the total norm of the unscaled gradients before clipping (0-dim float32 tensor on
        the gradients' device), equal to ``unscale_`` followed by ``torch.nn.utils.clip_grad_norm_``.
        It counts as this optimizer's ``unscale_`` for the iteration; called after ``unscale_`` it
        only clips. The gradients are read once, then read and written once; no host sync.
        ``process_group`` overrides the scaler's for this call: the norm returned on every rank is
        then that of all the group's gradients, bitwise the same on each rank.

        Example::

            scaler.scale(loss).backward()
            grad_norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0, norm_type=2.0)
            scaler.step(optimizer)
            scaler.update()
        """
        # In stage order: the arguments, the optimizer's record, the fold plan, the gradients, the
        # pass (with the rank combine), what a fused optimizer gets, and the record of the outcome.
        max_norm, norm_type = check_max_norm(max_norm), check_norm_type(norm_type)
        kernels = kernels_compute(norm_type)
        inner = unwrap_optimizer(optimizer)  # the state is the real optimizer's; the protocol the object's
        folds = StepProtocol.of(optimizer, inner).clip_folds(self._fold)  # hand a fused step scale / clip_coef
        if clip_stays_eager(process_group or self._process_group, inner):
            return call_eagerly(self.clip_grad_norm_, optimizer, max_norm, norm_type, process_group=process_group)
        if not self._enabled:  # a bf16 run: plain clipping, with the check the next step() skips on
            group_of = functools.partial(self._group, process_group=process_group)
            agreement = self._agreement(inner, "clip", max_norm, norm_type)
            norm, found_inf = clip_unscaled(inner, max_norm, norm_type, group_of, self._backend_name, agreement)
            self._per_optimizer_states[id(inner)].skip = self._ranks.skip(found_inf)  # forced on by a mismatch
            return norm
        scale = self._state_for("clip_grad_norm_").scale
        record = self._per_optimizer_states[id(inner)].not_stepped("clip_grad_norm_")
        pending = record.pending_factor(scale)
        sparse_ok = not (folds and step_protocols.is_torch_fused(inner))  # torch's fused steps: dense only
        grads = collect_grads(
            inner, allow_fp16=folds, kernels=kernels, allow_sparse=sparse_ok, split_replicas=True, takes_norm=True
        )
        has_grads = bool(grads.devices or grads.replicas)
        group = self._group(grads, process_group)
        # With a process group, the collective: one row per rank, ``agreement`` checked (rank_checks.py).
        device, result = clip_grads(
            grads,
            pending,
            ClipRequest(max_norm, norm_type, fold=folds, unscale_on_overflow=not self._policy.skip_on_overflow),
            backend=self._backend_name,
            group=group,
            agreement=self._agreement(inner, "clip", max_norm, norm_type),
        )
        folded = step_protocols.fold_clip(result.grad_scale, inner, self) if folds else None
        # Only now: a clip that raised leaves the record as it was.
        record.record_clip(device, result.found_inf, result.norm, has_grads or group is not None, folded)
        return result.norm

    # ------------------------------------------------------------------ step
    @runs_eagerly
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless already done this iteration) and step, skipping the step on inf/NaN.

        Optimizers that accept ``grad_scale``/``found_inf`` (torch's fused Adam, AdamW, SGD) get
        them as device tensors and skip on the device: no host sync. Others cost one host read of
        found_inf, as in torch. Closures are refused, as in torch. Example: ``scaler.step(optimizer)``.
        """
        inner = unwrap_optimizer(optimizer)  # the state is the real optimizer's; step() is the object's
        if not self._enabled:  # torch's plain step, unless the clip_grad_norm_ before it found inf/NaN
            record = self._per_optimizer_states.pop(id(inner), None)
            self._disabled_skip = record.skip if record is not None else None  # for last_step_skipped()
            self._ranks.next_iteration()  # a bf16 loop may never call update(): its step ends the iteration
            return step_unscaled(optimizer, inner, self._disabled_skip, self._ranks.read_skip, args, kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._state_for("step").scale
        record = self._per_optimizer_states[id(inner)]
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        protocol = StepProtocol.of(optimizer, inner)
        if protocol is StepProtocol.GRAD_SCALER_ARGUMENT:  # the optimizer asks this scaler itself
            retval = step_protocols.step_with_grad_scaler_argument(optimizer, self, args, kwargs)
        elif protocol is StepProtocol.AMP_ATTRIBUTES:
            if record.stage is OptState.READY:  # the optimizer divides by grad_scale itself: a check only
                self._flags_pass(inner, record, scale, unscale=False)  # with a group: the collective
            # No gradients: torch steps a fused optimizer all the same; update() then raises.
            skip = self._skip_flag(record, scale.device, required=False)
            still_scaled = record.stage is OptState.READY
            retval = step_protocols.step_fused(
                optimizer, inner, scale, still_scaled, record.grad_scale, skip, args, kwargs
            )
        else:
            if record.stage is OptState.READY:
                self._flags_pass(inner, record, scale, unscale=True)  # with a group: the collective
            skip = self._skip_flag(record, scale.device)
            # The one host read; where a rank mismatch is pending, reading the skip raises it.
            read_skip = read_flag if self._ranks.pending is None else self._ranks.read_skip
            retval = step_protocols.step_unless(optimizer, inner, skip, read_skip, args, kwargs, on_device=False)
        record.stage = OptState.STEPPED
        return retval

    def _skip_flag(self, record: OptimizerRecord, device: torch.device, required: bool = True) -> torch.Tensor:
        """Decide on the device whether this optimizer's step is skipped; remember it for update().
        ``required``: no inf check recorded (no gradients) is torch's error; otherwise it reads 0."""
        found_inf = record.found_inf_on(device, required)
        norm = record.norm.to(device, non_blocking=True) if record.norm is not None else None
        skip_decision = self._rules.rule(self._policy, "skip_decision", device)
        skip = skip_decision(found_inf, norm, self._tensors.norm_stats)  # a 0-dim flag
        record.skip = skip if self._ranks.pending is None else self._ranks.skip(skip)  # forced on by a mismatch
        return record.skip

    # ---------------------------------------------------------------- update
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, found_inf: bool | torch.Tensor | None = None
    ) -> None:
        """Back the scale off if any optimizer step this iteration saw inf/NaN, else maybe grow it.

        ``new_scale`` sets the scale instead. ``found_inf`` (a bool, or a 0-dim device tensor read
        with no host sync) is an overflow flag the caller found itself, added to what this
        iteration's passes recorded: code that checks its own gradients (a scale manager's
        ``update_loss_scale``) drives the policy with it. Runs on the device; no host sync. A
        compiled caller traces it when the iteration is local (``compile_boundary.update_stays_eager``).
        Example: ``scaler.update()`` after the iteration's step()s.
        """
        records = list(self._per_optimizer_states.values())
        if update_stays_eager(self._process_group, self._ranks, self._policy, new_scale):
            return call_eagerly(self.update, new_scale, found_inf=found_inf)
        if not self._enabled:
            self._per_optimizer_states = defaultdict(OptimizerRecord)
            return
        scale = self._state_for("update").scale
        if found_inf is not None:
            record = OptimizerRecord.from_flag(found_inf, scale.device)
            self._skip_flag(record, scale.device)
            records.append(record)
        outcome = OptimizerRecord.outcome(records)
        with self._ranks.unchanged_if_mismatched(self._tensors):
            if new_scale is not None:
                set_scale_(scale, new_scale)
                self._last_found_inf, self._last_norm = self._rules.count_only_(self._policy, self._tensors, outcome)
            else:
                self._last_found_inf, self._last_norm = self._rules.update_(self._policy, self._tensors, outcome)
        self._per_optimizer_states = defaultdict(OptimizerRecord)
        self._ranks.next_iteration(scale.device)

    # ------------------------------------------------------------ diagnostics
    @runs_eagerly
    def stats(self) -> dict[str, torch.Tensor]:
        """Per-step statistics as 0-dim device tensors, no host sync: ``scale``, ``growth_tracker``,
        ``norm`` (the last clip_grad_norm_'s, NaN if none), ``found_inf`` (the last update's flag),
        ``skipped`` (0/1), ``skipped_steps``, ``consecutive_skips``, ``hysteresis_left``. They are
        this step's values (device copies), safe to keep and read steps later. Example:
        ``writer.add_scalar("loss_scale", scaler.stats()["scale"], step)`` (the logger syncs)."""
        if not self._enabled:
            raise RuntimeError(NO_STATS_WHEN_DISABLED)
        state = self._state_for("stats")
        return device_stats(state.scale, state.growth_tracker, state.counters, self._last_found_inf, self._last_norm)

    @runs_eagerly
    def last_step_skipped(self) -> bool:
        """Whether the last completed iteration skipped its step (a host read; the device flag is
        ``last_skip_flag()``). Example: ``if not scaler.last_step_skipped(): scheduler.step()``."""
        skipped = self.last_skip_flag()
        if self._enabled:
            self._ranks.raise_if_flagged()
        return skipped is not None and bool(skipped.item())

    # ------------------------------------------- this iteration, for adapters
    def _recorded(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord | None:
        """What this iteration recorded for ``optimizer`` (a wrapper's inner one); None if nothing."""
        return self._per_optimizer_states.get(id(unwrap_optimizer(optimizer)))

    def optimizer_stage(self, optimizer: torch.optim.Optimizer) -> OptState | None:
        """``optimizer``'s stage in this iteration (torch's ``OptState``); None when nothing was
        recorded for it since the last update(). Example: ``scaler.optimizer_stage(opt) is None``."""
        record = self._recorded(optimizer)
        return record.stage if record is not None else None

    def found_inf_for(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """This iteration's overflow flag for ``optimizer`` (0-dim float32 on the device, nonzero on
        inf/NaN; the process group's, with one); None before its first check. No host read.
        Example: ``flags.append(scaler.found_inf_for(opt))`` after clip_grad_norm_, to log later."""
        record = self._recorded(optimizer)
        return record.summed_found_inf() if record is not None else None

    def folded_grad_scale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The divisor (``scale / clip_coef``) a clip folded into ``optimizer``'s fused step, until step()
        hands it over; else None. Example: ``p.grad / scaler.folded_grad_scale(opt)``: unscaled, clipped."""
        record = self._recorded(optimizer)
        return record.grad_scale if record is not None and record.stage is OptState.UNSCALED else None

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`found_inf_for` read on the host (one read); False before the first check.
        Example: ``if scaler.overflowed(opt): ...`` (its step() will skip)."""
        flag = self.found_inf_for(optimizer)
        return flag is not None and read_found_inf([flag])

    def last_norm(self) -> torch.Tensor | None:
        """The norm the last update() used (its iteration's last clip_grad_norm_), on the device;
        None if that iteration clipped nothing. Example: ``norm = scaler.last_norm()``."""
        return self._last_norm

    def last_skip_flag(self) -> torch.Tensor | None:
        """Whether the last completed iteration skipped its step: a 0-dim bool device tensor, no host
        read (False before the first; None before any state). Example: ``skipped = scaler.last_skip_flag()``."""
        if not self._enabled:  # skipped only when the clip_grad_norm_ before it found inf/NaN
            return self._disabled_skip > 0 if self._disabled_skip is not None else None
        return self._ranks.skip(self._tensors.counters[LAST_SKIPPED] > 0) if self._tensors is not None else None

    def folds_clip_into(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`clip_grad_norm_` hands ``optimizer``'s fused step ``scale / clip_coef``
        (the gradients then stay scaled until :meth:`step`) rather than writing the gradients.
        Example: ``if not scaler.folds_clip_into(opt): grads_are_unscaled_after_the_clip()``."""
        return StepProtocol.of(optimizer, unwrap_optimizer(optimizer)).clip_folds(self._fold)

    def rank_agreement(
        self, optimizer: torch.optim.Optimizer, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What every rank must agree on for a collective about ``optimizer`` (this scaler's scale
        and call sequence, the call ``kind``, the clip's ``max_norm``/``norm_type``, the optimizer
        and the policy), for a caller's own combine (``passes/rank_combine.py``'s ``GradAllReduce``).
        Example: ``reducer(params, group, scaler.rank_agreement(opt, "gradient sum", 1.0, 2.0))``."""
        return self._agreement(unwrap_optimizer(optimizer), kind, max_norm, norm_type)

    # -------------------------------------------------------- knobs and state
    def _host_state(self) -> HostState:
        """The scale and trackers as Python numbers (a host read once they live on the device); a
        rank mismatch flagged on the device raises here, at the read."""
        self._ranks.raise_if_flagged()
        return self._tensors.to_host() if self._tensors is not None else self._host

    # ------------------------------------------------------ checkpoints and copies
    @runs_eagerly
    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's five entries, plus this scaler's policy knobs and counters
        (``checkpoint_codec.py``); torch's scaler loads it too. Empty when disabled. A host read.
        Example: ``torch.save({"scaler": scaler.state_dict()}, path)``."""
        return to_state_dict(self._policy, self._host_state()) if self._enabled else {}

    @runs_eagerly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of torch.amp.GradScaler, validated before any change;
        knobs and counters a torch checkpoint lacks keep this scaler's. Example:
        ``scaler.load_state_dict(torch.load(path)["scaler"])``."""
        if not self._enabled:
            return
        self._policy, self._host = from_state_dict(state_dict, self._policy)  # raises before any change
        if self._tensors is not None:
            self._tensors.load_(self._host)  # in place: the device tensors keep their addresses

    def snapshot(self) -> ScalerSnapshot:
        """The scale, its trackers and policy (a host read) and stats()'s last found_inf and norm:
        what ``abandon_iteration(optimizer, snapshot)`` puts back. Example: ``saved = scaler.snapshot()``."""
        policy, host = (LossScalePolicy(**self._policy.knobs()), self._host_state()) if self._enabled else (None, None)
        return ScalerSnapshot(policy, host, self._last_found_inf, self._last_norm)

    def abandon_iteration(
        self, optimizer: torch.optim.Optimizer | None = None, snapshot: ScalerSnapshot | None = None
    ) -> None:
        """Forget what this iteration recorded for ``optimizer`` (every optimizer when None), as if
        it had not begun; with a ``snapshot``, also undo the update()s since it was taken. The
        gradients stay as the passes left them. Example::

            snapshot = scaler.snapshot()  # then an update() (e.g. a backoff) and an error
            scaler.abandon_iteration(optimizer, snapshot)  # the scaler as at the snapshot
        """
        if optimizer is None:
            self._per_optimizer_states = defaultdict(OptimizerRecord)
        else:
            self._per_optimizer_states.pop(id(unwrap_optimizer(optimizer)), None)
        if snapshot is not None:
            if self._enabled and snapshot.host is not None:
                self._policy, self._host = LossScalePolicy(**snapshot.policy.knobs()), snapshot.host.copy()
                if self._tensors is not None:
                    self._tensors.load_(snapshot.host)
            self._last_found_inf, self._last_norm = snapshot.last_found_inf, snapshot.last_norm

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors do not travel: the values go as Python numbers, made anew at the next scale().
        if self._process_group is not None:
            raise TypeError(
                "a GradScaler with a process_group cannot be pickled (process groups do not travel); "
                "save state_dict() and load it into a scaler made with the group"
            )
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_host"], state["_tensors"] = self._host_state(), None
        return state

    # ---------------------------------------------------------------- settings
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def backend(self) -> str:
        """The requested backend: "auto", "triton" or "torch"."""
        return self._backend_name

    @property
    def fold_into_optimizer(self) -> bool:
        """The constructor's: whether clip_grad_norm_ folds into a fused optimizer's step."""
        return self._fold

    @property
    def process_group(self) -> Any:
        """The constructor's ``process_group`` (None: the gradients are not split across ranks)."""
        return self._process_group

    def get_policy(self) -> LossScalePolicy:
        """A copy of the loss-scale policy in use. Example: ``scaler.get_policy().skip_on_overflow``."""
        return LossScalePolicy(**self._policy.knobs())

    def place_state(self, device: torch.device | str) -> torch.device:
        """Make the scale and its trackers on ``device`` now, as the first scale() would (state
        already made stays where it is); return their device. Example: ``scaler.place_state("cuda")``."""
        return self._scale_on(torch.device(device)).device

    @runs_eagerly
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        self._ranks.raise_if_flagged()
        return self._host.scale if self._tensors is None else float(self._tensors.scale.item())

    def get_growth_factor(self) -> float:
        return self._policy.growth_factor

    @runs_eagerly
    def set_growth_factor(self, new_factor: float) -> None:
        self._policy.growth_factor = check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._policy.backoff_factor

    @runs_eagerly
    def set_backoff_factor(self, new_factor: float) -> None:
        self._policy.backoff_factor = check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._policy.growth_interval

    @runs_eagerly
    def set_growth_interval(self, new_interval: int) -> None:
        self._policy.growth_interval = check_growth_interval(new_interval)

    # ------------------------------------------- torch.amp.GradScaler's private names
    # With torch's meaning, for the code that reaches past the public API (docs/controller.md
    # names the readers: Lightning, Accelerate, fairseq, timm, ColossalAI, DeepSpeed-style scalers,
    # apex and TransformerEngine optimizers, torch's own tests). Each is a view of the fields above.
    _scale = property(lambda self: self._tensors.scale if self._tensors is not None else None)
    _growth_tracker = property(lambda self: self._tensors.growth_tracker if self._tensors is not None else None)
    _counters = property(lambda self: self._tensors.counters if self._tensors is not None else None)  # ours
    _norm_stats = property(lambda self: self._tensors.norm_stats if self._tensors is not None else None)  # ours
    _init_scale = property(lambda self: self._host.scale, lambda self, value: setattr(self._host, "scale", value))
    _init_growth_tracker = property(
        lambda self: self._host.growth_tracker, lambda self, value: setattr(self._host, "growth_tracker", value)
    )
    _growth_factor = property(get_growth_factor, set_growth_factor)
    _backoff_factor = property(get_backoff_factor, set_backoff_factor)
    _growth_interval = property(get_growth_interval, set_growth_interval)

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

    @runs_eagerly
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """step(grad_scaler=...)'s check, called by the optimizer inside :meth:`step`: the still
        scaled gradients checked, not written; the flag per device recorded and returned. With a
        process group, the collective of that step."""
        scale = self._state_for("_check_inf_per_device").scale
        inner = unwrap_optimizer(optimizer)
        record = self._per_optimizer_states[id(inner)]
        self._flags_pass(inner, record, scale, unscale=False)
        return record.found_inf_per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(unwrap_optimizer(optimizer))]["found_inf_per_device"]

    @runs_eagerly
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """torch's helper: the gradients times ``inv_scale`` in place with torch's own fused op; a
        found_inf per device (copies of ``found_inf``) returned."""
        grads = collect_grads(unwrap_optimizer(optimizer), allow_fp16=allow_fp16, kernels=False)
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
