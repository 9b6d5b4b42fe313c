"""found_inf flags: 0-dim float32 tensors, nonzero where a pass met inf/NaN, combined as torch does
(by summing), and read on the host only where a caller asks for a bool.

A leaf: it imports nothing of the package, so every stage (the passes, the policy's runner, the
controller's records) sums flags with this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def combine_flags(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """Sum of 0-dim flags on one device (the way torch combines found_inf), None for none."""
    if not flags:
        return None
    if len(flags) == 1:  # reshape(()) is a dispatch even on a 0-dim tensor: skipped when it does nothing
        return flags[0] if flags[0].dim() == 0 else flags[0].reshape(())
    return torch.stack([f.reshape(()) for f in flags]).sum()


def flags_on(device: torch.device, flags: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Flags on any devices moved to ``device`` (no host read) and summed there; None for none.
    Example: ``flags_on(scale.device, record.found_inf_per_device.values())``."""
    return combine_flags([moved_to(f, device) for f in flags])


def moved_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device, non_blocking=True)``, without the dispatch where it is there already
    (``to`` returns the tensor itself then, too): a step's flags and norm nearly always are.
    Example: ``moved_to(found_inf, scale.device)``."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def summed_flag(flags: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Flags on any devices summed into one 0-dim flag on the first one's device, None for none."""
    flags = list(flags)
    return flags_on(flags[0].device, flags) if flags else None


def read_found_inf(flags: Iterable[torch.Tensor]) -> bool:
    """Whether any found_inf flag is set: their sum read on the host (one read; torch reads each
    device's, with the same answer). False for none."""
    found_inf = summed_flag(flags)
    return found_inf is not None and bool(found_inf.item())


def read_flag(flag: torch.Tensor) -> bool:
    """One flag read on the host (one read): whether it is set. Example: ``if read_flag(skip): ...``."""
    return bool(flag.item())
