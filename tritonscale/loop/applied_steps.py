"""Which optimizer steps a scaler applied: the skip signal and step count the integrations hand their frameworks.

A framework's scheduler must advance only on applied steps (Megatron's rule). Every integration
answers the same two questions the same way, from the scaler's device flag
(``GradScaler.last_skip_flag()``, read after ``update()``):

* "was this iteration's step skipped?" -- :meth:`AppliedSteps.skipped`, one host read at the moment a
  framework asks (Lightning's and mmengine's scheduler hooks are host code), cached until the next
  step so several schedulers cost one read;
* "how many steps were applied?" -- :attr:`AppliedSteps.count`, kept on the device (no read per
  step) and read once when asked (timm's ``step_update(num_updates)`` takes a host int).

Example::

    applied = AppliedSteps()
    scaler.step(optimizer); scaler.update()
    applied.record(scaler)           # no host read
    if not applied.skipped():        # one host read
        scheduler.step()
"""

from __future__ import annotations

import torch

from ..host_reads import refuse_in_capture
from ..scaler.grad_scaler import GradScaler
from .scaler_arg import check_scaler
from .step_log import CAPTURE_FIX

__all__ = ["AppliedSteps"]


class AppliedSteps:
    """The applied-step count (on the device) and the skip of the last recorded step.

    Example: ``applied.record(scaler)`` after each ``scaler.update()``; ``applied.count`` for timm's
    ``num_updates``; ``applied.skipped()`` to gate a scheduler step.
    """

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None  # this iteration's skip flag (0-dim bool), None: no step
        self._skipped: bool | None = None  # its host value, once read
        self._on_device: torch.Tensor | None = None  # applied steps whose flag was on the device
        self._on_host = 0  # applied steps with no flag (a disabled scaler that did not check)

    def record(self, scaler: GradScaler) -> None:
        """Note the step that ``scaler.update()`` just completed (no host read). A scaler with no
        ``last_skip_flag()`` (torch's, None) is refused with a TypeError and nothing noted.

        Args:
            scaler: the ``GradScaler`` whose ``last_skip_flag()`` is noted.

        Raises:
            TypeError: a scaler without ``last_skip_flag()``.
            RuntimeError: called during a CUDA graph capture.
        """
        check_scaler(scaler, "AppliedSteps.record", "last_skip_flag")
        flag = scaler.last_skip_flag()
        if flag is not None:  # the first record allocates, and a later read caches: host state
            refuse_in_capture(flag.device, "AppliedSteps.record", CAPTURE_FIX)
        self._flag, self._skipped = flag, None
        if flag is None:
            self._on_host += 1
        elif self._on_device is None:
            self._on_device = (~flag).to(torch.int64)
        else:
            self._on_device += ~flag

    def clear(self) -> None:
        """This iteration has no step (yet): :meth:`skipped` is False until the next :meth:`record`."""
        self._flag, self._skipped = None, None

    def skipped(self) -> bool:
        """Whether the step recorded since the last :meth:`clear` was skipped (one host read, cached).

        Returns:
            True if that step was skipped; False if it was applied, or none was recorded since.
        """
        if self._flag is None:
            return False
        if self._skipped is None:
            self._skipped = bool(self._flag.item())
        return self._skipped

    @property
    def count(self) -> int:
        """How many recorded steps were applied (one host read).

        Returns:
            the number of recorded steps that were applied.
        """
        return self._on_host + (int(self._on_device.item()) if self._on_device is not None else 0)
