"""Which optimizer a scaler's norm history belongs to: one, the first whose clip fed it.

The policy's norm-history rules (``skip_norm_factor``'s running average, the z-score skip's window,
ZClip's average: ``NORM_HISTORY_KNOBS``) keep one history per scaler, which each update() feeds
with the iteration's clip norm. Two optimizers clipped on one scaler would feed it in turn, and
each would be judged against the other's norms (steady norms of 10 and 1: the first skipped as a
spike most steps, or its steps cut tenfold). So the history belongs to the optimizer whose clip
fed it first, and a clip of another one is refused before anything changes. An optimizer that is
only stepped feeds nothing; one that is gone (its weak reference dead) may be replaced; a fresh
scaler, a loaded one and a copy start with no owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ScalerConfigError
from ..policy.loss_scale_policy import NORM_HISTORY_KNOBS, LossScalePolicy
from .optimizer_record import weak


class NormHistoryOwner:
    """The optimizer (the real one: ``unwrap_optimizer``'s) whose norms feed the history, held
    weakly. A host-side identity check, no device value read. Example::

        owner = NormHistoryOwner()
        owner.check(policy, optimizer)   # raises if another live optimizer's clips feed it
        ... the clip ...
        owner.claim(policy, optimizer)
    """

    def __init__(self) -> None:
        self._owner: Callable[[], Any] | None = None

    def _current(self) -> Any:
        return None if self._owner is None else self._owner()

    def check(self, policy: LossScalePolicy, optimizer: Any) -> None:
        """Raise ScalerConfigError when ``policy`` keeps a norm history that another live
        optimizer's clips feed; change nothing."""
        owner = self._current()
        if owner is None or owner is optimizer or not policy.has_norm_history():
            return
        knobs = ", ".join(policy.knobs_set(NORM_HISTORY_KNOBS))
        raise ScalerConfigError(
            f"clip_grad_norm_ with {knobs} on a second optimizer ({type(optimizer).__name__}), while the clips of "
            f"another ({type(owner).__name__}) already feed this GradScaler's norm history: the policy keeps one "
            "history per scaler, so each optimizer would be judged against the other's norms. Clip once over all "
            "parameters (one optimizer, "
            "with param groups), or give each optimizer its own GradScaler (each keeps its own history). An "
            "optimizer that is only stepped (scaler.step without clip_grad_norm_) may share this scaler."
        )

    def claim(self, policy: LossScalePolicy, optimizer: Any) -> None:
        """After a clip of ``optimizer`` under ``policy``: it owns the history, unless a live one does."""
        if policy.has_norm_history() and self._current() is None:
            self._owner = weak(optimizer)
