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

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ScalerConfigError
from .rounding import as_float32
from .knob_validation import check_positive_int, check_scale_value, is_int, is_number
from .loss_scale_policy import LossScalePolicy


@dataclass(frozen=True)
class PeerPreset:
    """A peer's rule: ``init_scale`` (where it starts) and ``policy`` (how the scale moves and which
    steps are skipped); ``source`` names the file the rule was read from.

    Args:
        name: the preset's name ("deepspeed").
        init_scale: the scale the peer starts from.
        policy: the ``LossScalePolicy`` of the peer's rule.
        source: the peer's file the rule was read from.
    """

    name: str
    init_scale: float
    policy: LossScalePolicy
    source: str


def torch(
    init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000
) -> PeerPreset:
    """torch.amp.GradScaler: the defaults of this library.

    Args:
        init_scale: the initial scale (2**16).
        growth_factor: the growth factor (2.0).
        backoff_factor: the backoff factor (0.5).
        growth_interval: the good steps before a growth (2000).

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value.
    """
    _check_args("torch", "a number", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor)
    _check_args("torch", "an int", growth_interval=growth_interval)
    policy = LossScalePolicy(
        growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval
    )
    names = {"growth_factor": "growth_factor", "backoff_factor": "backoff_factor", "growth_interval": "growth_interval"}
    source = "pytorch/pytorch torch/amp/grad_scaler.py (torch 2.13)"
    return _preset("torch", init_scale, policy, source, "init_scale", names)


def megatron(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    loss_scale: float | None = None,
    *,
    initial_loss_scale: float | None = None,
    min_loss_scale: float | None = None,
    loss_scale_window: int | None = None,
) -> PeerPreset:
    """Megatron-LM's ``DynamicGradScaler`` (its config's defaults: ``initial_loss_scale=2**32``,
    ``min_loss_scale=1``, ``loss_scale_window=1000``, ``hysteresis=2``); ``loss_scale=x``: its
    ``ConstantGradScaler`` (overflowed steps still skipped). Factors and floor are float32 tensors
    there: rounded to float32 here (growth 1.1 is 1.10000002384...). Megatron's config names
    (``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``, as its ``OptimizerConfig`` and
    command line spell them) are taken too, in place of the scaler's; setting both names is refused.

    Args:
        initial_scale: the initial scale (2**32).
        min_scale: the scale's floor (1.0), rounded to float32.
        growth_factor: the growth factor (2.0), rounded to float32.
        backoff_factor: the backoff factor (0.5), rounded to float32.
        growth_interval: the good steps before a growth (1000).
        hysteresis: the overflows before a backoff (2).
        loss_scale: a constant scale (``ConstantGradScaler``); None or 0 (the default) for the dynamic one.
        initial_loss_scale: Megatron's config name for ``initial_scale``; None: not given.
        min_loss_scale: Megatron's config name for ``min_scale``; None: not given.
        loss_scale_window: Megatron's config name for ``growth_interval``; None: not given.

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value, or both names of one knob set.
    """
    _check_args("megatron", "a number or None", initial_loss_scale=initial_loss_scale, min_loss_scale=min_loss_scale)
    _check_args("megatron", "an int or None", loss_scale_window=loss_scale_window)
    init_name, initial_scale = _one_of(
        "initial_loss_scale", initial_loss_scale, "initial_scale", initial_scale, 2.0**32
    )
    floor_name, min_scale = _one_of("min_loss_scale", min_loss_scale, "min_scale", min_scale, 1.0)
    window_name, growth_interval = _one_of(
        "loss_scale_window", loss_scale_window, "growth_interval", growth_interval, 1000
    )
    numbers = {"initial_scale": initial_scale, "min_scale": min_scale, "growth_factor": growth_factor}
    _check_args("megatron", "a number", **numbers, backoff_factor=backoff_factor)
    _check_args("megatron", "an int", growth_interval=growth_interval, hysteresis=hysteresis)
    _check_args("megatron", "a number or None", loss_scale=loss_scale)
    source = "NVIDIA/Megatron-LM megatron/core/optimizer/grad_scaler.py @ 00caa53a"
    if loss_scale:  # Megatron builds a ConstantGradScaler for a truthy loss_scale
        return _preset("megatron", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source, "loss_scale")
    policy = LossScalePolicy(
        growth_factor=as_float32(growth_factor),
        backoff_factor=as_float32(backoff_factor),
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=as_float32(min_scale),
    )
    names = {"growth_interval": window_name, "min_scale": floor_name, "growth_factor": "growth_factor",
             "backoff_factor": "backoff_factor"}  # fmt: skip
    return _preset("megatron", initial_scale, policy, source, init_name, names)


def _one_of(
    config_name: str, config_value: Any, scaler_name: str, scaler_value: Any, default: Any
) -> tuple[str, Any]:
    """Megatron's config name for a knob, or its DynamicGradScaler's: whichever was set, not both;
    returned with the name it was set by, for the refusals."""
    if config_value is None:
        return scaler_name, scaler_value
    if scaler_value != default:
        raise ScalerConfigError(
            f"presets 'megatron': {config_name}={config_value!r} and {scaler_name}={scaler_value!r} name the same "
            "knob (Megatron's config and its DynamicGradScaler); set one of them"
        )
    return config_name, config_value


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
    ``loss_scale > 0``: a static scale, overflowed steps skipped.

    Args:
        initial_scale_power: the initial scale is ``2**initial_scale_power`` (16).
        loss_scale_window: the good steps before a growth (1000).
        hysteresis: the overflows before a backoff, ZeRO only (2).
        consecutive_hysteresis: whether every good step refills the hysteresis, ZeRO only (False).
        min_loss_scale: the scale's floor (1.0).
        loss_scale: a static scale when > 0; 0 (the default) for the dynamic scaler.
        optimizer: "zero" (the default) or "fp16".
        version: the DeepSpeed release whose rule to follow; None (the default) for the current one.

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value (a ``loss_scale_window`` below 1, an
            unknown ``optimizer``).
    """
    _check_args("deepspeed", "a number", min_loss_scale=min_loss_scale, loss_scale=loss_scale)
    ints = {"initial_scale_power": initial_scale_power, "loss_scale_window": loss_scale_window}
    _check_args("deepspeed", "an int", **ints, hysteresis=hysteresis)
    if loss_scale_window < 1 and not loss_scale:
        # DeepSpeed reads its fp16 section only when fp16 is on; a preset is built before any scaler
        # (enabled or not) sees it, so it is refused here, saying what a run without fp16 passes.
        raise ScalerConfigError(
            f"presets.deepspeed(loss_scale_window={loss_scale_window!r}): the dynamic loss scaler grows after "
            "loss_scale_window good steps, an int >= 1. DeepSpeed ignores its fp16 section when fp16 is off; "
            "a run without loss scaling (bf16, GradScaler(enabled=False)) passes no policy=, and a static "
            "scale is presets.deepspeed(loss_scale=x)"
        )
    if optimizer not in ("zero", "fp16"):
        raise ScalerConfigError(
            f"optimizer must be 'zero' (ZeRO's DynamicLossScaler) or 'fp16' (FP16_Optimizer), got {optimizer!r}"
        )
    rule = (
        "loss_scaler.py DynamicLossScaler.update_scale" if optimizer == "zero" else "fused_optimizer.py _update_scale"
    )
    source = f"deepspeedai/DeepSpeed deepspeed/runtime/fp16/{rule} @ edaa7221"
    if loss_scale:
        return _preset("deepspeed", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source, "loss_scale")
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
    names = {"growth_interval": "loss_scale_window", "min_scale": "min_loss_scale"}
    return _preset("deepspeed", _power_of_two(initial_scale_power), policy, source, "2**initial_scale_power", names)


def _power_of_two(power: int) -> float:
    """``2.0**power``, inf past the float range (where ``2.0**power`` raises), for the scale check to refuse."""
    try:
        return 2.0**power
    except OverflowError:
        return float("inf")


def apex(
    loss_scale: str | float = "dynamic",
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> PeerPreset:
    """apex.amp's ``LossScaler`` (``amp.initialize(loss_scale=..., min_loss_scale=...,
    max_loss_scale=...)``; amp left apex in 2025). It starts at ``min(max_loss_scale, init_scale)``;
    a static ``loss_scale`` applies overflowed steps (amp skips only when dynamic). ``loss_scale``
    is read as amp reads it: "dynamic" (that spelling only), else ``float(loss_scale)`` -- a number,
    or a string holding one ("128", as apex's examples pass it from the command line).

    Args:
        loss_scale: "dynamic" (the default), or a static scale (a number or a string holding one).
        init_scale: the dynamic scaler's initial scale (2**16), capped at ``max_loss_scale``.
        scale_window: the good steps before a growth (2000).
        min_loss_scale: the scale's floor; None (the default) or 0 for none.
        max_loss_scale: the scale's ceiling (2**24).

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value.
    """
    loss_scale = _apex_loss_scale(loss_scale)
    _check_args("apex", "a number", init_scale=init_scale, max_loss_scale=max_loss_scale)
    _check_args("apex", "a number or None", min_loss_scale=min_loss_scale)
    _check_args("apex", "an int", scale_window=scale_window)
    source = "NVIDIA/apex apex/amp/scaler.py LossScaler.update_scale @ cb65b8ed~1"
    if loss_scale != "dynamic":
        return _preset("apex", loss_scale, LossScalePolicy.fixed(skip_on_overflow=False), source, "loss_scale")
    policy = LossScalePolicy(growth_interval=scale_window, min_scale=min_loss_scale or None, max_scale=max_loss_scale)
    names = {"growth_interval": "scale_window", "min_scale": "min_loss_scale", "max_scale": "max_loss_scale"}
    return _preset("apex", min(max_loss_scale, init_scale), policy, source, "init_scale", names)


def apex_hysteresis(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 2,
) -> PeerPreset:
    """apex's ``amp_C.update_scale_hysteresis`` kernel (NeMo's scaler): torch's rule and arithmetic
    with a hysteresis budget that every good step refills.

    Args:
        init_scale: the initial scale (2**16).
        growth_factor: the growth factor (2.0).
        backoff_factor: the backoff factor (0.5).
        growth_interval: the good steps before a growth (2000).
        hysteresis: the overflows before a backoff (2).

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value.
    """
    factors = {"growth_factor": growth_factor, "backoff_factor": backoff_factor}
    _check_args("apex_hysteresis", "a number", init_scale=init_scale, **factors)
    _check_args("apex_hysteresis", "an int", growth_interval=growth_interval, hysteresis=hysteresis)
    policy = LossScalePolicy(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=True,
    )
    names = {"growth_factor": "growth_factor", "backoff_factor": "backoff_factor", "growth_interval": "growth_interval"}
    source = "NVIDIA/apex csrc/update_scale_hysteresis.cu @ 16aaa783"
    return _preset("apex-hysteresis", init_scale, policy, source, "init_scale", names)


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
    raises FloatingPointError.

    Args:
        fp16_init_scale: the initial scale (2**7).
        fp16_scale_window: the good steps before a growth; None (the default) for
            ``2**14 / distributed_world_size / update_freq``.
        fp16_scale_tolerance: the share of overflowed updates that backs off (0.0: every overflow).
        threshold_loss_scale: the scale's floor; None (the default) for none.
        min_loss_scale: the scale at or below which an overflow raises (1e-4).
        distributed_world_size: the number of ranks, for the default window (1).
        update_freq: the gradient-accumulation steps per update, for the default window (1).

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value.
    """
    numbers = {"fp16_init_scale": fp16_init_scale, "fp16_scale_tolerance": fp16_scale_tolerance}
    _check_args("fairseq", "a number", **numbers, min_loss_scale=min_loss_scale)
    _check_args("fairseq", "a number or None", threshold_loss_scale=threshold_loss_scale)
    _check_args("fairseq", "an int", distributed_world_size=distributed_world_size, update_freq=update_freq)
    _check_args("fairseq", "an int or None", fp16_scale_window=fp16_scale_window)
    for arg, value in {"distributed_world_size": distributed_world_size, "update_freq": update_freq}.items():
        check_positive_int(f"presets.fairseq({arg}=...)", value)
    window_name = "fp16_scale_window"
    if fp16_scale_window is None:
        window_name = "fp16_scale_window's default 2**14 / distributed_world_size / update_freq"
    window = fp16_scale_window if fp16_scale_window is not None else int(2**14 / distributed_world_size / update_freq)
    policy = LossScalePolicy(
        growth_interval=window,
        overflow_tolerance=fp16_scale_tolerance,
        min_scale=threshold_loss_scale,
        raise_at_scale=min_loss_scale,
    )
    names = {"growth_interval": window_name, "overflow_tolerance": "fp16_scale_tolerance",
             "min_scale": "threshold_loss_scale", "raise_at_scale": "min_loss_scale"}  # fmt: skip
    source = "facebookresearch/fairseq fairseq/optim/dynamic_loss_scaler.py @ 0d77035e"
    return _preset("fairseq", fp16_init_scale, policy, source, "fp16_init_scale", names)


def keras(initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000) -> PeerPreset:
    """Keras 3's ``LossScaleOptimizer``: halve on a non-finite gradient with no floor, double after
    ``dynamic_growth_steps`` finite ones (Keras 3 has no fixed scale).

    Args:
        initial_scale: the initial scale (2**15).
        dynamic_growth_steps: the finite steps before a growth (2000).

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value.
    """
    _check_args("keras", "a number", initial_scale=initial_scale)
    _check_args("keras", "an int", dynamic_growth_steps=dynamic_growth_steps)
    policy = LossScalePolicy(growth_interval=dynamic_growth_steps)
    source = "keras-team/keras keras/src/optimizers/loss_scale_optimizer.py @ 054e2952"
    return _preset("keras", initial_scale, policy, source, "initial_scale", {"growth_interval": "dynamic_growth_steps"})


def tf_keras(
    dynamic: bool = True, initial_scale: float | None = None, dynamic_growth_steps: int | None = None
) -> PeerPreset:
    """tf.keras 2's (TensorFlow 2's) ``LossScaleOptimizer``: dynamic, never below 1; ``dynamic=False``
    needs ``initial_scale`` and applies steps whatever their gradients hold (as TensorFlow does).

    Args:
        dynamic: whether the scale is dynamic (True) or fixed.
        initial_scale: the initial (or, with ``dynamic=False``, the fixed) scale; None (the default)
            for 2**15 when dynamic.
        dynamic_growth_steps: the finite steps before a growth; None (the default) for 2000.

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value; with ``dynamic=False``, no
            ``initial_scale`` or a ``dynamic_growth_steps``.
    """
    _check_args("tf_keras", "a number or None", initial_scale=initial_scale)
    _check_args("tf_keras", "an int or None", dynamic_growth_steps=dynamic_growth_steps)
    source = "keras-team/tf-keras tf_keras/mixed_precision/loss_scale_optimizer.py @ 6add81a9"
    if not dynamic:
        if initial_scale is None:
            raise ScalerConfigError('"initial_scale" must be specified if "dynamic" is False (as in tf.keras)')
        if dynamic_growth_steps is not None:
            raise ScalerConfigError(
                f'"dynamic_growth_steps" must be None if "dynamic" is False, got {dynamic_growth_steps}'
            )
        fixed = LossScalePolicy.fixed(skip_on_overflow=False)
        return _preset("tf-keras", initial_scale, fixed, source, "initial_scale")
    steps = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
    policy = LossScalePolicy(growth_interval=steps, min_scale=1.0)
    init = 2.0**15 if initial_scale is None else initial_scale
    return _preset("tf-keras", init, policy, source, "initial_scale", {"growth_interval": "dynamic_growth_steps"})


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
    skips every step with a non-finite gradient.

    Args:
        init_loss_scale: the initial scale, required without ``loss_scale``.
        incr_every_n_steps: the good steps before a growth, required without ``loss_scale``.
        decr_every_n_nan_or_inf: the overflows before a backoff (2).
        incr_ratio: the growth factor (2.0).
        decr_ratio: the backoff factor (0.8).
        loss_scale: a fixed scale (``FixedLossScaleManager``); None (the default) for the exponential one.

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an argument of the wrong type or an invalid value, or neither ``loss_scale`` nor both
            required arguments.
    """
    _check_args("tf1", "a number or None", init_loss_scale=init_loss_scale, loss_scale=loss_scale)
    _check_args("tf1", "an int or None", incr_every_n_steps=incr_every_n_steps)
    _check_args("tf1", "an int", decr_every_n_nan_or_inf=decr_every_n_nan_or_inf)
    _check_args("tf1", "a number", incr_ratio=incr_ratio, decr_ratio=decr_ratio)
    source = "tensorflow/tensorflow tensorflow/contrib/mixed_precision/python/loss_scale_manager.py (TF 1.15)"
    if loss_scale is not None:
        return _preset("tf1", loss_scale, LossScalePolicy.fixed(skip_on_overflow=True), source, "loss_scale")
    if init_loss_scale is None or incr_every_n_steps is None:
        raise ScalerConfigError(
            "tf1: ExponentialUpdateLossScaleManager needs init_loss_scale and incr_every_n_steps "
            "(or pass loss_scale= for a FixedLossScaleManager)"
        )
    policy = LossScalePolicy.tensorflow_exponential(incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio)
    names = {"growth_interval": "incr_every_n_steps", "hysteresis": "decr_every_n_nan_or_inf",
             "growth_factor": "incr_ratio", "backoff_factor": "decr_ratio"}  # fmt: skip
    return _preset("tf1", init_loss_scale, policy, source, "init_loss_scale", names)


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
    Example: ``preset("deepspeed", hysteresis=4)``, ``preset("TF_Keras")``.

    Args:
        name: the preset's name, one of ``PRESETS``.
        peer_args: the arguments of that preset's function.

    Returns:
        a ``PeerPreset``: the peer's initial scale and its ``LossScalePolicy``.

    Raises:
        ScalerConfigError: an unknown name, or an argument the preset's function refuses.
    """
    key = name.lower().replace("_", "-") if isinstance(name, str) else name
    if key not in PRESETS:
        raise ScalerConfigError(f"unknown preset {name!r}; the presets are {sorted(PRESETS)}")
    return PRESETS[key](**peer_args)


def _preset(
    name: str,
    init_scale: float,
    policy: LossScalePolicy,
    source: str,
    init_name: str,
    names: dict[str, str] | None = None,
) -> PeerPreset:
    """The preset, its policy and initial scale validated: a bad value is refused with the peer it was
    given for and by the argument the user passed (``init_name`` for the initial scale, ``names``
    from a policy knob to the peer's argument that set it), the bounds checked where they live."""
    try:
        policy.validate(names)
        check_scale_value(init_name, init_scale)
    except ScalerConfigError as error:
        raise ScalerConfigError(f"presets {name!r}: {error}") from None
    return PeerPreset(name, float(init_scale), policy, source)


#: What a preset's argument takes, as ``_check_args`` says it, and the test of it.
_TAKES: dict[str, Callable[[Any], bool]] = {
    "a number": is_number,
    "an int": is_int,
    "a number or None": lambda value: value is None or is_number(value),
    "an int or None": lambda value: value is None or is_int(value),
}


def _check_args(preset: str, takes: str, **args: Any) -> None:
    """Refuse any of ``args`` (the peer's argument names) that is not what ``takes`` says (a key of
    ``_TAKES``): a string where a number goes ("1e-4" from a config file) would fail deep in the
    rule with an error that names nothing. The ranges are the policy's to check, in its words."""
    for arg, value in args.items():
        if not _TAKES[takes](value):
            raise ScalerConfigError(f"presets.{preset}({arg}=...) takes {takes}, got {type(value).__name__} {value!r}")


def _apex_loss_scale(loss_scale: Any) -> str | float:
    """apex amp's reading of ``loss_scale`` (its frontend's ``Properties``): "dynamic", else
    ``float(loss_scale)``. Any other string ("Dynamic", "auto") is refused, as amp refuses it."""
    if loss_scale == "dynamic" or is_number(loss_scale):
        return loss_scale
    if isinstance(loss_scale, str):
        try:
            return float(loss_scale)
        except ValueError:
            pass
    raise ScalerConfigError(
        f'presets.apex(loss_scale=...) takes "dynamic" (apex\'s spelling) or a number, '
        f"got {type(loss_scale).__name__} {loss_scale!r}"
    )


def _release(version: str) -> tuple[int, ...]:
    """A release's first three numbers: "0.17.1" -> (0, 17, 1), "0.16.9+cu121" -> (0, 16, 9)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if found is None:
        raise ScalerConfigError(f"version must be a DeepSpeed release such as '0.16.9', got {version!r}")
    return tuple(int(part or 0) for part in found.groups())


#: What ``tritonscale.presets`` offers: the presets by their peer's name, the lookup by name, the record.
__all__ = [
    "PRESETS",
    "PeerPreset",
    "apex",
    "apex_hysteresis",
    "deepspeed",
    "fairseq",
    "keras",
    "megatron",
    "preset",
    "tf1",
    "tf_keras",
    "torch",
]
