"""Import the loss-scaler state of other frameworks' checkpoints into a GradScaler state_dict.

Each function takes the framework's own state (as saved) and returns a dict for
``GradScaler.load_state_dict``: the scale, the growth tracker and the other trackers, and every knob
of the peer's preset (``policy/peer_presets.py``) -- so the loaded scaler continues with the rule
that wrote the checkpoint, whatever the scaler was built with. Knobs a checkpoint does not carry
(Megatron keeps them in its config, not its state) come from the arguments, which are the peer's
own, with its defaults.

Key mapping (theirs -> ours):

* Megatron-LM ``DynamicGradScaler.state_dict()``: ``scale`` -> ``scale``, ``growth_tracker`` ->
  ``_growth_tracker``, ``hysteresis_tracker`` -> ``counters.hysteresis_left``.
* DeepSpeed FP16_Optimizer state: ``cur_scale`` -> ``scale``; ``cur_iter`` and
  ``last_overflow_iter`` -> ``_growth_tracker`` (the good steps since the last overflow, counted as
  the rule counts them); ``scale_window`` -> ``growth_interval``; no hysteresis (FP16_Optimizer has none).
* DeepSpeed ZeRO state: ``loss_scaler`` is the pickled DynamicLossScaler, with the attributes
  above plus ``min_scale`` -> ``min_scale``, ``delayed_shift`` -> ``hysteresis``,
  ``consecutive_hysteresis``, ``cur_hysteresis`` -> ``counters.hysteresis_left``,
  ``raise_error_at_min_scale`` -> ``on_min_scale``.
* apex ``amp.state_dict()``: ``loss_scalerN.loss_scale`` -> ``scale``, ``loss_scalerN.unskipped``
  -> ``_growth_tracker``.
* fairseq ``FP16Optimizer.state_dict()``: ``loss_scale`` -> ``scale`` (fairseq saves nothing else:
  its counters restart, and so do ours).
"""

from __future__ import annotations

from typing import Any

from ..errors import ScalerConfigError
from ..policy import peer_presets
from ..policy.peer_presets import PeerPreset
from ..scaler.scaler_args import TORCH_KNOBS


def _number(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def _require(state: Any, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ScalerConfigError(f"{what} is missing {missing}")


def _state(preset: PeerPreset, scale: float, tracker: int, **counters: int) -> dict[str, Any]:
    """A GradScaler state_dict holding ``preset``'s every knob and the checkpoint's trackers."""
    knobs = preset.policy.knobs()
    return {
        "scale": scale,
        **{name: knobs[name] for name in TORCH_KNOBS},
        "_growth_tracker": tracker,
        "policy": {k: v for k, v in knobs.items() if k not in TORCH_KNOBS},
        "counters": counters,
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
    preset = peer_presets.megatron(1.0, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis)
    left = max(int(_number(state["hysteresis_tracker"])), 0)  # Megatron's goes below 0: each backs off
    return _state(preset, _number(state["scale"]), int(_number(state["growth_tracker"])), hysteresis_left=left)


def from_deepspeed(
    state: dict[str, Any],
    *,
    hysteresis: int = 2,
    min_loss_scale: float = 1.0,
    consecutive_hysteresis: bool = False,
    version: str | None = None,
) -> dict[str, Any]:
    """DeepSpeed fp16 loss-scaler state: an FP16_Optimizer state dict (``cur_scale`` ...: its rule,
    without hysteresis), or a ZeRO one whose ``loss_scaler`` entry is the pickled DynamicLossScaler
    (its own hysteresis, floor and flags). ``version``: the DeepSpeed release that wrote a ZeRO
    checkpoint (its growth rule changed in 0.17.1; None: the current rule). A ZeRO scaler saved as a
    dict of its attributes loads too; the keyword arguments fill in what a checkpoint lacks.

    Example::

        scaler.load_state_dict(from_deepspeed(torch.load(path, weights_only=False)["optimizer"]))
    """
    scaler = state.get("loss_scaler") if isinstance(state, dict) else None
    fields = state if scaler is None else (scaler if isinstance(scaler, dict) else vars(scaler))
    optimizer = "fp16" if scaler is None else "zero"
    _require(fields, ("cur_scale",), "DeepSpeed loss-scaler state")
    scale = _number(fields["cur_scale"])
    if not fields.get("dynamic_loss_scale", True) or "scale_window" not in fields:
        return _state(peer_presets.deepspeed(loss_scale=scale, optimizer=optimizer), scale, 0)
    _require(fields, ("cur_iter", "last_overflow_iter", "scale_window"), "DeepSpeed dynamic loss-scaler state")
    window = int(fields["scale_window"])
    if window < 1:
        raise ScalerConfigError(f"DeepSpeed loss-scaler state has scale_window={window}; it must be >= 1")
    factor = float(fields.get("scale_factor", 2.0))
    if factor != 2.0:
        raise ScalerConfigError(f"DeepSpeed loss-scaler state has scale_factor={factor}; DeepSpeed's rule is 2")
    preset = peer_presets.deepspeed(
        loss_scale_window=window,
        hysteresis=int(fields.get("delayed_shift", hysteresis)),
        consecutive_hysteresis=bool(fields.get("consecutive_hysteresis", consecutive_hysteresis)),
        min_loss_scale=float(fields.get("min_scale", min_loss_scale)),
        optimizer=optimizer,
        version=version,
    )
    if optimizer == "zero" and not fields.get("raise_error_at_min_scale", True):
        preset.policy.on_min_scale = "clamp"
    good_steps = int(fields["cur_iter"]) - int(fields["last_overflow_iter"]) - 1
    tracker = _deepspeed_tracker(good_steps, preset.policy.growth_interval, preset.policy.growth_delay)
    left = int(fields.get("cur_hysteresis", preset.policy.hysteresis)) if optimizer == "zero" else 1
    return _state(preset, scale, tracker, hysteresis_left=left)


def _deepspeed_tracker(good_steps: int, window: int, delay: int) -> int:
    """Our growth tracker after ``good_steps`` good updates since the last overflow (or the start):
    DeepSpeed grows when that count (before the update) is a multiple of the window -- from 0.17.1
    (and in FP16_Optimizer) a positive one, which our tracker counts from -1 (``growth_delay``)."""
    if delay and good_steps == 0:
        return -delay
    return (good_steps - delay) % window


def from_apex(state: dict[str, Any], *, index: int = 0, scale_window: int = 2000,
              max_loss_scale: float = 2.0**24, min_loss_scale: float | None = None) -> dict[str, Any]:  # fmt: skip
    """apex ``amp.state_dict()`` (``loss_scaler0`` ...); the knobs default to apex's.

    Example::

        scaler.load_state_dict(from_apex(checkpoint["amp"]))
    """
    key = f"loss_scaler{index}"
    _require(state, (key,), "apex amp state")
    _require(state[key], ("loss_scale", "unskipped"), f"apex amp state[{key!r}]")
    preset = peer_presets.apex("dynamic", 1.0, scale_window, min_loss_scale, max_loss_scale)
    return _state(preset, _number(state[key]["loss_scale"]), int(state[key]["unskipped"]))


def from_fairseq(state: dict[str, Any], **fairseq_options: Any) -> dict[str, Any]:
    """fairseq ``FP16Optimizer.state_dict()`` (its ``loss_scale``); ``fairseq_options`` are
    ``presets.fairseq``'s (fairseq's ``--fp16-*`` options with its defaults) but the initial scale,
    which is the checkpoint's. fairseq saves no counters: after a load its scaler counts from the
    start again, and so does this one.

    Example::

        scaler.load_state_dict(from_fairseq(checkpoint["last_optimizer_state"], fp16_scale_window=128))
    """
    _require(state, ("loss_scale",), "fairseq optimizer state")
    preset = peer_presets.fairseq(**{**fairseq_options, "fp16_init_scale": 1.0})
    return _state(preset, _number(state["loss_scale"]), 0, overflows_since_backoff=0, updates_since_rescale=0)
