"""Spike rules on the device: OLMo-core's z-score skip and ZClip's adaptive clip, from the norm.

Both read the norm the fused pass already computes (the unscaled norm before clipping) and a
small float64 state tensor, ``spike_stats``, updated in place at a fixed address; nothing is read
on the host, nothing branches on a device value (``torch.where`` picks), so the rule compiles and
a CUDA graph can capture it. The policy kernel computes the same in its launch
(``kernels/policy_update.py``, held to these ops by tests/kernels/test_policy_update.py).

* **z-score skip** (OLMo-core's ``SkipStepOptimizer.get_step_factor``, allenai/OLMo-core
  src/olmo_core/optim/skip_step_optimizer.py @ 1d5c8237a, the newest change of that file): once
  ``min(seen + 1, window + 1) >= max(min_steps, window // 2)`` norms were seen (this one
  counted), the step is skipped unless ``norm - mean <= sigma * std`` over the previous up to
  ``window`` norms (``std`` Bessel-corrected, as ``torch.std_mean``). OLMo-core's first version
  (5036d90f4 up to c067af03a) waited for ``max(20, window // 2)``; 7633461e9 made it
  ``max(2, window // 2)``: ``skip_norm_min_steps`` is that constant, so both are reachable.
  OLMo-core also tests the loss; a scaler sees the norm only, so this is the norm half. Unlike
  OLMo-core, a non-finite norm (an overflowed step, skipped anyway) is kept out of the window: with
  loss scaling every overflow would put inf there: the mean inf, the std NaN, and every step of the
  next ``window`` skipped. A finite norm is kept, also when it was skipped as a spike (OLMo-core's).
* **ZClip** (bluorion-com/ZClip zclip/zclip.py @ 584ce4f, the file as e42cdd1 left it): an
  exponential average of the norm's mean and variance, initialised from the first
  ``warmup_steps`` norms (their mean and population variance); after it, a norm whose z-score
  ``(norm - mean) / (std + eps)`` is above ``z`` is clipped to
  ``(mean + z * std / (zscore / z)) * factor`` ("adaptive_scaling") or to ``mean``
  ("mean"); in "percentile" mode to ``mean + z * std`` when above it. The clip value becomes the
  clip's ``max_norm`` (never above the ``max_norm`` passed to ``clip_grad_norm_``, ZClip's
  ``max_grad_norm``); the average then takes the clip value where it clipped, else the norm
  (unless ``skip_update_on_spike``). Non-finite norms are kept out, as above.

Layout of ``spike_stats`` (float64): ``[seen, ema_mean, ema_var, ema_seen, window..., warm-up...]``,
with the window (``skip_norm_window`` slots, the oldest first) only when the z-score skip is on and
the warm-up norms (``clip_norm_warmup_steps`` slots) only when ZClip is. Example::

    policy = LossScalePolicy(skip_norm_sigma=6.0, skip_norm_window=128)
    stats = torch.zeros(spike_state_size(policy), dtype=torch.float64)
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ScalerConfigError
from ..kernels.interfaces import EMA_MEAN, EMA_SEEN, EMA_VAR, Z_SEEN  # the slots' one home, shared with the kernels
from ..kernels.interfaces import SPIKE_HEADER as HEADER
from .knob_validation import is_count, is_finite

# Slots of the float64 spike_stats tensor: Z_SEEN, EMA_MEAN, EMA_VAR, EMA_SEEN, then from HEADER the
# window and the warm-up norms.
SPIKE_STAT_NAMES = ("seen", "ema_mean", "ema_var", "ema_seen")
CLIP_MODES = ("zscore", "percentile")
CLIP_OPTIONS = ("adaptive_scaling", "mean")


def window_size(policy: Any) -> int:
    return policy.skip_norm_window if policy.skip_norm_sigma is not None else 0


def warmup_size(policy: Any) -> int:
    return policy.clip_norm_warmup_steps if policy.clip_norm_z is not None else 0


def spike_state_size(policy: Any) -> int:
    """Slots ``spike_stats`` holds for ``policy``: 0 without a spike rule."""
    extra = window_size(policy) + warmup_size(policy)
    return HEADER + extra if extra else 0


def zscore_spike(policy: Any, stats: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """bool 0-dim: OLMo-core's rule says skip. It is active once ``min(seen + 1, window + 1) >=
    max(min_steps, window // 2)``, and then skips unless ``norm - mean <= sigma * std`` over the
    previous (up to ``window``) norms, the std Bessel-corrected. Not yet active: False."""
    size = policy.skip_norm_window
    window, seen = stats[HEADER : HEADER + size], stats[Z_SEEN]
    count = torch.clamp(seen, max=size)
    held = torch.arange(size, device=stats.device) >= size - count  # the newest `count` slots
    mean = torch.where(held, window, 0.0).sum() / count
    var = torch.where(held, (window - mean) * (window - mean), 0.0).sum() / (count - 1)
    within = (norm.double() - mean) <= policy.skip_norm_sigma * torch.sqrt(var)
    active = torch.clamp(seen + 1, max=size + 1) >= max(policy.skip_norm_min_steps, size // 2)
    return active & ~within


def _zclip_threshold(policy: Any, mean: torch.Tensor, var: torch.Tensor, x: torch.Tensor) -> tuple:
    """(clip value, spike) of ZClip's ``_compute_clip_val`` on float64 tensors, op for op."""
    z_thresh, std = policy.clip_norm_z, torch.sqrt(var)
    if policy.clip_norm_mode == "percentile":
        threshold = mean + z_thresh * std
        return threshold, x > threshold
    z = (x - mean) / (std + policy.clip_norm_eps)
    if policy.clip_norm_option == "mean":
        return mean, z > z_thresh
    eta = z / z_thresh  # a larger outlier is clipped harder
    return (mean + (z_thresh * std) / eta) * policy.clip_norm_factor, z > z_thresh


def zclip_max_norm(
    policy: Any, stats: torch.Tensor, norm: torch.Tensor, max_norm: float | torch.Tensor
) -> torch.Tensor:
    """float32 0-dim: the clip's ``max_norm`` this step: ZClip's clip value (not above
    ``max_norm``) where it clips, else ``max_norm``. During the warm-up: ``max_norm``."""
    x = norm.double()
    threshold, spike = _zclip_threshold(policy, stats[EMA_MEAN], stats[EMA_VAR], x)
    ready = (stats[EMA_SEEN] >= policy.clip_norm_warmup_steps) & torch.isfinite(x)  # an overflow: skipped
    limit = _as_float64_like(threshold, max_norm)
    return torch.where(ready & spike, torch.minimum(threshold, limit), limit).float()


def _as_float64_like(like: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """``max_norm`` as a float64 0-dim tensor on ``like``'s device, exactly (a double holds any
    float, and any float32/float16/bfloat16 value). Neither form makes Dynamo specialise: a tensor
    stays a tensor (``torch.full_like`` would read it with ``.item()``: an unbacked symbol a
    fullgraph trace cannot return), and a Python float enters as an operand of a multiply, as the
    default clip's takes it (``full_like`` guards on its fill value: one recompilation per new
    ``max_norm``). ``1.0 * max_norm`` is ``max_norm`` bit for bit, -0.0 and inf included."""
    if isinstance(max_norm, torch.Tensor):
        return max_norm.detach().to(like.device, torch.float64).reshape(())
    return torch.ones_like(like) * max_norm


def update_spike_stats_(policy: Any, stats: torch.Tensor, norm: torch.Tensor) -> None:
    """Fold this iteration's norm into the window and the average, in place (a non-finite norm: nothing)."""
    x = norm.double().reshape(())
    take = torch.isfinite(x)
    if policy.skip_norm_sigma is not None:
        window = stats[HEADER : HEADER + policy.skip_norm_window]
        window.copy_(torch.where(take, torch.cat([window[1:], x.reshape(1)]), window))  # oldest out
        stats[Z_SEEN] += take.double()
    if policy.clip_norm_z is not None:
        _update_ema_(policy, stats, x, take)


def _update_ema_(policy: Any, stats: torch.Tensor, x: torch.Tensor, take: torch.Tensor) -> None:
    """ZClip's warm-up buffer, its initialisation and its EMA update (``_update_ema``), op for op."""
    steps = policy.clip_norm_warmup_steps
    start = HEADER + window_size(policy)
    buffer, seen = stats[start : start + steps], stats[EMA_SEEN]
    mean, var = stats[EMA_MEAN], stats[EMA_VAR]
    warming = take & (seen < steps)
    buffer.copy_(torch.where(warming & (torch.arange(steps, device=stats.device) == seen), x, buffer))
    completes = warming & (seen + 1 >= steps)
    # Python's sum, left to right (cumsum on the host); the population variance, as ZClip.
    first_mean = buffer.cumsum(0)[-1] / steps
    first_var = ((buffer - first_mean) * (buffer - first_mean)).cumsum(0)[-1] / steps
    threshold, spike = _zclip_threshold(policy, mean, var, x)
    value = torch.where(spike, threshold, x)  # the clip value where it clipped
    alpha = policy.clip_norm_alpha
    new_mean = alpha * mean + (1 - alpha) * value
    new_var = alpha * var + (1 - alpha) * ((value - new_mean) * (value - new_mean))
    moves = take & (seen >= steps)
    if policy.clip_norm_skip_update_on_spike:
        moves = moves & ~spike
    stats[EMA_MEAN] = torch.where(completes, first_mean, torch.where(moves, new_mean, mean))
    stats[EMA_VAR] = torch.where(completes, first_var, torch.where(moves, new_var, var))
    stats[EMA_SEEN] = seen + warming.double()


def check_spike_knobs(policy: Any) -> None:
    """``LossScalePolicy.validate``'s checks of the spike knobs, in place: positive finite numbers, window
    and warm-up lengths of at least 2 and 1 norms, ZClip's modes by its own names."""
    for name in ("skip_norm_sigma", "clip_norm_z"):
        value = getattr(policy, name)
        if value is not None and not (is_finite(value) and value > 0):
            raise ScalerConfigError(f"{name} must be a finite number > 0 or None, got {value!r}")
        setattr(policy, name, None if value is None else float(value))
    for name, low in (("skip_norm_window", 2), ("skip_norm_min_steps", 2), ("clip_norm_warmup_steps", 1)):
        if not is_count(getattr(policy, name), low, 2**16 + 1):
            raise ScalerConfigError(f"{name} must be an int in [{low}, 65536], got {getattr(policy, name)!r}")
        setattr(policy, name, int(getattr(policy, name)))
    if policy.skip_norm_min_steps > policy.skip_norm_window + 1:  # OLMo-core's rule would never wake up
        raise ScalerConfigError(
            f"skip_norm_min_steps={policy.skip_norm_min_steps} is more than skip_norm_window + 1 "
            f"({policy.skip_norm_window + 1}, the norms the z-score rule holds): the skip would never be active"
        )
    if not (is_finite(policy.clip_norm_alpha) and 0 < policy.clip_norm_alpha < 1):
        raise ScalerConfigError(f"clip_norm_alpha must be in (0, 1), got {policy.clip_norm_alpha!r}")
    if not (is_finite(policy.clip_norm_factor) and policy.clip_norm_factor > 0):
        raise ScalerConfigError(f"clip_norm_factor must be a finite number > 0, got {policy.clip_norm_factor!r}")
    if not (is_finite(policy.clip_norm_eps) and policy.clip_norm_eps >= 0):
        raise ScalerConfigError(f"clip_norm_eps must be a finite number >= 0, got {policy.clip_norm_eps!r}")
    for name, choices in (("clip_norm_mode", CLIP_MODES), ("clip_norm_option", CLIP_OPTIONS)):
        if getattr(policy, name) not in choices:
            raise ScalerConfigError(f"{name} must be one of {choices}, got {getattr(policy, name)!r}")
    policy.clip_norm_alpha, policy.clip_norm_factor = float(policy.clip_norm_alpha), float(policy.clip_norm_factor)
    policy.clip_norm_eps = float(policy.clip_norm_eps)
