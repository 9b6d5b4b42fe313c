"""The policy column: the rule a cell's scaler runs, and the twin's independent oracle of it.

``default`` is torch's rule: the twin is torch's GradScaler itself, as in every cell before this
column. Every other column gives our scaler a ``policy`` (each peer's preset by the peer's own
arguments, a static scale, a spike rule, the opt-in host checks) and gives the twin the same rule
from an independent transcription: the peer's update rule from ``tests/oracles/peer_rules.py`` (the same
signatures as ``tritonscale.presets``), OLMo-core's z-score skip and ZClip from
``tests/oracles/spike_rules.py``, the norm-average skip restated below from its documentation. The
twin keeps torch's GradScaler for the gradients (its ``unscale_`` and torch's clip) and sets its
scale to the rule's after every update.

Windows and intervals are short (growth every 2 good steps, windows of 4 norms) so that the rules
grow, back off, spend hysteresis and skip on a spike within a cell's 12 iterations; a spike is
planted at ``SPIKE_AT`` (the gradients multiplied by ``SPIKE``, on both sides).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from oracles.peer_rules import RULES, TorchRule
from oracles.spike_rules import OlmoSkip, ZClipRef

from tritonscale import LossScalePolicy, presets

from .twins import GROWTH_INTERVAL, Side

INIT = 2.0**16
SPIKE_AT = 9  # after the overflows (2, 3) and the round trips (5): the windows hold finite norms
SPIKE = 40.0


def f32(value: float) -> float:
    return float(np.float32(value))


class NormAverageSkip:
    """``skip_norm_factor`` as docs/policies.md states it: the average starts at the first norm of a
    stepped iteration and then decays by ``decay`` (float32 arithmetic); once ``warmup`` norms were
    averaged, a finite norm above ``factor`` times the average skips the step (the scale is kept); a
    skipped step's norm stays out of the average."""

    def __init__(self, factor: float, decay: float, warmup: int) -> None:
        self.factor, self.decay, self.warmup = f32(factor), f32(decay), warmup
        self.average, self.count = 0.0, 0

    def skip(self, norm: float) -> bool:
        return self.count >= self.warmup and math.isfinite(norm) and f32(norm) > f32(self.factor * self.average)

    def stepped(self, norm: float) -> None:
        if not math.isfinite(norm):
            return
        decay = self.decay if self.count > 0 else 0.0
        self.average = f32(f32(decay * self.average) + f32(f32(1 - decay) * f32(norm)))
        self.count += 1


class NormAboveSkip:
    """``skip_norm_above``: a finite norm above the threshold (both float32) skips the step."""

    def __init__(self, threshold: float) -> None:
        self.threshold = f32(threshold)

    def skip(self, norm: float) -> bool:
        return math.isfinite(norm) and f32(norm) > self.threshold


@dataclass(frozen=True)
class PolicyContext:
    """A column. ``kwargs``: our GradScaler's arguments for the rule (with the scale context's
    ``enabled``); ``scale_rule``: the twin's scale rule (``update(overflow)``, ``scale``,
    ``skipped``; None: torch's GradScaler itself); ``spike``: the twin's spike rule, if any;
    ``norm_history``: the rule keeps one optimizer's norm history (two optimizers' clips are
    refused); ``torch_keys``: torch's five state_dict keys carry the whole state (a round trip
    through torch's scaler loses nothing); ``preset``: the peer's preset name."""

    name: str
    kwargs: Callable[[], dict]
    scale_rule: Callable[[], Any] | None = None
    spike: Callable[[], Any] | None = None
    norm_history: bool = False
    torch_keys: bool = False
    preset: str | None = None
    preset_args: dict = field(default_factory=dict)  # the peer's own arguments, for the importer rows

    @property
    def default(self) -> bool:
        return self.scale_rule is None

    @property
    def torch_scale_rule(self) -> bool:
        """The scale follows torch's rule (the default, the torch preset, the spike rules), so
        ``update(new_scale=...)`` has torch's meaning for the twin."""
        return self.default or self.preset == "torch" or self.spike is not None


def _preset(name: str, **args: Any) -> PolicyContext:
    """A peer's preset column: ours ``policy=presets.<name>(**args)``, the twin the peer's rule."""
    return PolicyContext(
        name.replace("-", "_"),
        lambda: {"policy": presets.preset(name, **args)},
        lambda: RULES[name](**args),
        torch_keys=name == "torch",
        preset=name,
        preset_args=args,
    )


def _torch_rule() -> TorchRule:
    return TorchRule(INIT, 2.0, 0.5, GROWTH_INTERVAL)


def _spike(name: str, knobs: dict, twin: Callable[[], Any]) -> PolicyContext:
    """A spike rule on torch's scale rule."""
    policy = lambda: {"init_scale": INIT, "policy": LossScalePolicy(growth_interval=GROWTH_INTERVAL, **knobs)}
    history = "skip_norm_above" not in knobs
    return PolicyContext(name, policy, _torch_rule, spike=twin, norm_history=history)


POLICIES = [
    PolicyContext("default", dict, torch_keys=True),
    _preset("torch", init_scale=INIT, growth_interval=2),
    _preset("megatron", initial_scale=INIT, growth_interval=2, hysteresis=2),
    _preset("deepspeed", initial_scale_power=16, loss_scale_window=2, hysteresis=2),
    _preset("apex", init_scale=INIT, scale_window=2, min_loss_scale=1.0),
    _preset("apex-hysteresis", init_scale=INIT, growth_interval=2, hysteresis=2),
    _preset("fairseq", fp16_init_scale=INIT, fp16_scale_window=2, fp16_scale_tolerance=0.25),
    _preset("keras", initial_scale=INIT, dynamic_growth_steps=2),
    _preset("tf-keras", initial_scale=INIT, dynamic_growth_steps=2),
    _preset("tf1", init_loss_scale=INIT, incr_every_n_steps=2, decr_every_n_nan_or_inf=2),
    # A static scale whose overflowed steps go ahead (apex amp with a number, tf.keras dynamic=False).
    PolicyContext("apex_static", lambda: {"policy": presets.apex(loss_scale=INIT)}, lambda: RULES["apex"](INIT)),
    _spike("zscore_skip", {"skip_norm_sigma": 2.0, "skip_norm_window": 4}, lambda: OlmoSkip(4, 2.0)),
    _spike("zclip", {"clip_norm_z": 1.5, "clip_norm_warmup_steps": 3}, lambda: ZClipRef(z_thresh=1.5, warmup_steps=3)),
    _spike(
        "norm_average_skip",
        {"skip_norm_factor": 3.0, "norm_average_decay": 0.5, "norm_warmup_steps": 3},
        lambda: NormAverageSkip(3.0, 0.5, 3),
    ),
    _spike("norm_above_skip", {"skip_norm_above": 1e3}, lambda: NormAboveSkip(1e3)),
    # The opt-in host checks, none of which fires here: the twin is torch's rule.
    PolicyContext(
        "stop_rules",
        lambda: {
            "init_scale": INIT,
            "policy": LossScalePolicy(
                growth_interval=GROWTH_INTERVAL,
                min_scale=1.0,
                on_min_scale="warn",
                max_consecutive_skips=5,
                raise_at_scale=2.0**-20,
                max_scale=2.0**40,
            ),  # fmt: skip
        },
        _torch_rule,
    ),
]
POLICY_NAMES = {policy.name: policy for policy in POLICIES}


class TwinRule:
    """The twin's rule for one cell: decides each optimizer's skip and the scale after an update."""

    def __init__(self, context: PolicyContext) -> None:
        self.context = context
        self.scale_rule = context.scale_rule()
        self.spike = context.spike() if context.spike is not None else None

    @property
    def scale(self) -> float:
        return self.scale_rule.scale

    @property
    def applies_overflow(self) -> bool:
        """The rule lets an overflowed step go ahead (a static scale of apex or tf.keras)."""
        return getattr(self.scale_rule, "skips_overflow", True) is False

    def clip_limit(self, norm: float, max_norm: float) -> float:
        """The max_norm the clip uses: ZClip's clip value where it clips."""
        return self.spike.clip_value(norm, max_norm) if isinstance(self.spike, ZClipRef) else max_norm

    def spiked(self, norm: float | None) -> bool:
        """Whether this norm skips the step (before the scale rule's overflow skip)."""
        if norm is None or self.spike is None or isinstance(self.spike, ZClipRef):
            return False
        return self.spike.skip(norm)

    def update(self, overflow: bool, new_scale: float | None) -> bool:
        """The scale rule's update; whether an overflowed step is skipped under it."""
        if new_scale is None:
            self.scale_rule.update(overflow)
            return self.scale_rule.skipped
        self.scale_rule._scale.fill_(new_scale)  # torch's update(new_scale): the tracker stays
        return overflow

    def stepped(self, norm: float | None) -> None:
        """After an applied step: the norm average takes its norm."""
        if norm is not None and isinstance(self.spike, NormAverageSkip):
            self.spike.stepped(norm)


def spike_hook(side: Side, step: int) -> None:
    """The planted spike, on both sides alike (after the scaled backward, before the scaler's calls)."""
    if step == SPIKE_AT and side.cell.policy.spike is not None:
        for p in side.params():
            if p.grad is not None:
                p.grad.mul_(SPIKE)
