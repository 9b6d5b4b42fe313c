"""Hand-written references of other frameworks' loss-scale update rules, read from their sources.

Each class restates one framework's rule in plain Python, independently of tritonscale, in the
arithmetic the original does it in: Python numbers where the original keeps the scale in Python
(Megatron-LM's older rule, apex, MindSpore's manager), float32 where it keeps it in a float32
variable (TensorFlow). tests/policy/test_policies.py and tests/peer_apis/test_scale_managers.py
check tritonscale's scale against them step for step, on the overflow patterns of
``overflow_pattern``. The peers' presets have their transcriptions in tests/oracles/peer_rules.py.
"""

from __future__ import annotations

import math
import random
import warnings

import torch


def f32(value: float) -> float:
    """``value`` rounded to float32 as an IEEE cast does it (past the range: inf)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def overflow_pattern(seed, steps=120, p=0.3):
    rng = random.Random(seed)
    # Bursts as well as isolated overflows, so hysteresis budgets are both spent and refilled.
    out = []
    while len(out) < steps:
        out += [rng.random() < p] * rng.choice([1, 1, 1, 2, 3])
    return out[:steps]


class MegatronRef:  # megatron/core/optimizer/grad_scaler.py, DynamicGradScaler.update
    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale, self.min_scale = initial_scale, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


class TensorFlowExponentialRef:
    """tensorflow/contrib/mixed_precision/python/loss_scale_manager.py (TF 1.x),
    ExponentialUpdateLossScaleManager.update_loss_scale.

    The scale is a float32 variable and the ratios are converted to float32 before they multiply
    it, so every product here is rounded to float32 (a grown scale past float32's range is inf,
    and not applied). A good step that does not grow adds to the good count and leaves the bad
    count; a bad step that does not decrease adds to the bad count and zeroes the good count; any
    change of the scale -- also a growth refused as non-finite -- zeroes both.
    """

    def __init__(self, init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8):
        self.scale, self.incr_n, self.decr_n = f32(init_loss_scale), incr_every_n_steps, decr_every_n_nan_or_inf
        self.incr_ratio, self.decr_ratio = f32(incr_ratio), f32(decr_ratio)
        self.good, self.bad = 0, 0

    def update(self, overflow):
        if not overflow:
            if self.good + 1 >= self.incr_n:
                new = f32(self.scale * self.incr_ratio)
                self.scale = new if math.isfinite(new) else self.scale
                self.good, self.bad = 0, 0
            else:
                self.good += 1
        else:
            if self.bad + 1 >= self.decr_n:
                self.scale = max(1.0, f32(self.scale * self.decr_ratio))
                self.good, self.bad = 0, 0
            else:
                self.bad += 1
                self.good = 0


class MindSporeRef:
    """mindspore/python/mindspore/train/loss_scale_manager.py, DynamicLossScaleManager.update_loss_scale.

    Python numbers throughout (an int scale stays an int while it grows). The decrease multiplies
    by ``1 / scale_factor``; the RuntimeError comes after the step's update, before ``cur_iter``
    advances.
    """

    def __init__(self, init_loss_scale, scale_factor, scale_window, bad_step_max=1000):
        self.scale, self.factor, self.window = init_loss_scale, scale_factor, scale_window
        self.decrease_ratio = 1 / scale_factor
        self.bad_step_max = bad_step_max
        self.cur_iter, self.last_overflow_iter, self.bad_step = 1, 0, 0

    def update(self, overflow):
        if overflow:
            self.scale = max(self.scale * self.decrease_ratio, 1)
            self.last_overflow_iter = self.cur_iter
            self.bad_step += 1
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.scale *= self.factor
            self.bad_step = 0
        if self.bad_step > self.bad_step_max:
            raise RuntimeError("too many bad steps")
        self.cur_iter += 1


class ApexRef:  # apex/amp/scaler.py, LossScaler.update_scale (dynamic)
    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
        self.scale, self.window, self.min, self.max = init_scale, scale_window, min_loss_scale, max_loss_scale
        self.unskipped = 0

    def update(self, overflow):
        if overflow:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0


class Loop:
    """A one-parameter training loop whose gradient is made inf on request."""

    def __init__(self, scaler, backend, clip=False):
        self.param = torch.nn.Parameter(torch.ones(8))
        self.opt = torch.optim.SGD([self.param], lr=1e-3)
        self.scaler, self.clip = scaler, clip

    def step(self, overflow, grad_value=1.0):
        self.opt.zero_grad()
        self.scaler.scale((self.param * grad_value).sum()).backward()
        if overflow:
            self.param.grad[3] = math.inf
        norm = self.scaler.clip_grad_norm_(self.opt, 1e6) if self.clip else None
        self.scaler.step(self.opt)
        self.scaler.update()
        return norm


def call_outcome(action) -> tuple:
    """What a call did, to compare one form's run of a step with another's: the exception's type
    and message (None if none), the warnings' messages in order. Example:
    ``call_outcome(lambda: scaler.update()) == (None, [])``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
            error = None
        except Exception as raised:  # noqa: BLE001 -- compared with the other run's
            error = (type(raised), str(raised))
    return error, [str(w.message) for w in caught]
