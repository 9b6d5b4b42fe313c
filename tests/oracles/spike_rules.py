"""The spike rules of OLMo-core and ZClip, transcribed from their repositories: the oracles of
tests/policy/test_spike_rules.py (decision for decision, clip value for clip value).

* ``OlmoSkip``: allenai/OLMo-core src/olmo_core/optim/skip_step_optimizer.py, ``SkipStepOptimizer``
  (``latest_grad_norm`` setter and ``get_step_factor``) at commit
  1d5c8237a4400015ce16bfc93070ab204505d594 (the file's newest change; its minimum of 2 came with
  7633461e965b0ca37283f0e2c492be8d808fcb06, before which, from 5036d90f495023fdb1d82b452f317bab25f60bd0
  to c067af03a2581bfc055dce62b2ecc5a71bea89cc, it was 20: ``min_steps``). The norm half only: the
  scaler sees no loss. One change, the scaler's documented choice: a non-finite norm (an overflowed
  step) is not appended (``keep_nonfinite=True`` appends it, as OLMo-core does).
* ``ZClipRef``: bluorion-com/ZClip zclip/zclip.py, ``ZClip.step`` without the gradients (the norm
  is given; ``_compute_clip_val``, ``_initialize_ema``, ``_update_ema`` as written) at commit
  584ce4f5a4aabab59e7df1dbaffc26a44df39dc1 (the file as e42cdd1ce92cd5da5148d184819f4b13c7fe5b1a
  left it). ``clip_value`` returns the ``max_norm`` torch's ``clip_grad_norm_`` is called with:
  ZClip's ``effective_clip`` where it clips adaptively, else its ``max_grad_norm`` (ZClip's own
  coefficient ``max / (norm + 1e-6) if norm > max`` is torch's
  formula but for norms within 1e-6 of the limit; the scaler's clip is torch's).
"""

from __future__ import annotations

import math
import warnings

import torch


class OlmoSkip:
    """OLMo-core's norm test. ``skip(norm)`` appends the norm (as ``latest_grad_norm = norm``) and
    says whether ``get_step_factor()`` is 0. Example: ``OlmoSkip(128, 6).skip(1.0)`` is False."""

    def __init__(self, rolling_interval_length: int = 128, sigma_factor: float = 6, min_steps: int = 2,
                 keep_nonfinite: bool = False) -> None:  # fmt: skip
        self.rolling_interval_length, self.sigma_factor = rolling_interval_length, sigma_factor
        self.min_steps = min_steps  # OLMo-core's constant: 2 since 7633461e9, 20 before
        self.keep_nonfinite = keep_nonfinite
        self._grad_norms: list[torch.Tensor] = []
        self.std = torch.std_mean  # the Bessel-corrected std; a test swaps in a wrong one

    def skip(self, norm: float) -> bool:
        if not math.isfinite(norm) and not self.keep_nonfinite:
            return False  # an overflow: skipped by the scaler anyway, and kept out of the window
        self._grad_norms.append(torch.tensor(norm, dtype=torch.float32))
        while len(self._grad_norms) > self.rolling_interval_length + 1:
            self._grad_norms.pop(0)
        if len(self._grad_norms) < max(self.min_steps, self.rolling_interval_length // 2):
            return False
        with warnings.catch_warnings():  # one previous norm: a NaN std (and a skip), as in OLMo-core
            warnings.filterwarnings("ignore", "std_mean\\(\\): degrees of freedom")
            grad_norm_std, grad_norm_mean = self.std(torch.stack(self._grad_norms[:-1]))
        step_factor = (self._grad_norms[-1] - grad_norm_mean) <= self.sigma_factor * grad_norm_std
        return not bool(step_factor)


class ZClipRef:
    """ZClip's rule on given norms. ``clip_value(norm, max_grad_norm)`` runs one ``step`` and returns
    the max_norm to clip with (``math.inf``: no clip). Example: ``ZClipRef().clip_value(1.0, 1.0)``."""

    def __init__(self, alpha=0.97, z_thresh=2.5, eps=1e-6, warmup_steps=25, mode="zscore",
                 clip_option="adaptive_scaling", clip_factor=1.0, skip_update_on_spike=False) -> None:  # fmt: skip
        self.alpha, self.z_thresh, self.eps, self.warmup_steps = alpha, z_thresh, eps, warmup_steps
        self.mode, self.clip_option, self.clip_factor = mode, clip_option, clip_factor
        self.skip_update_on_spike = skip_update_on_spike
        self.buffer: list[float] = []
        self.initialized, self.mean, self.var = False, None, None

    def _initialize_ema(self):
        self.mean = sum(self.buffer) / len(self.buffer)
        self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
        self.initialized = True
        self.buffer = []

    def _update_ema(self, grad_norm):
        self.mean = self.alpha * self.mean + (1 - self.alpha) * grad_norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (grad_norm - self.mean) ** 2

    def _compute_clip_val(self, grad_norm):
        std = self.var**0.5
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            if grad_norm > threshold:
                return threshold
        elif self.mode == "zscore":
            z = (grad_norm - self.mean) / (std + self.eps)
            if z > self.z_thresh:
                if self.clip_option == "adaptive_scaling":
                    eta = z / self.z_thresh
                    threshold = self.mean + (self.z_thresh * std) / eta
                    threshold = threshold * self.clip_factor
                elif self.clip_option == "mean":
                    threshold = self.mean
                return threshold
        return None

    def clip_value(self, total_norm: float, max_grad_norm: float = math.inf) -> float:
        if not math.isfinite(total_norm):
            return max_grad_norm  # an overflow: kept out (the scaler's choice), the step skipped
        if not self.initialized:
            self.buffer.append(total_norm)
            if len(self.buffer) >= self.warmup_steps:
                self._initialize_ema()
            return max_grad_norm
        clip_val = self._compute_clip_val(total_norm)
        effective = max_grad_norm if clip_val is None else min(clip_val, max_grad_norm)
        if not (clip_val is not None and self.skip_update_on_spike):
            self._update_ema(clip_val if clip_val is not None else total_norm)
        return effective
