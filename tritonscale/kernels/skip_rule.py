"""The step's skip rule and ZClip's adaptive max_norm as Triton device functions, for ``finalize``.

The rules are the policy's (``LossScalePolicy.skip_decision`` in policy/loss_scale_policy.py,
``zscore_spike`` and ``zclip_max_norm`` in policy/spike_rules.py): a kernel cannot call Python, so
these repeat their arithmetic on the device, with every knob a ``tl.constexpr`` (None: the knob is
off, and no code is emitted for it). ``passes/step_decision.py`` maps a policy to the constexprs;
tests/kernels/test_skip_rule.py holds the two to the same bits.

    skip  = (found_inf > 0 if SKIP_ON_OVERFLOW) | (spike & isfinite(norm))
    spike = norm > NORM_ABOVE                                          (skip_norm_above)
          | count >= NORM_WARMUP & norm > f32(NORM_FACTOR * average)   (skip_norm_factor, norm_stats)
          | zscore_spike                                               (skip_norm_sigma, spike_stats)

Float32 where the policy computes in float32 (the knobs arrive rounded to float32), float64 where it
computes in float64 (the spike rules' state; float64 constants are made with ``tl.full``, exactly:
a bare Python float would become a float32 constant). The z-score's mean and variance sum the window
in a fixed order (blocks of ``BLOCK_W``, each a fixed tree), not torch's: the flag equals the torch
rule's except for a norm within a rounding of the threshold.

Layouts (``kernels/interfaces.py``'s, which the policy imports; read as ``K``, the kernel's
constants parameter, so that Triton checks no global on a launch): ``norm_stats`` float32
``[average, count]``; ``spike_stats`` float64 ``[seen, ema_mean, ema_var, ema_seen, window...,
warm-up...]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f64(value: tl.constexpr):
    """A float64 constant, exactly ``value``."""
    return tl.full([], value, tl.float64)


@triton.jit
def _isfinite(x):
    return x - x == 0  # false for +-inf and NaN (libdevice isinf/isnan do not run in the interpreter)


@triton.jit
def zscore_spike(
    stats_ptr,  # fp64 spike_stats
    norm,  # fp32 scalar: this step's norm
    SIGMA: tl.constexpr,  # skip_norm_sigma
    WINDOW: tl.constexpr,  # skip_norm_window
    MIN_SEEN: tl.constexpr,  # max(skip_norm_min_steps, WINDOW // 2): when the rule wakes up
    BLOCK_W: tl.constexpr,
    K: tl.constexpr,  # interfaces.KernelConstants
):
    """OLMo-core's rule (spike_rules.zscore_spike): skip unless ``norm - mean <= SIGMA * std`` over
    the newest ``min(seen, WINDOW)`` norms of the window (std Bessel-corrected), once active."""
    seen = tl.load(stats_ptr + K.Z_SEEN)
    count = tl.minimum(seen, _f64(WINDOW))
    first = WINDOW - count  # slots before it are not held yet
    o_w = tl.arange(0, BLOCK_W)
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, WINDOW, BLOCK_W):
        o_s = start + o_w  # [BLOCK_W]
        m_s = o_s < WINDOW
        b_w = tl.load(stats_ptr + K.SPIKE_HEADER + o_s, mask=m_s, other=0.0)
        total += tl.sum(tl.where(m_s & (o_s.to(tl.float64) >= first), b_w, 0.0), axis=0)
    mean = total / count
    squares = tl.zeros([], dtype=tl.float64)
    for start in range(0, WINDOW, BLOCK_W):
        o_s = start + o_w
        m_s = o_s < WINDOW
        b_d = tl.load(stats_ptr + K.SPIKE_HEADER + o_s, mask=m_s, other=0.0) - mean
        squares += tl.sum(tl.where(m_s & (o_s.to(tl.float64) >= first), b_d * b_d, 0.0), axis=0)
    var = squares / (count - 1.0)
    within = norm.to(tl.float64) - mean <= _f64(SIGMA) * tl.sqrt(var)
    active = tl.minimum(seen + 1.0, _f64(WINDOW + 1)) >= _f64(MIN_SEEN)
    return active & ~within


@triton.jit
def skip_decision(
    found_inf,  # fp32 scalar: the iteration's flag (nonzero: overflow)
    norm,  # fp32 scalar: the clip's norm
    norm_stats_ptr,  # fp32 [average, count] (read with NORM_FACTOR)
    spike_stats_ptr,  # fp64 spike_stats (read with SIGMA)
    SKIP_ON_OVERFLOW: tl.constexpr,
    NORM_ABOVE: tl.constexpr,  # skip_norm_above rounded to float32, or None
    NORM_FACTOR: tl.constexpr,  # skip_norm_factor rounded to float32, or None
    NORM_WARMUP: tl.constexpr,  # norm_warmup_steps
    SIGMA: tl.constexpr,  # skip_norm_sigma, or None
    WINDOW: tl.constexpr,
    MIN_SEEN: tl.constexpr,
    BLOCK_W: tl.constexpr,
    K: tl.constexpr,  # interfaces.KernelConstants
):
    """int1 scalar: the step is skipped (``LossScalePolicy.skip_decision``)."""
    skip = found_inf > 0
    if not SKIP_ON_OVERFLOW:
        skip = found_inf != found_inf  # false: the flag is 0 or 1, never NaN
    spike = norm != norm  # start from false, typed; the isfinite gate below drops NaN anyway
    if NORM_ABOVE is not None:
        spike = spike | (norm > NORM_ABOVE)
    if NORM_FACTOR is not None:
        average = tl.load(norm_stats_ptr + K.NORM_AVERAGE)
        warmed_up = tl.load(norm_stats_ptr + K.NORM_COUNT) >= NORM_WARMUP
        spike = spike | (warmed_up & (norm > NORM_FACTOR * average))
    if SIGMA is not None:
        spike = spike | zscore_spike(spike_stats_ptr, norm, SIGMA, WINDOW, MIN_SEEN, BLOCK_W, K)
    return skip | (spike & _isfinite(norm))


@triton.jit
def zclip_max_norm(
    stats_ptr,  # fp64 spike_stats
    norm,  # fp32 scalar: this step's norm
    max_norm,  # fp32 scalar: the max_norm clip_grad_norm_ was given (ZClip's max_grad_norm)
    Z: tl.constexpr,  # clip_norm_z
    WARMUP: tl.constexpr,  # clip_norm_warmup_steps
    PERCENTILE: tl.constexpr,  # clip_norm_mode == "percentile"
    TO_MEAN: tl.constexpr,  # clip_norm_option == "mean"
    EPS: tl.constexpr,  # clip_norm_eps
    FACTOR: tl.constexpr,  # clip_norm_factor
    K: tl.constexpr,  # interfaces.KernelConstants
):
    """fp32 scalar: ZClip's clip value (not above ``max_norm``) where it clips, else ``max_norm``
    (spike_rules.zclip_max_norm, ``_zclip_threshold`` op for op in float64). ``max_norm`` arrives
    rounded to float32: min and the final rounding commute with that rounding, so the bits are the
    float64 rule's."""
    x = norm.to(tl.float64)
    mean = tl.load(stats_ptr + K.EMA_MEAN)
    std = tl.sqrt(tl.load(stats_ptr + K.EMA_VAR))
    if PERCENTILE:
        threshold = mean + _f64(Z) * std
        spike = x > threshold
    else:
        z = (x - mean) / (std + _f64(EPS))
        spike = z > _f64(Z)
        if TO_MEAN:
            threshold = mean
        else:
            eta = z / _f64(Z)  # a larger outlier is clipped harder
            threshold = (mean + (_f64(Z) * std) / eta) * _f64(FACTOR)
    ready = (tl.load(stats_ptr + K.EMA_SEEN) >= _f64(WARMUP)) & _isfinite(x)
    limit = tl.full([], max_norm, tl.float32).to(tl.float64)  # a float32 argument (the interpreter: a float)
    clipped = tl.minimum(threshold, limit, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(ready & spike, clipped, limit).to(tl.float32)
