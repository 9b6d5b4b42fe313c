"""GradScaler: a drop-in for torch.amp.GradScaler whose passes are the fused Triton kernels.

One class, as torch's is, its state the fields ``__init__`` sets: a step runs the passes (``passes/``)
on the gradients (``grads/``), records each optimizer's stage and hands the flags to the policy's
rule (``policy/``). A collective happens only on a line of unscale_/clip_grad_norm_/step/update
that says so. Views of the fields (read-outs, settings, torch's private names): ``field_views.py``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ..flags import moved_to, read_flag
from ..grads.groups import Grads, collect_grads
from ..passes import step_protocols
from ..passes.backends import check_backend_name
from ..passes.clip_args import ClipRequest, check_clip_args, kernels_compute
from ..passes.grad_passes import check_grads, clip_grads, unscale_grads_
from ..passes.rank_checks import NOTHING_TO_UNDO, Agreement, RankChecks
from ..passes.rank_combine import gradient_group
from ..passes.step_protocols import StepProtocol, unwrap_optimizer
from ..policy.loss_scale_policy import LossScalePolicy
from ..policy.peer_presets import PeerPreset
from ..policy.runner import PolicyRunner
from ..policy.state import DeviceState, HostState
from ..process_groups import check_process_group
from . import field_views as views
from .checkpoint_codec import ScalerSnapshot, check_picklable, from_state_dict, to_state_dict
from .compile_boundary import call_eagerly, clip_stays_eager, runs_eagerly, update_stays_eager
from .norm_history import NormHistoryOwner
from .optimizer_record import OptimizerRecord, OptState
from .scale_outputs import scale_outputs
from .scaler_args import (
    TORCH_INIT_SCALE,
    check_disabled_policy,
    checked_init_scale,
    cuda_missing,
    missing_state_error,
    peer_policy,
    policy_from_torch_args,
    set_scale_,
)
from .unscaled_step import clip_unscaled, step_unscaled

__all__ = ["GradScaler", "OptState"]


class GradScaler:
    """Dynamic loss scaling with a fused unscale / inf-check / clip pass and no host sync.

    torch's constructor, methods and state_dict, plus ``policy=`` (a ``LossScalePolicy``, or a peer's
    preset with its initial scale: ``presets.deepspeed(...)``, "megatron"), :meth:`clip_grad_norm_` and ``backend``
    ("auto", "triton", "torch"). ``process_group``: the group across which ranks hold parts of the
    gradients (ZeRO, pipeline stages; DTensors bring their mesh's, DDP replicas need none).

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
        policy: LossScalePolicy | PeerPreset | str | None = None,
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
        policy, init_scale = peer_policy(policy, init_scale)  # a peer's preset brings its initial scale
        self._policy = policy_from_torch_args(policy, knobs, growth_factor, backoff_factor, growth_interval)
        if not enabled:  # the norm rules would be ignored: refused (torch's knobs: kept unchecked, as torch's)
            check_disabled_policy(self._policy)
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
        self._norm_owner = NormHistoryOwner()  # the one optimizer whose clip norms the policy's history takes

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
            raise missing_state_error(funcname)
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
        """unscale_'s pass (``unscale``) or a fused step's read-only check, recorded. With a process
        group, the collective: the group's flags; ranks that disagree raise before any write."""
        sparse_ok = unscale or not step_protocols.is_torch_fused(inner)
        grads = collect_grads(inner, allow_fp16=not unscale, allow_sparse=sparse_ok)
        group, backend = self._group(grads), self._backend_name
        agreement = None if group is None else self._agreement(inner)  # a single process: no rank code
        if unscale:
            flags = unscale_grads_(grads, scale, backend, group, agreement, self._policy.skip_on_overflow)
            record.stage = OptState.UNSCALED
        else:
            flags = check_grads(grads, scale, backend, group, agreement)
        record.found_inf_per_device = flags

    def _agreement(
        self, optimizer: Any, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What this call's combine row says every rank agrees on (passes/rank_checks.py), the
        device state included: its trackers are hashed on the device."""
        state = self._tensors if self._enabled else None
        scale = state.scale if state is not None else None
        return Agreement(self._ranks, scale, kind, optimizer, self._policy, max_norm, norm_type, state=state)

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
        ``error_if_nonfinite=True`` is refused (inf/NaN: step() skips). ``scaler.clip_grad_norm_(opt, 1.0)``."""
        max_norm, norm_type = check_clip_args(max_norm, norm_type, error_if_nonfinite, foreach)
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
        self._norm_owner.check(self._policy, inner)  # before anything changes (the record too)
        scale = self._state_for("clip_grad_norm_").scale
        record = self._per_optimizer_states[id(inner)].not_stepped("clip_grad_norm_")
        pending, limit_of = record.pending_factor(scale), self._rules.clip_limit(self._policy, self._tensors, max_norm)
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
            ClipRequest(max_norm, norm_type, folds, not self._policy.skip_on_overflow, limit_of=limit_of),
            backend=self._backend_name,
            group=group,
            agreement=None if group is None else self._agreement(inner, "clip", max_norm, norm_type),
        )
        folded = step_protocols.fold_clip(result.grad_scale, inner, self) if folds else None
        # Only now: a clip that raised leaves the record as it was.
        record.record_clip(device, result.found_inf, result.norm, has_grads or group is not None, folded)
        self._norm_owner.claim(self._policy, inner)
        return result.norm

    # ------------------------------------------------------------------ step
    @runs_eagerly
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done this iteration) and step, skipped on inf/NaN: on the device for
        optimizers that take ``grad_scale``/``found_inf`` (torch's fused ones), else after one host
        read, as torch's. Closures are refused, as in torch. Example: ``scaler.step(optimizer)``."""
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
        norm = moved_to(record.norm, device) if record.norm is not None else None
        skip_decision = self._rules.rule(self._policy, "skip_decision", device)
        skip = skip_decision(found_inf, norm, self._tensors.norm_stats, spike_stats=self._tensors.spike_stats)
        record.skip = skip if self._ranks.pending is None else self._ranks.skip(skip)  # forced on by a mismatch
        return record.skip

    # ---------------------------------------------------------------- update
    def update(
        self, new_scale: float | torch.Tensor | None = None, *, found_inf: bool | torch.Tensor | None = None
    ) -> None:
        """Back the scale off if a step this iteration saw inf/NaN, else maybe grow it, on the device.
        ``new_scale`` sets the scale instead; ``found_inf`` (a bool or a 0-dim device tensor) adds an
        overflow the caller found itself (a scale manager's). Example: ``scaler.update()``."""
        if update_stays_eager(self._process_group, self._ranks, self._policy, new_scale):
            return call_eagerly(self.update, new_scale, found_inf=found_inf)
        if not self._enabled:
            self._per_optimizer_states = defaultdict(OptimizerRecord)
            return
        scale = self._state_for("update").scale
        records = list(self._per_optimizer_states.values())
        if found_inf is not None:
            record = OptimizerRecord.from_flag(found_inf, scale.device)
            self._skip_flag(record, scale.device)
            records.append(record)
        outcome = OptimizerRecord.outcome(records)
        with NOTHING_TO_UNDO if self._ranks.pending is None else self._ranks.unchanged_if_mismatched(self._tensors):
            if new_scale is not None:
                set_scale_(scale, new_scale)
                self._last_found_inf, self._last_norm = self._rules.count_only_(self._policy, self._tensors, outcome)
            else:
                self._last_found_inf, self._last_norm = self._rules.update_(self._policy, self._tensors, outcome)
        self._per_optimizer_states = defaultdict(OptimizerRecord)
        self._ranks.next_iteration(scale.device)

    # ------------------------------------ read-outs and settings (scaler/field_views.py)
    # Views of the fields above; none communicates, none changes state.
    stats, last_step_skipped, last_skip_flag = views.stats, views.last_step_skipped, views.last_skip_flag
    optimizer_stage, found_inf_for, overflowed = views.optimizer_stage, views.found_inf_for, views.overflowed
    folded_grad_scale, last_norm, folds_clip_into = views.folded_grad_scale, views.last_norm, views.folds_clip_into
    backend, fold_into_optimizer, process_group = views.BACKEND, views.FOLD_INTO_OPTIMIZER, views.PROCESS_GROUP
    get_policy, get_scale = views.get_policy, views.get_scale

    # ------------------------------------------------ a rank agreement, for adapters
    def rank_agreement(
        self, optimizer: torch.optim.Optimizer, kind: str = "flags", max_norm: float = 0.0, norm_type: float = 0.0
    ) -> Agreement:
        """What every rank must agree on for a collective about ``optimizer`` (this scaler's scale
        and call sequence, the call ``kind``, the clip's ``max_norm``/``norm_type``, the optimizer
        and the policy), for a caller's own combine (``passes/rank_combine.py``'s ``GradAllReduce``).
        Example: ``reducer(params, group, scaler.rank_agreement(opt, "gradient sum", 1.0, 2.0))``."""
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
        self._norm_owner = NormHistoryOwner()  # the loaded history is no optimizer's yet
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
        """Forget what this iteration recorded for ``optimizer`` (every one when None); with a
        ``snapshot``, also undo the update()s since it was taken. The gradients stay as they are.
        Example: ``scaler.abandon_iteration(optimizer, scaler.snapshot())``."""
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
        check_picklable(self._process_group, self._enabled and len(self._per_optimizer_states) != 0)
        state = self.__dict__.copy()  # device tensors do not travel: numbers, made anew at the next scale()
        if self._enabled:
            state["_host"], state["_tensors"] = self._host_state(), None
        state["_norm_owner"] = NormHistoryOwner()  # a copy's optimizers are others: its first clip claims
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A scaler pickled before the norm history had an owner: unowned, as any copy starts.
        self.__dict__.update(state)
        self.__dict__.setdefault("_norm_owner", NormHistoryOwner())

    # -------------------------------------- torch.amp.GradScaler's names (scaler/field_views.py)
    # With torch's meaning, for code outside this package; views of the fields above.
    is_enabled = views.is_enabled
    get_growth_factor, set_growth_factor = views.get_growth_factor, views.set_growth_factor
    get_backoff_factor, set_backoff_factor = views.get_backoff_factor, views.set_backoff_factor
    get_growth_interval, set_growth_interval = views.get_growth_interval, views.set_growth_interval
    _scale, _growth_tracker, _counters, _norm_stats = (
        views.SCALE, views.GROWTH_TRACKER, views.COUNTERS, views.NORM_STATS
    )  # fmt: skip
    _init_scale, _init_growth_tracker = views.INIT_SCALE, views.INIT_GROWTH_TRACKER
    _growth_factor, _backoff_factor = views.GROWTH_FACTOR, views.BACKOFF_FACTOR
    _growth_interval = views.GROWTH_INTERVAL
    _lazy_init_scale_growth_tracker = views.lazy_init_scale_growth_tracker
    _get_growth_tracker, _get_scale_async = views.get_growth_tracker, views.get_scale_async
    _found_inf_per_device, _unscale_grads_ = views.found_inf_per_device, views.unscale_grads_
    _maybe_opt_step, _check_scale_growth_tracker = views.maybe_opt_step, views.check_scale_growth_tracker
    place_state = views.place_state

    @runs_eagerly
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """step(grad_scaler=...)'s check, called by the optimizer inside :meth:`step`: the still
        scaled gradients checked, not written; the flag per device recorded and returned. With a
        process group, the collective of that step."""
        scale, inner = self._state_for("_check_inf_per_device").scale, unwrap_optimizer(optimizer)
        record = self._per_optimizer_states[id(inner)]
        self._flags_pass(inner, record, scale, unscale=False)
        return record.found_inf_per_device
