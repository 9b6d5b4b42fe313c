"""What the clip's one finalize program decides for the step: the policy's skip rule, ZClip's
adaptive max_norm and the fold's divisor, as the kernel's constexprs (kernels/finalize.py,
kernels/skip_rule.py), so that the step after the clip launches nothing of its own.

The rules stay the policy's (``LossScalePolicy.skip_decision``, ``spike_rules.zclip_max_norm``);
this module only maps a policy's knobs to the kernel's constexprs, rounded as the policy's float32
arithmetic rounds them. tests/kernels/test_skip_rule.py holds the kernel to the policy's bits.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch

from ..kernels.interfaces import STEP_OFF, FinalizeStep
from ..policy.rounding import rounded_to_float32
from ..policy.spike_rules import window_size

#: The widest block the z-score window is summed in (a longer window takes several, in order).
WINDOW_BLOCK = 1024


class StepDecision(NamedTuple):
    """The step's skip, to be decided by the clip's finalize: the ``policy``, the scaler's device
    ``state`` (its ``norm_stats`` and ``spike_stats``) and the optimizer's flags recorded earlier in
    the iteration (``found_before``, per device). Example:
    ``StepDecision(scaler._policy, scaler._tensors, record.found_inf_per_device)``."""

    policy: Any
    state: Any
    found_before: dict[torch.device, torch.Tensor]

    def earlier_on(self, device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """(whether finalize can decide the skip on ``device``, the earlier flag there or None): only
        where the state lives and no other device holds a flag of this iteration (the rule sums them)."""
        others = any(d != device for d in self.found_before)
        return self.state.scale.device == device and not others, self.found_before.get(device)


def rule_constexprs(policy: Any, *, with_norm: bool = True) -> dict[str, Any]:
    """The skip rule's and ZClip's constexprs for ``policy`` (kernels/finalize.py ``STEP_OFF``'s
    names); ``with_norm`` False: no norm to decide on (the norm rules and ZClip off, as
    ``skip_decision`` with norm None). Knobs that are off keep STEP_OFF's values, so they make no
    new compiled variant."""
    knobs = {"DECIDE": True, "SKIP_ON_OVERFLOW": policy.skip_on_overflow}
    if not with_norm:  # no clip: no norm rule, and no max_norm for ZClip to adapt
        return knobs
    if policy.skip_norm_above is not None:
        knobs["NORM_ABOVE"] = rounded_to_float32(policy.skip_norm_above)
    if policy.skip_norm_factor is not None:
        knobs["NORM_FACTOR"] = rounded_to_float32(policy.skip_norm_factor)
        knobs["NORM_WARMUP"] = policy.norm_warmup_steps
    if policy.skip_norm_sigma is not None:
        window = window_size(policy)
        knobs.update(
            SIGMA=policy.skip_norm_sigma,
            WINDOW=window,
            MIN_SEEN=max(policy.skip_norm_min_steps, window // 2),
            BLOCK_W=min(1 << (window - 1).bit_length(), WINDOW_BLOCK),
        )
    if policy.clip_norm_z is not None:
        knobs.update(
            ZCLIP_Z=policy.clip_norm_z,
            ZCLIP_WARMUP=policy.clip_norm_warmup_steps,
            ZCLIP_PERCENTILE=policy.clip_norm_mode == "percentile",
            ZCLIP_TO_MEAN=policy.clip_norm_option == "mean",
            ZCLIP_EPS=policy.clip_norm_eps,
            ZCLIP_FACTOR=policy.clip_norm_factor,
        )
    return knobs


def finalize_step(
    decision: StepDecision | None,
    device: torch.device,
    *,
    fold: bool,
    unfit_overflows: bool,
    unscale_on_overflow: bool,
    with_norm: bool = True,
) -> tuple[FinalizeStep, bool]:
    """The ``FinalizeStep`` of a clip on ``device`` and whether it decides the skip: ``fold`` (the
    divisor), ``unfit_overflows`` (a divisor that is not finite counts as an overflow: where nothing
    is read on the host), ``unscale_on_overflow`` (the policy's overflowed steps go ahead); the skip
    and the earlier flag are decided where ``decision`` allows it on ``device``. ZClip's max_norm
    is always the kernel's when ``decision``'s policy has it (the caller checked ``decision``).
    ``with_norm`` False: a check without a clip, whose skip decides on found_inf alone."""
    if decision is None:
        constexprs, key = _step_constexprs(None, fold, unfit_overflows, unscale_on_overflow, with_norm, False)
        return FinalizeStep(constexprs, key=key), False
    decides, earlier = decision.earlier_on(device)
    policy = decision.policy
    constexprs, key = _step_constexprs(policy, fold, unfit_overflows, unscale_on_overflow, with_norm, decides)
    state = decision.state
    spike_stats = state.spike_stats if policy.has_spike_state() else None  # else empty: no pointer
    return FinalizeStep(constexprs, earlier if decides else None, state.norm_stats, spike_stats, key), decides


def _step_constexprs(
    policy: Any, fold: bool, unfit_overflows: bool, unscale_on_overflow: bool, with_norm: bool, decides: bool
) -> tuple[dict[str, Any], int]:
    """(finalize's step constexprs, the number naming them) for a policy's stamp and the clip's
    switches, made once: a knob set since takes a new stamp, so a new entry. Without ``decides`` the
    ZClip knobs only (``policy`` None: none of the rule's)."""
    made_key = (policy.stamp if policy is not None else None, fold, unfit_overflows, unscale_on_overflow, with_norm,
                decides)  # fmt: skip
    made = _MADE.get(made_key)
    if made is None:
        constexprs = dict(STEP_OFF, FOLD=fold, UNFIT_OVERFLOWS=unfit_overflows, UNSCALE_ON_OVERFLOW=unscale_on_overflow)
        if policy is not None:
            rule = rule_constexprs(policy, with_norm=with_norm)
            if not decides:
                rule = {name: value for name, value in rule.items() if name.startswith("ZCLIP_")}
            constexprs.update(rule)
        if len(_MADE) >= 64:  # knobs that keep changing: keep it small
            _MADE.clear()
        # Equal constexprs get the one number, whichever stamp made them (FinalizeStep.key).
        values = tuple((name, type(value), value) for name, value in constexprs.items())
        key = _KEYS.get(values)
        if key is None:
            if len(_KEYS) >= 1024:  # a number is never reused: a set made again takes a new one
                _KEYS.clear()
            key = _KEYS[values] = next(_NUMBERS)
        made = _MADE[made_key] = (constexprs, key)
    return made


#: (stamp, fold, unfit_overflows, unscale_on_overflow, with_norm, decides) -> (constexprs, key).
_MADE: dict[tuple, tuple[dict[str, Any], int]] = {}
#: The distinct sets of step constexprs made lately -> the number naming each (from _NUMBERS).
_KEYS: dict[tuple, int] = {}
_NUMBERS = itertools.count()
