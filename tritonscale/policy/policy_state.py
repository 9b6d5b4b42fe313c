"""The loss scale and the policy's trackers, in their two forms.

* ``HostState``: Python numbers. What a fresh scaler starts from, what ``state_dict()`` and a
  pickle hold, and what ``load_state_dict`` validates before anything changes.
* ``DeviceState``: the same four values as device tensors, made at the first ``scale()`` and from
  then on updated in place at fixed addresses (so a step can be captured in a CUDA graph). The
  policy's rule (``policy_runner.py``) updates them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .loss_scale_policy import LossScalePolicy
from .policy_counters import COUNTER_NAMES


@dataclass
class HostState:
    """The loss scale and the policy's trackers as Python numbers."""

    scale: float
    growth_tracker: int
    counters: list[int]  # COUNTER_NAMES order
    norm_stats: list[float]  # [average, count]

    @classmethod
    def initial(cls, scale: float, policy: LossScalePolicy) -> HostState:
        """Where a fresh scaler starts: a full hysteresis budget, the growth count at -growth_delay
        (DeepSpeed counts the start as an overflow), every other tracker at zero."""
        return cls(scale, -policy.growth_delay, [policy.hysteresis] + [0] * (len(COUNTER_NAMES) - 1), [0.0, 0.0])

    def copy(self) -> HostState:
        return HostState(self.scale, self.growth_tracker, list(self.counters), list(self.norm_stats))

    def to_device(self, device: torch.device) -> DeviceState:
        return DeviceState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), self.growth_tracker, dtype=torch.int32, device=device),
            counters=torch.tensor(self.counters, dtype=torch.int32, device=device),
            norm_stats=torch.tensor(self.norm_stats, dtype=torch.float32, device=device),
        )


@dataclass
class DeviceState:
    """The loss scale and the trackers on the device; only ever updated in place."""

    scale: torch.Tensor  # float32 0-dim
    growth_tracker: torch.Tensor  # int32 0-dim
    counters: torch.Tensor  # int32 [len(COUNTER_NAMES)]
    norm_stats: torch.Tensor  # float32 [2]

    def to_host(self) -> HostState:
        """Read every value back (a host sync)."""
        return HostState(
            scale=float(self.scale.item()),
            growth_tracker=int(self.growth_tracker.item()),
            counters=[int(v) for v in self.counters.tolist()],
            norm_stats=[float(v) for v in self.norm_stats.tolist()],
        )

    def load_(self, host: HostState) -> None:
        """Overwrite every value in place (the addresses stay)."""
        loaded = host.to_device(self.scale.device)
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(loaded, field.name))
