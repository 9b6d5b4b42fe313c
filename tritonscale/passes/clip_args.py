"""The public API's clip arguments: ``max_norm`` and ``norm_type`` as the user passes them.

``GradScaler.clip_grad_norm_``, ``LossScaleOptimizer``, the ``Updater`` and the integrations take
the same two arguments torch.nn.utils.clip_grad_norm_ takes; each is checked here, so a rule and
its error message are written once. Which norm types the kernels compute is the kernels' own
table (``kernels/supported.py``); ``kernels_compute`` routes the others to torch ops.
"""

from __future__ import annotations

import math

from ..kernels.supported import NORM_CODES


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float: any number torch.nn.utils.clip_grad_norm_ takes (not NaN). The
    kernels compute 1, 2 and inf (``norm_code``); the others go through torch ops."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or math.isnan(norm_type):
        raise ValueError(f"norm_type must be a number (1, 2 and inf run in the kernels), got {norm_type!r}")
    return float(norm_type)


def kernels_compute(norm_type: float) -> bool:
    """True for the norm types the kernels compute (1, 2, inf)."""
    return norm_type in NORM_CODES


def check_max_norm(max_norm: float) -> float:
    """``max_norm`` as a float: any number torch.nn.utils.clip_grad_norm_ clips sensibly by, from 0
    (every gradient zeroed) to inf (the norm alone, nothing clipped); negative and NaN refused."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise ValueError(f"max_norm must be a float >= 0 (inf: only measure), got {max_norm!r}")
    try:
        value = float(max_norm)
    except OverflowError:  # an int beyond the float range, such as 10**400 (torch: a raw OverflowError)
        raise ValueError(f"max_norm must be a float >= 0, got an int of {max_norm.bit_length()} bits") from None
    if not value >= 0:  # negative would flip every gradient's sign; NaN would poison it
        raise ValueError(f"max_norm must be a float >= 0 (inf: only measure), got {max_norm!r}")
    return value
