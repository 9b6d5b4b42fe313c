"""Every peer's loss-scale rule in one line, by the peer's own argument names and defaults.

Each function takes the arguments its framework takes (DeepSpeed's ``fp16`` config keys,
Megatron-LM's ``DynamicGradScaler``, fairseq's ``--fp16-*`` options, ...) and returns a
``PeerPreset``: the initial scale that framework starts from and the ``LossScalePolicy`` that gives
its scale trajectory and its skipped steps bit for bit, in the peer's own arithmetic:

* torch's update multiplies the float32 scale by a float64 factor, rounded once to float32; so
  do apex's kernel and every peer that keeps its scale in a Python float with factor 2 (DeepSpeed,
  fairseq, apex amp), where halving and doubling are exact in float32 too;
* Megatron-LM keeps its factors in float32 tensors, and TensorFlow/Keras multiply float32
  variables: their presets round the factors to float32 (the product of two float32 numbers,
  rounded once, is the same in float64 and float32).

Where a peer's arithmetic leaves float32's normal range (a scale grown past float32's max, one
backed off below 2**-126), the trajectories part: docs/policies.md says how, per peer.

Example::

    scaler = tritonscale.GradScaler("cuda", policy=tritonscale.presets.deepspeed(loss_scale_window=500))
    scaler = tritonscale.GradScaler("cuda", policy="megatron")   # the peer's defaults
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ScalerConfigError
from .loss_scale_policy import LossScalePolicy
from .policy_forms import as_float32


@dataclass(frozen=True)
class PeerPreset:
    """A peer's rule: ``init_scale`` (where it starts) and ``policy`` (how the scale moves and which
    steps are skipped); ``source`` names the file the rule was read from."""

    name: str
    init_scale: float
    policy: LossScalePolicy
    source: str


def torch(
    init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000
) -> PeerPreset:
    """torch.amp.GradScaler: the defaults of this library."""
    policy = LossScalePolicy(
        growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval
    )
    return _preset("torch", init_scale, policy, "pytorch/pytorch torch/amp/grad_scaler.py (torch 2.13)")


def megatron(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    loss_scale: float | None = None,
) -> PeerPreset:
    """Megatron-LM's ``DynamicGradScaler`` (its config's defaults: ``initial_loss_scale=2**32``,
    ``min_loss_scale=1``, ``loss_scale_window=1000``, ``hysteresis=2``); ``loss_scale=x``: its
    ``ConstantGradScaler`` (overflowed steps still skipped). Factors and floor are float32 tensors
    there: rounded to float32 here (growth 1.1 is 1.10000002384...)."""
    source = "NVIDIA/Megatron-LM megatron/core/optimizer/grad_scaler.py @ 00caa53a"
    if loss_scale:  # Megatron builds a ConstantGradScaler for a truthy loss_scale
        return _preset("megatron", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source)
    policy = LossScalePolicy(
        growth_factor=as_float32(growth_factor),
        backoff_factor=as_float32(backoff_factor),
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=as_float32(min_scale),
    )
    return _preset("megatron", initial_scale, policy, source)


#: The DeepSpeed release whose ZeRO optimizers (DynamicLossScaler) first grew one step later after an
#: overflow (commit e440506be, "Improve overflow handling in ZeRO"); FP16_Optimizer has since 0.3.0.
DEEPSPEED_STABLE_INTERVAL = (0, 17, 1)


def deepspeed(
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    loss_scale: float = 0,
    optimizer: str = "zero",
    version: str | None = None,
) -> PeerPreset:
    """DeepSpeed's ``fp16`` config (its keys and defaults). ``optimizer``: "zero" for the ZeRO
    optimizers' ``DynamicLossScaler`` (hysteresis, an error once an overflow meets ``min_loss_scale``),
    "fp16" for ``FP16_Optimizer``/``FP16_UnfusedOptimizer`` (no hysteresis, no error). ``version``:
    the DeepSpeed release ("0.16.9"; None: the current rule). Both grow after ``loss_scale_window``
    good steps, the first after an overflow (and at the start) one step later -- ZeRO only from 0.17.1.
    ``loss_scale > 0``: a static scale, overflowed steps skipped."""
    if optimizer not in ("zero", "fp16"):
        raise ScalerConfigError(
            f"optimizer must be 'zero' (ZeRO's DynamicLossScaler) or 'fp16' (FP16_Optimizer), got {optimizer!r}"
        )
    rule = (
        "loss_scaler.py DynamicLossScaler.update_scale" if optimizer == "zero" else "fused_optimizer.py _update_scale"
    )
    source = f"deepspeedai/DeepSpeed deepspeed/runtime/fp16/{rule} @ edaa7221"
    if loss_scale:
        return _preset("deepspeed", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source)
    delayed = optimizer == "fp16" or version is None or _release(version) >= DEEPSPEED_STABLE_INTERVAL
    zero = optimizer == "zero"
    policy = LossScalePolicy(
        growth_interval=loss_scale_window,
        hysteresis=hysteresis if zero else 1,
        consecutive_hysteresis=bool(consecutive_hysteresis) and zero,
        min_scale=min_loss_scale,
        on_min_scale="raise" if zero else "clamp",
        growth_delay=1 if delayed else 0,
    )
    return _preset("deepspeed", 2.0**initial_scale_power, policy, source)


def apex(
    loss_scale: str | float = "dynamic",
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> PeerPreset:
    """apex.amp's ``LossScaler`` (``amp.initialize(loss_scale=..., min_loss_scale=...,
    max_loss_scale=...)``; amp left apex in 2025). It starts at ``min(max_loss_scale, init_scale)``;
    a static ``loss_scale`` applies overflowed steps (amp skips only when dynamic)."""
    source = "NVIDIA/apex apex/amp/scaler.py LossScaler.update_scale @ cb65b8ed~1"
    if loss_scale != "dynamic":
        return _preset("apex", loss_scale, LossScalePolicy.fixed(skip_on_overflow=False), source)
    policy = LossScalePolicy(growth_interval=scale_window, min_scale=min_loss_scale or None, max_scale=max_loss_scale)
    return _preset("apex", min(max_loss_scale, init_scale), policy, source)


def apex_hysteresis(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 2,
) -> PeerPreset:
    """apex's ``amp_C.update_scale_hysteresis`` kernel (NeMo's scaler): torch's rule and arithmetic
    with a hysteresis budget that every good step refills."""
    rule = torch(init_scale, growth_factor, backoff_factor, growth_interval).policy
    policy = dataclasses.replace(rule, hysteresis=hysteresis, consecutive_hysteresis=True)
    return _preset("apex-hysteresis", init_scale, policy, "NVIDIA/apex csrc/update_scale_hysteresis.cu @ 16aaa783")


def fairseq(
    fp16_init_scale: float = 2.0**7,
    fp16_scale_window: int | None = None,
    fp16_scale_tolerance: float = 0.0,
    threshold_loss_scale: float | None = None,
    min_loss_scale: float = 1e-4,
    distributed_world_size: int = 1,
    update_freq: int = 1,
) -> PeerPreset:
    """fairseq's ``DynamicLossScaler`` as its ``FP16Optimizer`` builds it from the ``--fp16-*``
    options: the window defaults to ``2**14 / distributed_world_size / update_freq``; a backoff only
    once the share of overflowed updates since the scale last changed reaches the tolerance, never
    below ``threshold_loss_scale``; an overflow that leaves the scale at or below ``min_loss_scale``
    raises FloatingPointError."""
    window = fp16_scale_window if fp16_scale_window is not None else int(2**14 / distributed_world_size / update_freq)
    policy = LossScalePolicy(
        growth_interval=window,
        overflow_tolerance=fp16_scale_tolerance,
        min_scale=threshold_loss_scale,
        raise_at_scale=min_loss_scale,
    )
    return _preset(
        "fairseq", fp16_init_scale, policy, "facebookresearch/fairseq fairseq/optim/dynamic_loss_scaler.py @ 0d77035e"
    )


def keras(initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000) -> PeerPreset:
    """Keras 3's ``LossScaleOptimizer``: halve on a non-finite gradient with no floor, double after
    ``dynamic_growth_steps`` finite ones (Keras 3 has no fixed scale)."""
    policy = LossScalePolicy(growth_interval=dynamic_growth_steps)
    return _preset(
        "keras", initial_scale, policy, "keras-team/keras keras/src/optimizers/loss_scale_optimizer.py @ 054e2952"
    )


def tf_keras(
    dynamic: bool = True, initial_scale: float | None = None, dynamic_growth_steps: int | None = None
) -> PeerPreset:
    """tf.keras 2's (TensorFlow 2's) ``LossScaleOptimizer``: dynamic, never below 1; ``dynamic=False``
    needs ``initial_scale`` and applies steps whatever their gradients hold (as TensorFlow does)."""
    source = "keras-team/tf-keras tf_keras/mixed_precision/loss_scale_optimizer.py @ 6add81a9"
    if not dynamic:
        if initial_scale is None:
            raise ScalerConfigError('"initial_scale" must be specified if "dynamic" is False (as in tf.keras)')
        if dynamic_growth_steps is not None:
            raise ScalerConfigError(
                f'"dynamic_growth_steps" must be None if "dynamic" is False, got {dynamic_growth_steps}'
            )
        return _preset("tf-keras", initial_scale, LossScalePolicy.fixed(skip_on_overflow=False), source)
    steps = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
    policy = LossScalePolicy(growth_interval=steps, min_scale=1.0)
    return _preset("tf-keras", 2.0**15 if initial_scale is None else initial_scale, policy, source)


def tf1(
    init_loss_scale: float | None = None,
    incr_every_n_steps: int | None = None,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    loss_scale: float | None = None,
) -> PeerPreset:
    """TensorFlow 1.x contrib's ``LossScaleOptimizer`` with an ``ExponentialUpdateLossScaleManager``
    (its two required arguments first), or with ``FixedLossScaleManager(loss_scale)``; that optimizer
    skips every step with a non-finite gradient."""
    source = "tensorflow/tensorflow tensorflow/contrib/mixed_precision/python/loss_scale_manager.py (TF 1.15)"
    if loss_scale is not None:
        return _preset("tf1", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source)
    if init_loss_scale is None or incr_every_n_steps is None:
        raise ScalerConfigError(
            "tf1: ExponentialUpdateLossScaleManager needs init_loss_scale and incr_every_n_steps "
            "(or pass loss_scale= for a FixedLossScaleManager)"
        )
    policy = LossScalePolicy.tensorflow_exponential(incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio)
    return _preset("tf1", init_loss_scale, policy, source)


PRESETS: dict[str, Callable[..., PeerPreset]] = {
    "torch": torch,
    "megatron": megatron,
    "deepspeed": deepspeed,
    "apex": apex,
    "apex-hysteresis": apex_hysteresis,
    "fairseq": fairseq,
    "keras": keras,
    "tf-keras": tf_keras,
    "tf1": tf1,
}


def preset(name: str, **peer_args: Any) -> PeerPreset:
    """The preset named ``name`` (any case; ``_`` or ``-``) with the peer's own arguments.
    Example: ``preset("deepspeed", hysteresis=4)``, ``preset("TF_Keras")``."""
    key = name.lower().replace("_", "-") if isinstance(name, str) else name
    if key not in PRESETS:
        raise ScalerConfigError(f"unknown preset {name!r}; the presets are {sorted(PRESETS)}")
    return PRESETS[key](**peer_args)


def _preset(name: str, init_scale: float, policy: LossScalePolicy, source: str) -> PeerPreset:
    """The preset, its policy validated: a bad argument is named with the peer it was given for."""
    try:
        return PeerPreset(name, float(init_scale), policy.validate(), source)
    except ScalerConfigError as error:
        raise ScalerConfigError(f"presets {name!r}: {error}") from None


def _release(version: str) -> tuple[int, ...]:
    """A release's first three numbers: "0.17.1" -> (0, 17, 1), "0.16.9+cu121" -> (0, 16, 9)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if found is None:
        raise ScalerConfigError(f"version must be a DeepSpeed release such as '0.16.9', got {version!r}")
    return tuple(int(part or 0) for part in found.groups())
