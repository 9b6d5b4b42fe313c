"""Copies of one device tensor (the scale, a flag) for each device that asks, made once each.

A pass over gradients on several devices needs the scale (or a found_inf flag) on each of them;
the copies are made on demand, non-blocking, and reused within the pass.
"""

from __future__ import annotations

import torch


class PerDevice:
    """Copies of one device tensor (the scale), made on demand, non-blocking, for each device that asks."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return self._copies[device]
