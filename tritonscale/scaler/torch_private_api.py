"""torch.amp.GradScaler's private members, with torch's meaning, for the code that reads them.

Frameworks and fused optimizers reach past the public API; the readers we know of:

* ``_scale``, ``_growth_tracker``, ``_enabled``, ``_per_optimizer_states[id(opt)]["stage"]`` /
  ``["found_inf_per_device"]`` (torch's own OptState values): Lightning and Accelerate checkpoint
  and clipping code, fairseq and timm-style loops that test for a skipped step;
* ``_growth_factor``, ``_backoff_factor``, ``_growth_interval``, ``_init_scale``,
  ``_init_growth_tracker``, ``_device``: checkpoint and logging code, scaler wrappers;
* ``_lazy_init_scale_growth_tracker``, ``_unscale_grads_``, ``_maybe_opt_step``: subclasses and
  re-implementations of ``unscale_``/``step`` (ColossalAI, DeepSpeed-style sharded scalers);
* ``_check_inf_per_device``, ``_found_inf_per_device``, ``_get_scale_async``: optimizers that take
  ``step(grad_scaler=...)`` (apex and TransformerEngine fused optimizers, torch's own tests).

Also here, as torch has them: ``get_scale``, ``is_enabled``, ``get/set_growth_factor``,
``get/set_backoff_factor``, ``get/set_growth_interval``; and ours beside them: the policy and the
constructor's settings read back, ``place_state``. The controller (grad_scaler.py) keeps the
stages and the passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..grads.grad_groups import collect_grads
from ..grads.optimizer_wrappers import unwrap_optimizer
from ..passes.grad_passes import PerDevice
from ..flags import read_found_inf
from ..passes.grad_passes import torch_unscale_
from ..passes.rank_checks import RankChecks
from ..policy.knob_checks import check_backoff_factor, check_growth_factor, check_growth_interval
from ..policy.loss_scale_policy import LossScalePolicy
from .compile_boundary import runs_eagerly
from .optimizer_record import OptimizerRecord
from .scaler_state import DeviceState, HostState


def _device_tensor(name: str) -> property:
    """torch's name for one of the device-state tensors: None until the first scale()."""
    return property(lambda self: getattr(self._tensors, name) if self._tensors is not None else None)


def _initial(name: str) -> property:
    """torch's ``_init_*``: the value the first scale() starts from (frameworks assign it too)."""
    return property(lambda self: getattr(self._host, name), lambda self, value: setattr(self._host, name, value))


def _knob(name: str) -> property:
    """torch's private name for a policy knob, read and set through the public accessors."""
    return property(lambda self: getattr(self._policy, name), lambda self, value: getattr(self, f"set_{name}")(value))


class TorchPrivateAPI:
    """Mixed into GradScaler: torch's knob accessors and private members. Nothing here is on the
    fused hot path.

    A layer over the GradScaler fields declared below (set in ``grad_scaler.py``'s ``__init__``):
    it reads and writes those and calls only the GradScaler methods declared with them;
    ``tests/scaler/test_controller_fields.py`` holds it to that."""

    _device: str
    _backend_name: str
    _fold: bool
    _process_group: Any
    _enabled: bool
    _policy: LossScalePolicy
    _host: HostState
    _tensors: DeviceState | None
    _per_optimizer_states: dict[int, OptimizerRecord]
    _ranks: RankChecks
    _state_for: Callable[[str], DeviceState]  # the device state a step needs, or torch's error
    _flags_pass: Callable[..., None]  # the inf/NaN check (or unscale), recorded for an optimizer

    # -------------------------------------------------------- state, as torch names it
    _scale = _device_tensor("scale")
    _growth_tracker = _device_tensor("growth_tracker")
    _counters = _device_tensor("counters")
    _norm_stats = _device_tensor("norm_stats")
    _init_scale = _initial("scale")
    _init_growth_tracker = _initial("growth_tracker")

    @runs_eagerly
    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._tensors = self._host.to_device(device)

    def place_state(self, device: torch.device | str) -> torch.device:
        """Make the scale and its trackers on ``device`` now, as the first scale() would (state
        already made stays where it is); return their device. Example: ``scaler.place_state("cuda")``."""
        if self._tensors is None:
            self._lazy_init_scale_growth_tracker(torch.device(device))
        return self._tensors.scale.device

    @runs_eagerly
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        self._ranks.raise_if_flagged()
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state_for(funcname)
        return state.scale, state.growth_tracker

    @runs_eagerly
    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._host.growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    # ------------------------------------------------ settings and knobs, public and private
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

    _growth_factor = _knob("growth_factor")
    _backoff_factor = _knob("backoff_factor")
    _growth_interval = _knob("growth_interval")

    # ------------------------------------------------ the step(grad_scaler=...) protocol
    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor itself, no host read (None before the first scale())."""
        return self._scale

    @runs_eagerly
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check the optimizer's (still scaled) gradients for inf/NaN without writing them; record
        and return the flag per device, as torch's does with its dummy unit-scale unscale."""
        scale = self._state_for("_check_inf_per_device").scale
        inner = unwrap_optimizer(optimizer)
        record = self._per_optimizer_states[id(inner)]
        self._flags_pass(inner, record, scale, unscale=False)  # the process group's, with one
        return record.found_inf_per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(unwrap_optimizer(optimizer))]["found_inf_per_device"]

    # ------------------------------------------------- pieces of unscale_ and step, as torch's
    @runs_eagerly
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply the gradients by ``inv_scale`` in place and return a found_inf per device (copies
        of ``found_inf``): torch's helper, run with torch's own fused op."""
        grads = collect_grads(unwrap_optimizer(optimizer), allow_fp16=allow_fp16, kernels=False)
        per_device_inv_scale, per_device_found_inf = PerDevice(inv_scale), PerDevice(found_inf)
        result = {}
        for device, tensors in grads.other.items():
            result[device] = per_device_found_inf.get(device)
            torch_unscale_(tensors, result[device], per_device_inv_scale.get(device))
        return result

    @runs_eagerly
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless a recorded found_inf is set (a host read, as torch's)."""
        if not read_found_inf(optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None
