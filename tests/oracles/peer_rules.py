"""Each peer's loss-scale update rule, transcribed from its source, in the peer's own arithmetic.

The oracle of tests/policy/test_peer_presets.py and tests/policy/test_peer_upstream.py: every class
restates one peer's update, read from the file and commit cited above it, independently of
tritonscale. Each has ``update(overflow)`` (raising where the peer raises), ``.scale`` and
``.skipped`` (whether the optimizer step of the last update was skipped). The arithmetic is the
peer's: Megatron-LM multiplies float32 tensors; Keras, tf-keras and TensorFlow 1.x keep a float32
variable (numpy float32 here); apex's hysteresis kernel multiplies a float32 scale by a double
factor and rounds once; DeepSpeed, fairseq and apex amp keep Python floats.

The builders at the bottom (``RULES``) take each peer's own configuration arguments, with the
peer's defaults, and build the rule the way the peer's optimizer builds its scaler (DeepSpeed's
``initial_scale_power``, fairseq's scale window from world size and update frequency, ...): the
same signatures as ``tritonscale.presets``, so a test calls both with one set of arguments.

Example::

    rule = RULES["deepspeed"](initial_scale_power=8, loss_scale_window=2)
    rule.update(False)   # rule.scale == 256.0, rule.skipped is False
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable

import numpy as np
import torch

from .scale_rules import Loop, TensorFlowExponentialRef, f32

F32 = np.float32


def bits(value: float) -> bytes:
    """The float32 bit pattern of ``value`` (rounded to float32 first): what "bit for bit" compares."""
    return struct.pack("<f", f32(float(value)))


# --------------------------------------------------------------------------------- torch
class TorchRule:
    """torch.amp.GradScaler.update (pytorch/pytorch torch/amp/grad_scaler.py, 2.x): its own
    ``torch._amp_update_scale_`` on a float32 scale, the factors as doubles; a skip on every overflow."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._scale = torch.full((), init_scale, dtype=torch.float32)
        self._tracker = torch.zeros((), dtype=torch.int32)
        self.factors = (growth_factor, backoff_factor, growth_interval)
        self.skipped = False

    @property
    def scale(self) -> float:
        return self._scale.item()

    def update(self, overflow: bool) -> None:
        found_inf = torch.full((), float(overflow))
        torch._amp_update_scale_(self._scale, self._tracker, found_inf, *self.factors)
        self.skipped = bool(overflow)


# ----------------------------------------------------------------------------- Megatron-LM
class MegatronDynamicRule:
    """NVIDIA/Megatron-LM megatron/core/optimizer/grad_scaler.py @ 00caa53a, DynamicGradScaler.update.

    Scale, factors and floor are float32 tensors ``torch.tensor([x], dtype=torch.float)``: the
    backoff is ``torch.max(scale * backoff_factor, min_scale)``, the growth ``scale * growth_factor``
    (float32 products, no check for inf). MixedPrecisionOptimizer.step skips on found_inf.
    """

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        assert initial_scale > 0.0 and 0.0 < min_scale <= initial_scale
        assert growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and hysteresis > 0
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis
        self.skipped = False

    @property
    def scale(self) -> float:
        return self._scale.item()

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor
        self.skipped = bool(found_inf)


class FixedScale:
    """A scale that never changes, in float32:

    * Megatron-LM grad_scaler.py ConstantGradScaler (``--loss-scale x``): overflowed steps skipped;
    * DeepSpeed deepspeed/runtime/fp16/loss_scaler.py LossScaler (``"loss_scale": x > 0``): the
      fused/unfused/ZeRO optimizers skip an overflowed step;
    * TF 1.x tensorflow/contrib/mixed_precision/python/loss_scale_manager.py FixedLossScaleManager:
      contrib LossScaleOptimizer applies gradients only when all are finite;
    * apex apex/amp/scaler.py @ cb65b8ed~1 with a number for ``loss_scale``: ``update_scale``
      returns should_skip False when not dynamic -- the overflowed step is APPLIED;
    * tf-keras tf_keras/mixed_precision/loss_scale_optimizer.py ``dynamic=False``: should_apply_grads
      True -- APPLIED.
    """

    def __init__(self, scale: float, skips_overflow: bool):
        self.scale, self.skips_overflow, self.skipped = f32(scale), skips_overflow, False

    def update(self, overflow: bool) -> None:
        self.skipped = bool(overflow) and self.skips_overflow


# -------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedZeroRule:
    """deepspeedai/DeepSpeed deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale
    (what ZeRO stages 1-3 use), at edaa7221 (v0.19.6) and at e440506be~1 (before v0.17.1).

    e440506be ("Improve overflow handling in ZeRO", first released in v0.17.1) changed the growth
    test from ``(cur_iter - last_overflow_iter) % scale_window == 0`` to ``stable_interval > 0 and
    stable_interval % scale_window == 0`` with ``stable_interval = cur_iter - last_overflow_iter - 1``.
    Python floats; scale_factor 2. ``raise_error_at_min_scale`` is True (ZeRO never passes it):
    an overflow that would back off a scale already at min_scale raises ``Exception``.
    """

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, stable_interval):
        self.cur_scale, self.scale_factor = init_scale, 2.0
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis, self.stable_interval = consecutive_hysteresis, stable_interval
        self.raise_error_at_min_scale = True
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.skipped = False

    @property
    def scale(self) -> float:
        return self.cur_scale

    def _grows(self) -> bool:
        if not self.stable_interval:
            return (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0
        stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
        return stable_interval > 0 and stable_interval % self.scale_window == 0

    def update(self, overflow: bool) -> None:
        self.skipped = bool(overflow)
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if self._grows():
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class DeepSpeedFP16Rule:
    """deepspeedai/DeepSpeed deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer) and
    unfused_optimizer.py (FP16_UnfusedOptimizer) ``_update_scale`` @ edaa7221: no hysteresis, no
    raise at the floor, the stable-interval growth test (these optimizers have had it since 2020).
    Python floats; scale_factor 2."""

    def __init__(self, cur_scale, scale_window, min_loss_scale):
        self.cur_scale, self.scale_factor = cur_scale, 2.0
        self.scale_window, self.min_loss_scale = scale_window, min_loss_scale
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.skipped = False

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, skip: bool) -> None:
        if skip:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        self.skipped = bool(skip)


# ------------------------------------------------------------------------------------- apex
class ApexAmpRule:
    """NVIDIA/apex apex/amp/scaler.py @ cb65b8ed~1 (amp was removed in cb65b8ed), LossScaler.

    ``loss_scale="dynamic"``: Python floats, /2 on an overflow (not below min_loss_scale when that is
    truthy), x2 (not above max_loss_scale) after scale_window unskipped steps, the initial scale
    ``min(max_loss_scale, init_scale)``. A number: static, and ``update_scale`` returns should_skip
    False (the overflow is not even checked), so the step is applied.
    """

    def __init__(self, loss_scale, init_scale=2.0**16, scale_factor=2.0, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0**24):  # fmt: skip
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        self._max_loss_scale, self._min_loss_scale = max_loss_scale, min_loss_scale
        self._scale_seq_len, self._unskipped = scale_window, 0
        self.skipped = False

    @property
    def scale(self) -> float:
        return self._loss_scale

    def update(self, has_overflow: bool) -> None:
        if has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        self.skipped = should_skip


class ApexHysteresisRule:
    """NVIDIA/apex csrc/update_scale_hysteresis.cu @ 6424da3b, update_scale_hysteresis_cuda_kernel.

    ``float * double`` products stored to a float (one rounding: ``f32`` of the double product);
    a growth past float32's range is not stored, a backoff is not checked (it reaches subnormals and
    0). The hysteresis tracker is refilled by every good step and keeps falling on more overflows.
    The caller (torch's GradScaler step protocol) skips an overflowed step.
    """

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = f32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis
        self.skipped = False

    def update(self, found_inf: bool) -> None:
        self.skipped = bool(found_inf)
        if found_inf:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:
                self.growth_tracker = 0
                return
            self.scale = f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                new_scale = f32(self.scale * self.growth_factor)
                if np.isfinite(new_scale):
                    self.scale = new_scale
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
            self.hysteresis_tracker = self.hysteresis


# ----------------------------------------------------------------------------------- fairseq
class FairseqRule:
    """facebookresearch/fairseq fairseq/optim/dynamic_loss_scaler.py @ 0d77035e, DynamicLossScaler,
    as fairseq/optim/fp16_optimizer.py drives it: ``clip_grad_norm`` calls ``check_overflow`` (an
    overflow raises OverflowError, which the trainer catches and skips the step), a good step calls
    ``update()`` after the optimizer step. Python floats. The overflow that leaves the scale <=
    min_loss_scale restores the previous scale and raises FloatingPointError (training stops).
    """

    def __init__(self, init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0, threshold=None,
                 min_loss_scale=1e-4):  # fmt: skip
        self.loss_scale, self.scale_factor, self.scale_window = init_scale, scale_factor, scale_window
        self.tolerance, self.threshold, self.min_loss_scale = tolerance, threshold, min_loss_scale
        self._iter, self._last_overflow_iter, self._last_rescale_iter = 0, -1, -1
        self._overflows_since_rescale = 0
        self.skipped = False

    @property
    def scale(self) -> float:
        return self.loss_scale

    def _update(self) -> None:  # DynamicLossScaler.update
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def _decrease_loss_scale(self) -> None:
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def _check_overflow(self) -> None:  # DynamicLossScaler.check_overflow, on an overflow
        prev_scale = self.loss_scale
        iter_since_rescale = self._iter - self._last_rescale_iter
        if iter_since_rescale == 0:
            iter_since_rescale = 1000
        self._last_overflow_iter = self._iter
        self._overflows_since_rescale += 1
        pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
        if pct_overflow >= self.tolerance:
            self._decrease_loss_scale()
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0
        if self.loss_scale <= self.min_loss_scale:
            self.loss_scale = prev_scale
            raise FloatingPointError(f"Minimum loss scale reached ({self.min_loss_scale}).")
        self._iter += 1  # then OverflowError: the trainer skips the step

    def update(self, overflow: bool) -> None:
        self.skipped = bool(overflow)
        if overflow:
            self._check_overflow()
        else:
            self._update()


# ----------------------------------------------------------------------- Keras and TensorFlow
class Keras3Rule:
    """keras-team/keras keras/src/optimizers/loss_scale_optimizer.py @ 054e2952, LossScaleOptimizer
    (``_stateful_handle_finite_grads`` / ``_stateful_handle_non_finite_grads``): a float32 variable,
    x2 when ``step_counter == dynamic_growth_steps - 1`` (no finite check), /2 on a non-finite
    gradient with NO floor; the non-finite step is skipped."""

    def __init__(self, initial_scale=2.0**15, dynamic_growth_steps=2000):
        self.dynamic_scale, self.step_counter = F32(initial_scale), 0
        self.dynamic_growth_steps, self.skipped = dynamic_growth_steps, False

    @property
    def scale(self) -> float:
        return float(self.dynamic_scale)

    def update(self, overflow: bool) -> None:
        with np.errstate(over="ignore"):
            if not overflow:
                if self.step_counter == self.dynamic_growth_steps - 1:
                    self.step_counter, self.dynamic_scale = 0, self.dynamic_scale * F32(2.0)
                else:
                    self.step_counter += 1
            else:
                self.step_counter, self.dynamic_scale = 0, self.dynamic_scale / F32(2.0)
        self.skipped = bool(overflow)


class TfKerasDynamicRule:
    """keras-team/tf-keras tf_keras/mixed_precision/loss_scale_optimizer.py @ 6add81a9,
    _DynamicLossScaleState.update: a float32 variable; a finite step grows (``_assign_if_finite``:
    x multiplier unless that is inf) when ``counter + 1 >= growth_steps``; a non-finite one sets
    ``maximum(scale / multiplier, 1)`` -- floor 1 -- and is skipped (should_apply_gradients False)."""

    def __init__(self, initial_loss_scale, growth_steps, multiplier=2.0):
        self.current_loss_scale, self.counter = F32(initial_loss_scale), 0
        self.growth_steps, self.multiplier = int(growth_steps), F32(multiplier)
        self.skipped = False

    @property
    def scale(self) -> float:
        return float(self.current_loss_scale)

    def update(self, overflow: bool) -> None:
        with np.errstate(over="ignore"):
            if not overflow:
                if self.counter + 1 >= self.growth_steps:
                    new_loss_scale = self.current_loss_scale * self.multiplier
                    if np.isfinite(new_loss_scale):
                        self.current_loss_scale = new_loss_scale
                    self.counter = 0
                else:
                    self.counter += 1
            else:
                self.counter = 0
                self.current_loss_scale = max(self.current_loss_scale / self.multiplier, F32(1))
        self.skipped = bool(overflow)


class TF1ExponentialRule(TensorFlowExponentialRef):
    """tensorflow/tensorflow tensorflow/contrib/mixed_precision/python/loss_scale_manager.py
    @ 813c55a9, ExponentialUpdateLossScaleManager.update_loss_scale (float32; the rule is
    scale_rules.TensorFlowExponentialRef); contrib LossScaleOptimizer skips non-finite steps."""

    skipped = False

    def update(self, overflow: bool) -> None:
        super().update(overflow)
        self.skipped = bool(overflow)


# ------------------------------------------------------------------ the peers' configurations
def torch_rule(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    return TorchRule(init_scale, growth_factor, backoff_factor, growth_interval)


def megatron_rule(initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000,
                  hysteresis=2, loss_scale=None):  # fmt: skip
    # megatron/core/optimizer/__init__.py: ConstantGradScaler(loss_scale) if loss_scale, else dynamic.
    if loss_scale:
        return FixedScale(loss_scale, skips_overflow=True)
    return MegatronDynamicRule(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis)


def deepspeed_rule(initial_scale_power=16, loss_scale_window=1000, hysteresis=2, consecutive_hysteresis=False,
                   min_loss_scale=1, loss_scale=0, optimizer="zero", version="0.17.1"):  # fmt: skip
    # deepspeed/runtime/precision_config.py: loss_scale 0 is dynamic, from 2**initial_scale_power.
    if loss_scale > 0:
        return FixedScale(loss_scale, skips_overflow=True)
    init = 2.0**initial_scale_power
    if optimizer == "fp16":
        return DeepSpeedFP16Rule(init, loss_scale_window, min_loss_scale)
    new_rule = tuple(int(p) for p in version.split(".")[:3]) >= (0, 17, 1)
    return DeepSpeedZeroRule(init, loss_scale_window, min_loss_scale, hysteresis, consecutive_hysteresis, new_rule)


def apex_rule(loss_scale="dynamic", init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
    rule = ApexAmpRule(loss_scale, init_scale, 2.0, scale_window, min_loss_scale, max_loss_scale)
    return rule if rule.dynamic else FixedScale(loss_scale, skips_overflow=False)


def apex_hysteresis_rule(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=2):
    return ApexHysteresisRule(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis)


def fairseq_rule(fp16_init_scale=128, fp16_scale_window=None, fp16_scale_tolerance=0.0, threshold_loss_scale=None,
                 min_loss_scale=1e-4, distributed_world_size=1, update_freq=1):  # fmt: skip
    # fairseq/optim/fp16_optimizer.py: the window's default from the data-parallel size and update_freq.
    window = int(2**14 / distributed_world_size / update_freq) if fp16_scale_window is None else fp16_scale_window
    return FairseqRule(fp16_init_scale, 2.0, window, fp16_scale_tolerance, threshold_loss_scale, min_loss_scale)


def keras_rule(initial_scale=2.0**15, dynamic_growth_steps=2000):
    return Keras3Rule(initial_scale, dynamic_growth_steps)


def tf_keras_rule(dynamic=True, initial_scale=None, dynamic_growth_steps=None):
    # BaseLossScaleOptimizer.__init__: defaults 2**15 and 2000 when dynamic; a fixed scale needs initial_scale.
    if not dynamic:
        if initial_scale is None:
            raise ValueError('"initial_scale" must be specified if "dynamic" is False')
        return FixedScale(initial_scale, skips_overflow=False)
    initial = 2.0**15 if initial_scale is None else initial_scale
    return TfKerasDynamicRule(initial, 2000 if dynamic_growth_steps is None else dynamic_growth_steps)


def tf1_rule(init_loss_scale=None, incr_every_n_steps=None, decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8,
             loss_scale=None):  # fmt: skip
    if loss_scale is not None:  # FixedLossScaleManager: "loss scale must be at least 1."
        if loss_scale < 1:
            raise ValueError("loss scale must be at least 1.")
        return FixedScale(loss_scale, skips_overflow=True)
    return TF1ExponentialRule(init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio)


#: Preset name -> the peer's configuration turned into its rule (same arguments as ``tritonscale.presets``).
RULES: dict[str, Callable] = {
    "torch": torch_rule,
    "megatron": megatron_rule,
    "deepspeed": deepspeed_rule,
    "apex": apex_rule,
    "apex-hysteresis": apex_hysteresis_rule,
    "fairseq": fairseq_rule,
    "keras": keras_rule,
    "tf-keras": tf_keras_rule,
    "tf1": tf1_rule,
}


# ------------------------------------------------------------------------------- the harness
def follow(scaler, rule, overflows, backend, no_host_reads=None) -> list[float]:
    """Drive ``scaler`` through its real API (tests/oracles/scale_rules.py's Loop: backward, inf
    injected, step, update) and ``rule`` side by side; after every update assert the same float32
    scale bits, the same skip (the parameters unchanged exactly when skipped) and the same raise
    (then stop, as training does). ``no_host_reads``: a context that forbids device reads around
    each step; the optimizer is then a fused SGD, which takes the skip flag on the device (a plain
    one must read it, as with torch's GradScaler). Returns the scales seen."""
    loop, scales = Loop(scaler, backend), []
    if no_host_reads is not None:
        loop.opt = torch.optim.SGD([loop.param], lr=1e-3, fused=True)
    no_host_reads = no_host_reads or contextlib.nullcontext
    for i, overflow in enumerate(overflows):
        before = loop.param.detach().clone()
        ours = theirs = None
        try:
            with no_host_reads():
                loop.step(overflow)
        except Exception as error:  # noqa: BLE001 -- compared with the peer's raise below
            ours = error
        try:
            rule.update(overflow)
        except Exception as error:  # noqa: BLE001
            theirs = error
        assert (ours is None) == (theirs is None), f"update {i}: tritonscale raised {ours!r}, the peer {theirs!r}"
        assert bits(scaler.get_scale()) == bits(rule.scale), f"update {i}: {scaler.get_scale()!r} != {rule.scale!r}"
        scales.append(scaler.get_scale())
        if theirs is not None:
            return scales
        changed = not torch.equal(before.view(torch.int32), loop.param.detach().view(torch.int32))  # NaN-safe
        assert changed != rule.skipped, f"update {i}: skipped {not changed}, the peer {rule.skipped}"
        assert scaler.last_step_skipped() == rule.skipped, f"update {i}: last_step_skipped"
    return scales
