"""What one iteration records per optimizer: its stage and the device flags the passes left.

Per iteration and optimizer the stages are READY -> UNSCALED (``unscale_`` or ``clip_grad_norm_``)
-> STEPPED, and ``update()`` starts the next iteration, as in torch.amp.GradScaler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# torch's own enum, not a copy: frameworks test ``record["stage"] is OptState.UNSCALED`` with the
# OptState they import from torch, and that must hold for our records too.
from torch.amp.grad_scaler import OptState

from ..flags import flags_on, summed_flag
from ..policy.runner import IterationOutcome


@dataclass
class OptimizerRecord:
    """One optimizer's bookkeeping for the current iteration (all tensors stay on the device).

    Frameworks and fused optimizers read (and some write) torch's
    ``scaler._per_optimizer_states[id(optimizer)]["stage"]`` and ``["found_inf_per_device"]``, so
    those two fields also work by key, as in torch's dict.
    """

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

    _TORCH_KEYS = ("stage", "found_inf_per_device")

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
    def outcome(records: list[OptimizerRecord]) -> IterationOutcome:
        """What ``records`` (the iteration's, in order) hand the policy's rule."""
        return IterationOutcome(
            [t for r in records for t in r.found_inf_per_device.values()],
            [r.skip for r in records if r.skip is not None],
            [r.norm for r in records if r.norm is not None],
        )

    def not_stepped(self, funcname: str) -> OptimizerRecord:
        """This record, for an unscale_/clip_grad_norm_: torch's error after this iteration's step()."""
        if self.stage is OptState.STEPPED:
            raise RuntimeError(f"{funcname}() is being called after step().")
        return self

    def add_flag(self, device: torch.device, found_inf: torch.Tensor) -> None:
        """Raise the flag of ``device`` with ``found_inf`` (a pass's, already the group's)."""
        found = self.found_inf_per_device
        found[device] = torch.maximum(found[device], found_inf) if device in found else found_inf

    def found_inf_on(self, device: torch.device, required: bool = True) -> torch.Tensor:
        """The flags as one 0-dim flag on ``device``. None recorded (no gradients): torch's error if
        ``required``, else 0."""
        found_inf = flags_on(device, self.found_inf_per_device.values())
        if found_inf is None:
            if required:
                raise AssertionError("No inf checks were recorded for this optimizer.")
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        return found_inf

    def summed_found_inf(self) -> torch.Tensor | None:
        """The flags summed into one 0-dim flag on the first one's device; None before the first
        check. Reads and communicates nothing."""
        return summed_flag(self.found_inf_per_device.values())

    def pending_factor(self, scale: torch.Tensor) -> torch.Tensor:
        """What the gradients still have to be divided by: the scale before any pass, 1 after
        unscale_ or an applied clip, or what an earlier clip folded in (so a second clip sees true
        values)."""
        pending = scale if self.stage is OptState.READY else self.grad_scale
        return pending if pending is not None else torch.ones_like(scale)

    def record_clip(
        self,
        device: torch.device,
        found_inf: torch.Tensor,
        norm: torch.Tensor,
        checked: bool,
        folded_grad_scale: torch.Tensor | None,
    ) -> None:
        """A clip's outcome: its flag (when the clip ``checked`` anything: no gradients, no inf
        check, and torch's step() then raises, as after unscale_; an empty partition of a process
        group does check, with the group's flag), its norm, the stage UNSCALED, and what a fused
        optimizer divides by when the clip folded into its step (None: the clip applied itself)."""
        if folded_grad_scale is not None:
            self.grad_scale = folded_grad_scale
        if checked:
            self.add_flag(device, found_inf)
        self.norm = norm
        self.stage = OptState.UNSCALED

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
