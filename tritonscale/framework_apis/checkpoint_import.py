"""Import the loss-scaler state of other frameworks' checkpoints into a GradScaler state_dict.

Each function takes the framework's own state (as saved) and returns a dict for
``GradScaler.load_state_dict``: the scale, the growth tracker, the hysteresis counter and the
knobs the checkpoint carries. Knobs a checkpoint does not carry (Megatron keeps them in its
config, not its state) come from the arguments, defaulting to that framework's defaults.

Key mapping (theirs -> ours):

* Megatron-LM ``DynamicGradScaler.state_dict()``: ``scale`` -> ``scale``, ``growth_tracker`` ->
  ``_growth_tracker``, ``hysteresis_tracker`` -> ``counters.hysteresis_left``.
* DeepSpeed FP16_Optimizer state: ``cur_scale`` -> ``scale``; ``cur_iter`` and
  ``last_overflow_iter`` -> ``_growth_tracker = (cur_iter - last_overflow_iter - 1) % scale_window``;
  ``scale_factor`` -> ``growth_factor`` (and 1/it -> ``backoff_factor``); ``scale_window`` ->
  ``growth_interval``; ``cur_hysteresis`` -> ``counters.hysteresis_left``.
* DeepSpeed ZeRO state: ``loss_scaler`` is the pickled DynamicLossScaler, with the attributes
  above plus ``min_scale`` -> ``min_scale``, ``delayed_shift`` -> ``hysteresis``,
  ``consecutive_hysteresis`` -> ``consecutive_hysteresis``, ``raise_error_at_min_scale`` ->
  ``on_min_scale="raise"``.
* apex ``amp.state_dict()``: ``loss_scalerN.loss_scale`` -> ``scale``, ``loss_scalerN.unskipped``
  -> ``_growth_tracker``.
"""

from __future__ import annotations

from typing import Any

from ..errors import ScalerConfigError


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def _require(state: Any, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ScalerConfigError(f"{what} is missing {missing}")


def _state(scale: float, tracker: int, growth_factor: float, backoff_factor: float, interval: int, knobs: dict,
           hysteresis_left: int) -> dict[str, Any]:  # fmt: skip
    return {
        "scale": scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": interval,
        "_growth_tracker": tracker,
        "policy": knobs,
        "counters": {"hysteresis_left": hysteresis_left},
    }


def from_megatron(
    state: dict[str, Any],
    *,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
) -> dict[str, Any]:
    """Megatron-LM ``DynamicGradScaler.state_dict()``; the knobs default to Megatron's config
    defaults (``min_loss_scale=1``, ``loss_scale_window=1000``, ``hysteresis=2``).

    Example::

        scaler.load_state_dict(from_megatron(checkpoint["optimizer"]["grad_scaler"]))
    """
    _require(state, ("scale", "growth_tracker", "hysteresis_tracker"), "Megatron grad scaler state")
    knobs = {"min_scale": min_scale, "hysteresis": hysteresis}
    left = max(int(_number(state["hysteresis_tracker"])), 0)
    return _state(_number(state["scale"]), int(_number(state["growth_tracker"])), growth_factor, backoff_factor,
                  growth_interval, knobs, left)  # fmt: skip


def from_deepspeed(
    state: dict[str, Any], *, hysteresis: int = 2, min_scale: float = 1.0, consecutive_hysteresis: bool = False
) -> dict[str, Any]:
    """DeepSpeed fp16 loss-scaler state: an FP16_Optimizer state dict (``cur_scale`` ...), or a
    ZeRO one whose ``loss_scaler`` entry is the pickled DynamicLossScaler. FP16_Optimizer does not
    save its hysteresis, floor or consecutive flag: they come from the arguments (DeepSpeed's config
    defaults ``hysteresis=2``, ``min_loss_scale=1``).

    Example::

        scaler.load_state_dict(from_deepspeed(torch.load(path, weights_only=False)["optimizer"]))
    """
    scaler = state.get("loss_scaler") if isinstance(state, dict) else None
    if scaler is not None and not isinstance(scaler, dict):
        fields = vars(scaler)
    elif isinstance(scaler, dict):
        fields = scaler
    else:
        fields = state
    _require(fields, ("cur_scale",), "DeepSpeed loss-scaler state")
    if not fields.get("dynamic_loss_scale", True) or "scale_window" not in fields:
        knobs = {"dynamic": False}
        return _state(_number(fields["cur_scale"]), 0, 2.0, 0.5, 2000, knobs, 1)
    _require(fields, ("cur_iter", "last_overflow_iter", "scale_window"), "DeepSpeed dynamic loss-scaler state")
    window = int(fields["scale_window"])
    if window < 1:
        raise ScalerConfigError(f"DeepSpeed loss-scaler state has scale_window={window}; it must be >= 1")
    factor = float(fields.get("scale_factor", 2.0))
    hysteresis = int(fields.get("delayed_shift", hysteresis))
    knobs = {
        "min_scale": float(fields.get("min_scale", min_scale)),
        "hysteresis": hysteresis,
        "consecutive_hysteresis": bool(fields.get("consecutive_hysteresis", consecutive_hysteresis)),
    }
    if fields.get("raise_error_at_min_scale", False):
        knobs["on_min_scale"] = "raise"
    # Good steps since the last overflow, modulo the window: what our growth tracker counts.
    tracker = (int(fields["cur_iter"]) - int(fields["last_overflow_iter"]) - 1) % window
    left = int(fields.get("cur_hysteresis", hysteresis))
    return _state(_number(fields["cur_scale"]), tracker, factor, 1.0 / factor, window, knobs, left)


def from_apex(state: dict[str, Any], *, index: int = 0, scale_window: int = 2000,
              max_loss_scale: float = 2.0**24, min_loss_scale: float | None = None) -> dict[str, Any]:  # fmt: skip
    """apex ``amp.state_dict()`` (``loss_scaler0`` ...); the knobs default to apex's.

    Example::

        scaler.load_state_dict(from_apex(checkpoint["amp"]))
    """
    key = f"loss_scaler{index}"
    _require(state, (key,), "apex amp state")
    _require(state[key], ("loss_scale", "unskipped"), f"apex amp state[{key!r}]")
    knobs = {"max_scale": max_loss_scale, "min_scale": min_loss_scale}
    return _state(_number(state[key]["loss_scale"]), int(state[key]["unskipped"]), 2.0, 0.5, scale_window, knobs, 1)
