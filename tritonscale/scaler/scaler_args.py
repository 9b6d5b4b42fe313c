"""The arguments GradScaler takes from its caller, checked as torch.amp.GradScaler checks them.

The constructor's (``init_scale``, torch's three knobs beside ``policy=`` and the other knobs, a
``"cuda"`` scaler without CUDA) and ``update(new_scale)``'s; torch's messages where torch has one.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..errors import ScalerConfigError
from ..policy.knob_checks import check_scale_value
from ..policy.loss_scale_policy import NORM_RULE_KNOBS, LossScalePolicy
from ..policy.peer_presets import PRESETS, PeerPreset, preset


class DefaultInitScale(float):
    """The type of the constructor's default ``init_scale``: torch's 2**16 (and equal to it, so the
    signature reads as torch's), told apart from an explicit ``init_scale=65536.0`` by identity --
    a peer's preset then brings its own initial scale (``peer_policy``). Only the default object
    itself is ever of this type; the scaler keeps plain floats."""

    def __repr__(self) -> str:
        return "65536.0"


class DefaultFloat(float):
    """The type of the constructor's default ``growth_factor``/``backoff_factor``: torch's value,
    told apart from the same number passed explicitly by identity, as ``DefaultInitScale`` is -- so
    an explicit knob beside ``policy=`` overrides the policy's and the default leaves it."""

    def __repr__(self) -> str:
        return repr(float(self))


class DefaultInt(int):
    """``DefaultFloat`` for ``growth_interval``."""

    def __repr__(self) -> str:
        return repr(int(self))


#: torch.amp.GradScaler's default ``init_scale`` (its other defaults are LossScalePolicy's).
TORCH_INIT_SCALE = DefaultInitScale(2.0**16)
#: The knobs torch's constructor and state_dict carry themselves (not inside ``policy``).
TORCH_KNOBS = ("growth_factor", "backoff_factor", "growth_interval")
#: The constructor's defaults of those three: LossScalePolicy's (torch's), as objects of their own.
TORCH_KNOB_DEFAULTS = {
    "growth_factor": DefaultFloat(LossScalePolicy.growth_factor),
    "backoff_factor": DefaultFloat(LossScalePolicy.backoff_factor),
    "growth_interval": DefaultInt(LossScalePolicy.growth_interval),
}


def cuda_missing(device: str, enabled: bool) -> bool:
    """True, with torch's warning, when an enabled scaler asks for "cuda" and there is none."""
    if device == "cuda" and enabled and not torch.cuda.is_available():
        warnings.warn(
            "tritonscale.GradScaler is enabled, but CUDA is not available.  Disabling. On a CPU, build "
            'GradScaler("cpu"): it scales, checks and clips there with torch\'s ops',
            stacklevel=3,
        )
        return True
    return False


def peer_policy(
    policy: LossScalePolicy | PeerPreset | str | None, init_scale: float | torch.Tensor
) -> tuple[LossScalePolicy | None, float | torch.Tensor]:
    """``policy=`` as a policy, and the initial scale: ``init_scale`` as given, or -- where it is the
    default ``TORCH_INIT_SCALE`` -- the one that goes with the policy: torch's 2**16 for a
    ``LossScalePolicy`` (or None), the peer's for a preset (``tritonscale.presets.deepspeed(...)``)
    or a preset's name ("deepspeed": the peer's defaults).
    Example: ``peer_policy("keras", TORCH_INIT_SCALE)`` is Keras 3's policy and 32768.0."""
    if isinstance(policy, str):
        policy = preset(policy)
    if isinstance(policy, PeerPreset):
        policy, default = policy.policy, policy.init_scale
    elif policy is None or isinstance(policy, LossScalePolicy):
        default = float(TORCH_INIT_SCALE)
    else:
        raise TypeError(
            "policy must be a tritonscale.LossScalePolicy, a peer's preset (tritonscale.presets.deepspeed(...)) "
            f"or a preset's name (one of {sorted(PRESETS)}), got {type(policy).__name__}"
        )
    return policy, default if init_scale is TORCH_INIT_SCALE else init_scale


def checked_init_scale(init_scale: float | torch.Tensor, policy: LossScalePolicy) -> float:
    """An enabled scaler's ``init_scale``: a number (or a 1-element tensor, as torch takes), finite
    and nonzero in float32, within the policy's [min_scale, max_scale]; the policy validated too."""
    if isinstance(init_scale, torch.Tensor) and init_scale.numel() == 1:
        init_scale = init_scale.item()
    init_scale = check_scale_value("init_scale", init_scale)
    return policy.validate().check_scale_in_bounds("init_scale", init_scale)


def policy_from_torch_args(
    policy: LossScalePolicy | None,  # peer_policy's
    knobs: dict[str, Any],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> LossScalePolicy:
    """The policy of ``GradScaler(..., growth_factor, backoff_factor, growth_interval, policy=, **knobs)``.

    One rule for every knob beside ``policy=`` (a policy, a preset or its name): a knob given
    explicitly overrides the policy's, one left out keeps it. torch's three knobs come positionally
    or by keyword (their defaults are told apart from the same values passed explicitly by identity),
    the others as keywords. Example: ``GradScaler("cuda", policy="megatron", growth_interval=10)``.
    """
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()) | (set(knobs) & set(TORCH_KNOBS)))
    if unknown:
        raise TypeError(f"GradScaler got unexpected keyword arguments {unknown}")
    torch_knobs = {"growth_factor": growth_factor, "backoff_factor": backoff_factor, "growth_interval": growth_interval}
    given = {name: value for name, value in torch_knobs.items() if value is not TORCH_KNOB_DEFAULTS[name]}
    base = policy.knobs() if policy is not None else {name: getattr(LossScalePolicy, name) for name in TORCH_KNOBS}
    return LossScalePolicy(**{**base, **given, **knobs})


def check_disabled_policy(policy: LossScalePolicy) -> None:
    """A disabled scaler's policy (``enabled=False``, a bf16 run): the norm rules refused by name, as
    it keeps no norm history and decides nothing from the norm; the scale knobs are kept and unused,
    as torch keeps a disabled scaler's arguments. Example: ``check_disabled_policy(LossScalePolicy())``."""
    knobs = policy.knobs_set(NORM_RULE_KNOBS)
    if knobs:
        raise ScalerConfigError(
            f"GradScaler(enabled=False) got {', '.join(knobs)}: a disabled scaler (enabled=False, a bf16 run) "
            "keeps no norm history and applies no norm rule, so the knob would be ignored. Clip with "
            "scaler.clip_grad_norm_(optimizer, max_norm) (on a disabled scaler it still skips the step on an "
            "inf/NaN norm), or use an enabled scaler (fp16 loss scaling) for the norm rules"
        )


def set_scale_(scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
    """``update(new_scale)``: a positive finite float, or a 1-element tensor on the scale's device
    type that does not require grad (torch.amp.GradScaler's contract and messages)."""
    if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
        scale.fill_(check_scale_value("new_scale", new_scale))
        return
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    if not isinstance(new_scale, torch.Tensor):
        raise AssertionError(reason)
    if new_scale.device.type != scale.device.type or new_scale.numel() != 1 or new_scale.requires_grad:
        raise AssertionError(reason)
    scale.copy_(new_scale.reshape(()))


def missing_state_error(funcname: str) -> AssertionError:
    """torch's error for a call that needs the scale before any scale() made it."""
    return AssertionError(
        f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
        "scaler.scale(loss or outputs) earlier in the iteration."
    )
