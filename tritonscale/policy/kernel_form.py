"""The rule's second executor: one Triton launch (``kernels/policy_update.py``).

Where the rule runs (docs/policies.md, "Where the rule runs"):

* as one kernel, whatever the policy, wherever the Triton kernels launch (CUDA and ROCm with
  Triton; the CPU under ``TRITON_INTERPRET=1`` when the scaler's backend is "triton");
* elsewhere as the rule's tensor ops (``loss_scale_policy.py``): on the CPU with the other backends,
  while Dynamo traces a step (inductor fuses them), and when the caller asks for
  ``compile_policy=True``.

``kernel_rule`` maps a policy's knobs to the kernel's constexprs, once per set of knob values.
"""

from __future__ import annotations

import torch

from ..kernels import TRITON_FOUND
from ..kernels.interfaces import (
    AT_MIN_SCALE,
    AT_RAISE_SCALE,
    TOO_MANY_SKIPS,
    ZCLIP_ADAPTIVE,
    ZCLIP_MEAN,
    ZCLIP_PERCENTILE,
    ZCLIP_ZSCORE,
    UpdateRule,
)
from .rounding import SCALE_FLOOR, as_float32
from .loss_scale_policy import LossScalePolicy
from .spike_rules import warmup_size, window_size

# A policy's stamp (loss_scale_policy.py: new whenever a knob is set) -> its rule.
_rules: dict[int, UpdateRule] = {}
# (device type, backend) -> whether the kernel launches there.
_RUNS: dict[tuple[str, str], bool] = {}
_MODES = {"zscore": ZCLIP_ZSCORE, "percentile": ZCLIP_PERCENTILE}
_OPTIONS = {"adaptive_scaling": ZCLIP_ADAPTIVE, "mean": ZCLIP_MEAN}


def kernel_runs(device: torch.device, backend: str) -> bool:
    """The policy kernel can launch on ``device`` for a scaler of ``backend`` ("auto", "triton",
    "torch"): on CUDA/ROCm with compiled Triton unless the backend is "torch"; on the CPU only under
    the interpreter and with backend "triton" (the interpreter is slow: "auto" keeps the tensor ops).
    A function of the device's type and the backend alone (the interpreter is chosen at import)."""
    runs = _RUNS.get((device.type, backend))
    if runs is None:
        runs = _RUNS[(device.type, backend)] = _kernel_runs(device.type, backend)
    return runs


def _kernel_runs(device_type: str, backend: str) -> bool:
    if not TRITON_FOUND:
        return False
    from ..kernels.jit_helpers import INTERPRETING  # triton's

    if device_type == "cpu":
        return INTERPRETING and backend == "triton"
    return device_type == "cuda" and not INTERPRETING and backend != "torch"


def kernel_rule(policy: LossScalePolicy) -> UpdateRule:
    """``policy``'s knobs as ``UpdateRule``, made again whenever a knob changed (its ``stamp``)."""
    made = _rules.get(policy.stamp)
    if made is None:
        if len(_rules) > 64:  # knobs that keep changing: keep the cache small
            _rules.clear()
        made = _rules[policy.stamp] = _make_rule(policy)
    return made


def _hold_mask(policy: LossScalePolicy) -> int:
    """The check bits that raise (a "warn" at min_scale lets the update go ahead)."""
    raising = TOO_MANY_SKIPS | AT_RAISE_SCALE
    return raising | (AT_MIN_SCALE if policy.on_min_scale == "raise" else 0)


def _make_rule(policy: LossScalePolicy) -> UpdateRule:
    p = policy
    return UpdateRule(
        DYNAMIC=p.dynamic,
        SKIP_ON_OVERFLOW=p.skip_on_overflow,
        GROWTH_FACTOR=float(p.growth_factor),
        BACKOFF_FACTOR=float(p.backoff_factor),
        GROWTH_INTERVAL=int(p.growth_interval),
        HYSTERESIS=p.hysteresis,
        CONSECUTIVE_HYSTERESIS=p.consecutive_hysteresis,
        REFILL_ON_BACKOFF=p.hysteresis_refill_on_backoff,
        TOLERANCE=p.overflow_tolerance,
        RAISE_FLOOR=p.backoff_floor() == SCALE_FLOOR,
        BACKOFF_FLOOR=p.backoff_floor(),
        HAS_MIN=p.min_scale is not None,
        MIN_SCALE=as_float32(p.min_scale or 0.0),
        HAS_MAX=p.max_scale is not None,
        MAX_SCALE=as_float32(p.max_scale or 0.0),
        GROWTH_DELAY=p.growth_delay,
        AVERAGE_NORM=p.skip_norm_factor is not None,
        NORM_DECAY=as_float32(p.norm_average_decay),
        Z_WINDOW=window_size(p),
        ZCLIP_WARMUP=warmup_size(p),
        ZCLIP_Z=float(p.clip_norm_z or 0.0),
        ZCLIP_ALPHA=p.clip_norm_alpha,
        ZCLIP_ONE_MINUS_ALPHA=1 - p.clip_norm_alpha,
        ZCLIP_MODE=_MODES[p.clip_norm_mode],
        ZCLIP_OPTION=_OPTIONS[p.clip_norm_option],
        ZCLIP_FACTOR=p.clip_norm_factor,
        ZCLIP_EPS=p.clip_norm_eps,
        ZCLIP_SKIP_ON_SPIKE=p.clip_norm_skip_update_on_spike,
        CHECK_MIN_SCALE=p.dynamic and p.min_scale is not None and p.on_min_scale != "clamp",
        SKIP_LIMIT=p.max_consecutive_skips or 0,
        CHECK_RAISE_AT=p.dynamic and p.raise_at_scale is not None,
        RAISE_AT=float(p.raise_at_scale or 0.0),
        HOLD_MASK=_hold_mask(p),
    )
