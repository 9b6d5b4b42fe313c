"""Scale managers: MindSpore's and TensorFlow 1.x's loss-scale manager classes, over GradScaler.

For code that drives the loss scale itself, with the originals' names, signatures and methods
(``get_loss_scale``, ``update_loss_scale``, ``get_drop_overflow_update``, ``get_update_cell``).
Each manager owns a ``GradScaler`` (``manager.grad_scaler``) configured with the policy that
states the original's rule; that scaler is the manager's state, and a loop that wants the fused
passes drives it directly. The design and every difference from the originals:
``docs/scale-managers.md``.

* ``FixedLossScaleManager``: MindSpore's and TF1's (``loss_scale_manager.py``);
* ``DynamicLossScaleManager``: MindSpore's, with its ``bad_step_max`` (``mindspore_manager.py``);
* ``ExponentialUpdateLossScaleManager``: TF1's (``tf1_manager.py``).
"""

from __future__ import annotations

from .loss_scale_manager import FixedLossScaleManager, LossScaleManager
from .mindspore_manager import DynamicLossScaleManager
from .tf1_manager import ExponentialUpdateLossScaleManager

__all__ = [
    "DynamicLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
]
