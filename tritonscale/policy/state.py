"""The loss scale and the policy's trackers, in their two forms.

* ``HostState``: Python numbers. What a fresh scaler starts from, what ``state_dict()`` and a
  pickle hold, and what ``load_state_dict`` validates before anything changes.
* ``DeviceState``: the same values as device tensors, made at the first ``scale()`` and from
  then on updated in place at fixed addresses (so a step can be captured in a CUDA graph). The
  policy's rule (``runner.py``) updates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from .counters import COUNTER_NAMES
from .loss_scale_policy import LossScalePolicy
from .spike_rules import spike_state_size


@dataclass
class HostState:
    """The loss scale and the policy's trackers as Python numbers."""

    scale: float
    growth_tracker: int
    counters: list[int]  # COUNTER_NAMES order
    norm_stats: list[float]  # [average, count]
    spike_stats: list[float] = field(default_factory=list)  # spike_rules.py's slots; [] without one

    @classmethod
    def initial(cls, scale: float, policy: LossScalePolicy) -> HostState:
        """Where a fresh scaler starts: a full hysteresis budget, the growth count at -growth_delay
        (DeepSpeed counts the start as an overflow), every other tracker at zero."""
        counters = [policy.hysteresis] + [0] * (len(COUNTER_NAMES) - 1)
        return cls(scale, -policy.growth_delay, counters, [0.0, 0.0], [0.0] * spike_state_size(policy))

    def copy(self) -> HostState:
        return HostState(
            self.scale, self.growth_tracker, list(self.counters), list(self.norm_stats), list(self.spike_stats)
        )

    def to_device(self, device: torch.device) -> DeviceState:
        return DeviceState(
            scale=torch.full((), self.scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), self.growth_tracker, dtype=torch.int32, device=device),
            counters=torch.tensor(self.counters, dtype=torch.int32, device=device),
            norm_stats=torch.tensor(self.norm_stats, dtype=torch.float32, device=device),
            spike_stats=torch.tensor(self.spike_stats, dtype=torch.float64, device=device),
        )


@dataclass
class DeviceState:
    """The loss scale and the trackers on the device; only ever updated in place."""

    scale: torch.Tensor  # float32 0-dim
    growth_tracker: torch.Tensor  # int32 0-dim
    counters: torch.Tensor  # int32 [len(COUNTER_NAMES)]
    norm_stats: torch.Tensor  # float32 [2]
    spike_stats: torch.Tensor  # float64 [spike_state_size(policy)]: the spike rules' window and average

    def to_host(self) -> HostState:
        """Read every value back (a host sync)."""
        return HostState(
            scale=float(self.scale.item()),
            growth_tracker=int(self.growth_tracker.item()),
            counters=[int(v) for v in self.counters.tolist()],
            norm_stats=[float(v) for v in self.norm_stats.tolist()],
            spike_stats=[float(v) for v in self.spike_stats.tolist()],
        )

    def load_(self, host: HostState) -> None:
        """Overwrite every value in place (the addresses stay; only a policy with another spike
        window or warm-up length resizes ``spike_stats``, which may move it)."""
        loaded = host.to_device(self.scale.device)
        for each in fields(self):
            tensor, value = getattr(self, each.name), getattr(loaded, each.name)
            if tensor.shape != value.shape:
                tensor.resize_(value.shape)
            tensor.copy_(value)
