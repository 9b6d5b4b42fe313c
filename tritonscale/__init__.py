"""tritonscale: fused Triton loss scaling, inf/NaN check and gradient clipping.

``tritonscale.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` whose unscale / inf-check /
clip run as one fused multi-tensor pass, with the scale kept on the device (no host sync).
MindSpore's and TensorFlow 1.x's scale managers (``FixedLossScaleManager``,
``DynamicLossScaleManager``, ``ExponentialUpdateLossScaleManager``) are a layer over it. Importing
it touches no device.

The Triton kernels are the subpackage ``tritonscale.kernels`` (``tritonscale/kernels/``), the
bottom layer: it imports nothing else of tritonscale.
"""

from .errors import RankMismatchError, ScalerConfigError
from .peer_apis.checkpoint_import import from_apex, from_deepspeed, from_fairseq, from_megatron
from .peer_apis.loss_scale_optimizer import LossScaleOptimizer
from .peer_apis.safe_checkpoint import load_checkpoint
from .peer_apis.scale_managers import (
    DynamicLossScaleManager,
    ExponentialUpdateLossScaleManager,
    FixedLossScaleManager,
)
from .peer_apis.step_updater import DataFeedExhausted, Updater, UpdaterError, UpdateResult
from .grads.flat_grads import flatten_grads_
from .grads.sharding import mark_replicated
from .loop.applied_steps import AppliedSteps
from .loop.captured_step import CapturedStep
from .loop.lr_schedules import SkipAwareLR
from .loop.scale_history import ScaleHistory
from .loop.step_log import StepLog
from .policy import peer_presets as presets
from .policy.loss_scale_policy import LossScalePolicy
from .policy.peer_presets import PeerPreset
from .scaler.diagnostics import nonfinite_grads
from .scaler.grad_scaler import GradScaler, OptState

__all__ = [
    "AppliedSteps",
    "CapturedStep",
    "DataFeedExhausted",
    "DynamicLossScaleManager",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "GradScaler",
    "LossScaleOptimizer",
    "LossScalePolicy",
    "OptState",
    "PeerPreset",
    "RankMismatchError",
    "ScaleHistory",
    "ScalerConfigError",
    "SkipAwareLR",
    "StepLog",
    "UpdateResult",
    "Updater",
    "UpdaterError",
    "flatten_grads_",
    "from_apex",
    "from_deepspeed",
    "from_fairseq",
    "from_megatron",
    "load_checkpoint",
    "mark_replicated",
    "nonfinite_grads",
    "presets",
]
__version__ = "0.2.0"
