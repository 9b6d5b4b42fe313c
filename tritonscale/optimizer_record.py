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


@dataclass
class OptimizerRecord:
    """One optimizer's bookkeeping for the current iteration (all tensors stay on the device).

    Frameworks and fused optimizers read (and some write) torch's
    ``scaler._per_optimizer_states[id(optimizer)]["stage"]`` and ``["found_inf_per_device"]``, so
    those two fields also work by key, as in torch's dict.
    """

    stage: OptState = OptState.READY
    #: inf/NaN flags per gradient device: they drive the policy's backoff.
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    #: The step's skip flag on the scale's device: an overflow (unless the policy lets it
    #: through) or a norm spike.
    skip: torch.Tensor | None = None
    #: The unscaled total norm, when clip_grad_norm_ ran.
    norm: torch.Tensor | None = None
    #: What clip_grad_norm_ folded into a fused optimizer's step: scale / clip_coef.
    grad_scale: torch.Tensor | None = None

    _TORCH_KEYS = ("stage", "found_inf_per_device")

    def __getitem__(self, key: str) -> Any:
        if key not in self._TORCH_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._TORCH_KEYS:
            raise KeyError(key)
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in self._TORCH_KEYS


def combine_flags(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """Sum of 0-dim flags on one device (the way torch combines found_inf), None for none."""
    if not flags:
        return None
    return flags[0].reshape(()) if len(flags) == 1 else torch.stack([f.reshape(()) for f in flags]).sum()
