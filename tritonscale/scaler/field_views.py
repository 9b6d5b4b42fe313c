"""The GradScaler names that are views of its fields: this scaler's read-outs and settings, and
torch.amp.GradScaler's knob accessors and private names. The class binds them by name, in two marked
sections; what controls a step stays in ``grad_scaler.py``.

Each view reads (and torch's setters write) only fields ``GradScaler.__init__`` sets
(``_enabled``, ``_backend_name``, ``_fold``, ``_process_group``, ``_policy``, ``_host``,
``_tensors``, ``_per_optimizer_states``, ``_last_found_inf``, ``_last_norm``, ``_disabled_skip``,
``_ranks``), or none, and calls no method of the scaler but its public ones. Example:
``scaler.found_inf_for(optimizer)`` reads the record this iteration's pass left, communicating
nothing (with a process group the pass already made the flags the group's).

torch's names, for the code that reaches past the public API:
Frameworks and fused optimizers reach past the public API: Lightning and Accelerate checkpoint and
clipping code read ``_scale``, ``_growth_tracker``, ``_init_scale``; fairseq- and timm-style loops
and ColossalAI/DeepSpeed-style scaler subclasses call ``_lazy_init_scale_growth_tracker``,
``_unscale_grads_``, ``_maybe_opt_step``; apex and TransformerEngine optimizers that take
``step(grad_scaler=...)`` call ``_get_scale_async`` and ``_found_inf_per_device``. torch's knob
accessors (``get/set_growth_factor``, ...), ``is_enabled`` and ``get_scale`` are here too.
"""

from __future__ import annotations

from typing import Any

import torch

from ..flags import read_found_inf
from ..grads.groups import collect_grads
from ..passes.grad_passes import PerDevice, torch_unscale_
from ..passes.step_protocols import StepProtocol, unwrap_optimizer
from ..policy.counters import LAST_SKIPPED
from ..policy.knob_checks import check_backoff_factor, check_growth_factor, check_growth_interval
from ..policy.loss_scale_policy import LossScalePolicy
from .compile_boundary import runs_eagerly
from .diagnostics import NO_STATS_WHEN_DISABLED, device_stats
from .optimizer_record import OptimizerRecord, OptState
from .scaler_args import missing_state_error

# ---------------------------------------------------------------- this scaler's read-outs


def _recorded(self: Any, optimizer: torch.optim.Optimizer) -> OptimizerRecord | None:
    """What this iteration recorded for ``optimizer`` (a wrapper's inner one); None if nothing."""
    return self._per_optimizer_states.get(id(unwrap_optimizer(optimizer)))


def optimizer_stage(self: Any, optimizer: torch.optim.Optimizer) -> OptState | None:
    """``optimizer``'s stage in this iteration (torch's ``OptState``); None when nothing was
    recorded for it since the last update(). Example: ``scaler.optimizer_stage(opt) is None``."""
    record = _recorded(self, optimizer)
    return record.stage if record is not None else None


def found_inf_for(self: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """This iteration's overflow flag for ``optimizer`` (0-dim float32 on the device, nonzero on
    inf/NaN; the process group's, with one); None before its first check. No host read.
    Example: ``flags.append(scaler.found_inf_for(opt))`` after clip_grad_norm_, to log later."""
    record = _recorded(self, optimizer)
    return record.summed_found_inf() if record is not None else None


def folded_grad_scale(self: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The divisor (``scale / clip_coef``) a clip folded into ``optimizer``'s fused step, until step()
    hands it over; else None. Example: ``p.grad / scaler.folded_grad_scale(opt)``: unscaled, clipped."""
    record = _recorded(self, optimizer)
    return record.grad_scale if record is not None and record.stage is OptState.UNSCALED else None


def overflowed(self: Any, optimizer: torch.optim.Optimizer) -> bool:
    """:meth:`found_inf_for` read on the host (one read); False before the first check.
    Example: ``if scaler.overflowed(opt): ...`` (its step() will skip)."""
    flag = found_inf_for(self, optimizer)
    return flag is not None and read_found_inf([flag])


def last_norm(self: Any) -> torch.Tensor | None:
    """The norm the last update() used (its iteration's last clip_grad_norm_), on the device;
    None if that iteration clipped nothing. Example: ``norm = scaler.last_norm()``."""
    return self._last_norm


def last_skip_flag(self: Any) -> torch.Tensor | None:
    """Whether the last completed iteration skipped its step: a 0-dim bool device tensor, no host
    read (False before the first; None before any state). Example: ``skipped = scaler.last_skip_flag()``."""
    if not self._enabled:  # skipped only when the clip_grad_norm_ before it found inf/NaN
        return self._disabled_skip > 0 if self._disabled_skip is not None else None
    return self._ranks.skip(self._tensors.counters[LAST_SKIPPED] > 0) if self._tensors is not None else None


@runs_eagerly
def last_step_skipped(self: Any) -> bool:
    """Whether the last completed iteration skipped its step (a host read; the device flag is
    ``last_skip_flag()``). Example: ``if not scaler.last_step_skipped(): scheduler.step()``."""
    skipped = last_skip_flag(self)
    if self._enabled:
        self._ranks.raise_if_flagged()
    return skipped is not None and bool(skipped.item())


@runs_eagerly
def stats(self: Any) -> dict[str, torch.Tensor]:
    """Per-step statistics as 0-dim device tensors, no host sync: ``scale``, ``growth_tracker``,
    ``norm`` (the last clip_grad_norm_'s, NaN if none), ``found_inf`` (the last update's flag),
    ``skipped`` (0/1), ``skipped_steps``, ``consecutive_skips``, ``hysteresis_left``. They are
    this step's values (device copies), safe to keep and read steps later. Example:
    ``writer.add_scalar("loss_scale", scaler.stats()["scale"], step)`` (the logger syncs; a
    logger that must not: ``tritonscale.StepLog``, docs/training-loop.md)."""
    if not self._enabled:
        raise RuntimeError(NO_STATS_WHEN_DISABLED)
    if self._tensors is None:
        raise missing_state_error("stats")
    state = self._tensors
    return device_stats(state.scale, state.growth_tracker, state.counters, self._last_found_inf, self._last_norm)


def folds_clip_into(self: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether :meth:`clip_grad_norm_` hands ``optimizer``'s fused step ``scale / clip_coef``
    (the gradients then stay scaled until :meth:`step`) rather than writing the gradients. A
    disabled scaler's clip is a plain clip: it writes them, and this is False.
    Example: ``if not scaler.folds_clip_into(opt): grads_are_unscaled_after_the_clip()``."""
    return self._enabled and StepProtocol.of(optimizer, unwrap_optimizer(optimizer)).clip_folds(self._fold)


def get_policy(self: Any) -> LossScalePolicy:
    """A copy of the loss-scale policy in use. Example: ``scaler.get_policy().skip_on_overflow``."""
    return LossScalePolicy(**self._policy.knobs())


BACKEND = property(lambda self: self._backend_name, doc='The requested backend: "auto", "triton" or "torch".')
FOLD_INTO_OPTIMIZER = property(
    lambda self: self._fold, doc="The constructor's: whether clip_grad_norm_ folds into a fused optimizer's step."
)
PROCESS_GROUP = property(
    lambda self: self._process_group,
    doc="The constructor's ``process_group`` (None: the gradients are not split across ranks).",
)

# ---------------------------------------------------------------- torch.amp.GradScaler's names


def _device_tensor(name: str) -> property:
    """One of the device-state tensors: None until the first scale()."""
    return property(lambda self: getattr(self._tensors, name) if self._tensors is not None else None)


def _initial(name: str) -> property:
    """torch's ``_init_*``: the value the first scale() starts from (frameworks assign it too)."""
    return property(lambda self: getattr(self._host, name), lambda self, value: setattr(self._host, name, value))


SCALE, GROWTH_TRACKER = _device_tensor("scale"), _device_tensor("growth_tracker")
COUNTERS, NORM_STATS = _device_tensor("counters"), _device_tensor("norm_stats")  # ours, beside torch's
INIT_SCALE, INIT_GROWTH_TRACKER = _initial("scale"), _initial("growth_tracker")


def is_enabled(self: Any) -> bool:
    return self._enabled


@runs_eagerly
def get_scale(self: Any) -> float:
    """The current scale as a Python float (a host sync), or 1.0 when disabled."""
    if not self._enabled:
        return 1.0
    self._ranks.raise_if_flagged()
    return self._host.scale if self._tensors is None else float(self._tensors.scale.item())


def get_growth_factor(self: Any) -> float:
    return self._policy.growth_factor


@runs_eagerly
def set_growth_factor(self: Any, new_factor: float) -> None:
    self._policy.growth_factor = check_growth_factor(new_factor)


def get_backoff_factor(self: Any) -> float:
    return self._policy.backoff_factor


@runs_eagerly
def set_backoff_factor(self: Any, new_factor: float) -> None:
    self._policy.backoff_factor = check_backoff_factor(new_factor)


def get_growth_interval(self: Any) -> int:
    return self._policy.growth_interval


@runs_eagerly
def set_growth_interval(self: Any, new_interval: int) -> None:
    self._policy.growth_interval = check_growth_interval(new_interval)


GROWTH_FACTOR = property(get_growth_factor, set_growth_factor)
BACKOFF_FACTOR = property(get_backoff_factor, set_backoff_factor)
GROWTH_INTERVAL = property(get_growth_interval, set_growth_interval)


@runs_eagerly
def lazy_init_scale_growth_tracker(self: Any, device: torch.device) -> None:
    self._tensors = self._host.to_device(device)


@runs_eagerly
def get_growth_tracker(self: Any) -> int:
    if not self._enabled:
        return 0
    return self._host.growth_tracker if self._tensors is None else int(self._tensors.growth_tracker.item())


def get_scale_async(self: Any) -> torch.Tensor | None:
    """The scale tensor itself, no host read (None before the first scale())."""
    return self._tensors.scale if self._tensors is not None else None


def found_inf_per_device(self: Any, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    return self._per_optimizer_states[id(unwrap_optimizer(optimizer))]["found_inf_per_device"]


@runs_eagerly
def unscale_grads_(
    self: Any, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> dict[torch.device, torch.Tensor]:
    """torch's helper: the gradients times ``inv_scale`` in place with torch's own fused op; a
    found_inf per device (copies of ``found_inf``) returned. Uses no field of the scaler."""
    grads = collect_grads(unwrap_optimizer(optimizer), allow_fp16=allow_fp16, kernels=False)
    inv_scales, found_infs = PerDevice(inv_scale), PerDevice(found_inf)
    for device, tensors in grads.other.items():
        torch_unscale_(tensors, found_infs.get(device), inv_scales.get(device))
    return {device: found_infs.get(device) for device in grads.other}


@runs_eagerly
def maybe_opt_step(self: Any, optimizer: torch.optim.Optimizer, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step()`` unless a recorded found_inf is set (a host read, as torch's)."""
    if not read_found_inf(optimizer_state["found_inf_per_device"].values()):
        return optimizer.step(*args, **kwargs)
    return None


def place_state(self: Any, device: torch.device | str) -> torch.device:
    """Make the scale and its trackers on ``device`` now, as the first scale() would (state
    already made stays where it is); return their device. Example: ``scaler.place_state("cuda")``."""
    return self._scale_on(torch.device(device)).device


def check_scale_growth_tracker(self: Any, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
    state = self._state_for(funcname)
    return state.scale, state.growth_tracker
