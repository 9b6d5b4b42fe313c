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

Every value an importer reads goes through one reader (``_Saved``): a state that is not a dict, a
missing key, a scale that is not a positive finite number (or a one-element tensor) that float32
holds, a tracker that is not an int, a flag that is not a bool -- each is a ScalerConfigError that
names the importer and the key, what it got and what it needs. A scale of 0 is refused too:
``GradScaler.load_state_dict`` loads torch's 0 (its float32 backoff's underflow) as the policy's
floor, but no peer's rule continues from 0 that way.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ScalerConfigError
from ..policy import peer_presets
from ..policy.knob_validation import check_scale_value, is_int, is_number
from ..policy.peer_presets import PeerPreset
from ..scaler.scaler_args import TORCH_KNOBS


@dataclass(frozen=True)
class _Saved:
    """One section of a peer's saved state, as an importer reads it: every value goes through
    :meth:`scale`, :meth:`count` or :meth:`flag`, so a value of the wrong kind is refused with the
    importer, the key, what it got and what it needs -- not a ``float()`` error naming nothing.
    Example: ``_saved(state, "from_megatron", "Megatron-LM's ...", ("scale",)).scale("scale")``."""

    fields: abc.Mapping
    importer: str  # "from_megatron"
    path: str  # "state", "state['loss_scaler0']"
    what: str  # the peer's name for this state, for a missing key

    def require(self, *keys: str) -> None:
        missing = [key for key in keys if key not in self.fields]
        if missing:
            raise ScalerConfigError(f"{self.importer}: {self.path} ({self.what}) is missing {missing}")

    def section(self, key: str, what: str, keys: tuple[str, ...]) -> _Saved:
        """The mapping (or pickled object, as DeepSpeed's ZeRO saves its scaler) under ``key``."""
        value = self.fields[key]
        fields = value if isinstance(value, abc.Mapping) else getattr(value, "__dict__", None)
        if fields is None:
            raise self._refused(key, f"{what} (a dict or an object)", value)
        saved = _Saved(fields, self.importer, f"{self.path}[{key!r}]", what)
        saved.require(*keys)
        return saved

    def scale(self, key: str) -> float:
        """A loss scale (or a floor on one): what ``GradScaler.load_state_dict`` takes for its scale,
        positive and finite in float32, but not 0 (torch's own underflow, no peer's saved state)."""
        need = "a positive finite number or a one-element tensor"
        value = self._value(key, need)
        if not is_number(value):
            raise self._refused(key, need, value)
        return check_scale_value(f"{self.importer}: {self.path}[{key!r}]", float(value))

    def count(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        """A tracker or a count: an int (a one-element tensor, a float with an integer value);
        ``default`` where the key is absent (None: the key is required)."""
        if default is not None and key not in self.fields:
            return default
        need = f"an int{'' if minimum is None else f' >= {minimum}'} or a one-element tensor"
        value = self._value(key, need)
        if is_number(value) and not is_int(value) and float(value).is_integer():
            value = int(value)
        if not is_int(value) or (minimum is not None and value < minimum):
            raise self._refused(key, need, value)
        return int(value)

    def flag(self, key: str, default: bool) -> bool:
        """A saved bool; ``default`` (the argument's, checked where it is used) where the key is absent."""
        if key not in self.fields:
            return default
        value = self.fields[key]
        if not isinstance(value, bool):
            raise self._refused(key, "True or False", value)
        return value

    def _value(self, key: str, need: str) -> Any:
        """The saved value, a one-element tensor read as its number (a checkpoint load, not a step)."""
        value = self.fields[key]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise self._refused(key, need, value)
            value = value.item()
        return value

    def _refused(self, key: str, need: str, value: Any) -> ScalerConfigError:
        return ScalerConfigError(f"{self.importer}: {self.path}[{key!r}] must be {need}, got {_shown(value)}")


def _saved(state: Any, importer: str, what: str, keys: tuple[str, ...]) -> _Saved:
    """``state`` as the importer's top section, its ``keys`` present; anything but a dict is refused."""
    if not isinstance(state, abc.Mapping):
        shape = f"a dict with {', '.join(map(repr, keys))}" if keys else "a dict"
        raise ScalerConfigError(f"{importer} takes {what} ({shape}), got {_shown(state)}")
    saved = _Saved(state, importer, "state", what)
    saved.require(*keys)
    return saved


def _shown(value: Any) -> str:
    """A value as an error message shows it: its type and a short repr (a tensor by shape)."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


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

    Args:
        state: Megatron-LM's ``DynamicGradScaler.state_dict()`` (``scale``, ``growth_tracker``,
            ``hysteresis_tracker``).
        min_scale: the scale's floor (Megatron's ``min_loss_scale``, 1.0).
        growth_factor: the growth factor (2.0).
        backoff_factor: the backoff factor (0.5).
        growth_interval: the good steps before a growth (Megatron's ``loss_scale_window``, 1000).
        hysteresis: the overflows before a backoff (2).

    Returns:
        a ``GradScaler.load_state_dict`` state: the checkpoint's scale and trackers, and every knob of the
        peer's preset.

    Raises:
        ScalerConfigError: a state that is not a dict, a missing key, a saved value of the wrong kind, or an
            argument ``presets.megatron`` refuses.
    """
    keys = ("scale", "growth_tracker", "hysteresis_tracker")
    saved = _saved(state, "from_megatron", "Megatron-LM's DynamicGradScaler.state_dict()", keys)
    scale, tracker = saved.scale("scale"), saved.count("growth_tracker", minimum=0)
    left = max(saved.count("hysteresis_tracker"), 0)  # Megatron's goes below 0: each backs off
    preset = peer_presets.megatron(1.0, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis)
    return _state(preset, scale, tracker, hysteresis_left=left)


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

        state = tritonscale.load_checkpoint("global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt")
        scaler.load_state_dict(from_deepspeed(state["optimizer_state_dict"]))

    ``load_checkpoint`` reads the file with nothing in it run (its ZeRO ``loss_scaler`` as a plain record,
    no DeepSpeed needed); ``torch.load(path, weights_only=False)`` would run any code the file names.
    An FP16_Optimizer without ZeRO saves its state in ``mp_rank_00_model_states.pt``, under ``"optimizer"``.

    Args:
        state: a DeepSpeed FP16_Optimizer's or ZeRO optimizer's ``state_dict()``.
        hysteresis: the overflows before a backoff where a ZeRO checkpoint has no ``delayed_shift`` (2).
        min_loss_scale: the scale's floor where a ZeRO checkpoint has no ``min_scale`` (1.0).
        consecutive_hysteresis: where a ZeRO checkpoint has no ``consecutive_hysteresis`` (False).
        version: the DeepSpeed release that wrote a ZeRO checkpoint; None (the default) for the current rule.

    Returns:
        a ``GradScaler.load_state_dict`` state: the checkpoint's scale and trackers, and every knob of the
        peer's preset.

    Raises:
        ScalerConfigError: a state that is not a dict, a missing key, a saved value of the wrong kind, a
            ``scale_factor`` other than 2, or an argument ``presets.deepspeed`` refuses.
    """
    top = _saved(state, "from_deepspeed", "a DeepSpeed fp16 or ZeRO optimizer's state_dict()", ())
    optimizer = "fp16" if top.fields.get("loss_scaler") is None else "zero"
    what = "DeepSpeed's loss-scaler state"
    saved = top.section("loss_scaler", what, ("cur_scale",)) if optimizer == "zero" else top
    saved.require("cur_scale")
    scale = saved.scale("cur_scale")
    if not saved.flag("dynamic_loss_scale", True) or "scale_window" not in saved.fields:
        return _state(peer_presets.deepspeed(loss_scale=scale, optimizer=optimizer), scale, 0)
    saved.require("cur_iter", "last_overflow_iter", "scale_window")
    window = saved.count("scale_window", minimum=1)
    factor = saved.scale("scale_factor") if "scale_factor" in saved.fields else 2.0
    if factor != 2.0:
        raise ScalerConfigError(f"DeepSpeed loss-scaler state has scale_factor={factor}; DeepSpeed's rule is 2")
    preset = peer_presets.deepspeed(
        loss_scale_window=window,
        hysteresis=saved.count("delayed_shift", default=hysteresis, minimum=1),
        consecutive_hysteresis=saved.flag("consecutive_hysteresis", consecutive_hysteresis),
        min_loss_scale=saved.scale("min_scale") if "min_scale" in saved.fields else min_loss_scale,
        optimizer=optimizer,
        version=version,
    )
    if optimizer == "zero" and not saved.flag("raise_error_at_min_scale", True):
        preset.policy.on_min_scale = "clamp"
    good_steps = saved.count("cur_iter", minimum=0) - saved.count("last_overflow_iter", minimum=-1) - 1
    tracker = _deepspeed_tracker(good_steps, preset.policy.growth_interval, preset.policy.growth_delay)
    left = saved.count("cur_hysteresis", default=preset.policy.hysteresis, minimum=0) if optimizer == "zero" else 1
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

    Args:
        state: apex's ``amp.state_dict()``.
        index: which loss scaler to read (``loss_scaler{index}``, 0).
        scale_window: the good steps before a growth (2000).
        max_loss_scale: the scale's ceiling (2**24).
        min_loss_scale: the scale's floor; None (the default) for none.

    Returns:
        a ``GradScaler.load_state_dict`` state: the checkpoint's scale and trackers, and every knob of the
        peer's preset.

    Raises:
        ScalerConfigError: a state that is not a dict, a missing key, a saved value of the wrong kind, or an
            argument ``presets.apex`` refuses.
    """
    key = f"loss_scaler{index}"
    top = _saved(state, "from_apex", "apex's amp.state_dict()", (key,))
    saved = top.section(key, "an apex LossScaler's state", ("loss_scale", "unskipped"))
    scale, unskipped = saved.scale("loss_scale"), saved.count("unskipped", minimum=0)
    preset = peer_presets.apex("dynamic", 1.0, scale_window, min_loss_scale, max_loss_scale)
    return _state(preset, scale, unskipped)


def from_fairseq(state: dict[str, Any], **fairseq_options: Any) -> dict[str, Any]:
    """fairseq ``FP16Optimizer.state_dict()`` (its ``loss_scale``); ``fairseq_options`` are
    ``presets.fairseq``'s (fairseq's ``--fp16-*`` options with its defaults) but the initial scale,
    which is the checkpoint's. fairseq saves no counters: after a load its scaler counts from the
    start again, and so does this one.

    Example::

        scaler.load_state_dict(from_fairseq(checkpoint["last_optimizer_state"], fp16_scale_window=128))

    Args:
        state: fairseq's ``FP16Optimizer.state_dict()`` (its ``loss_scale``).
        **fairseq_options: ``presets.fairseq``'s keyword arguments; ``fp16_init_scale`` is replaced by the
            checkpoint's scale.

    Returns:
        a ``GradScaler.load_state_dict`` state: the checkpoint's scale and trackers, and every knob of the
        peer's preset.

    Raises:
        ScalerConfigError: a state that is not a dict, a missing ``loss_scale`` or one of the wrong kind, or an
            option ``presets.fairseq`` refuses.
    """
    scale = _saved(state, "from_fairseq", "fairseq's FP16Optimizer.state_dict()", ("loss_scale",)).scale("loss_scale")
    preset = peer_presets.fairseq(**{**fairseq_options, "fp16_init_scale": 1.0})
    return _state(preset, scale, 0, overflows_since_backoff=0, updates_since_rescale=0)
