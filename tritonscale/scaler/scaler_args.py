"""The arguments GradScaler takes from its caller, checked as torch.amp.GradScaler checks them.

The constructor's (``init_scale``, torch's three knobs beside ``policy=`` and the other knobs, a
``"cuda"`` scaler without CUDA) and ``update(new_scale)``'s; torch's messages where torch has one.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ScalerConfigError
from ..policy.knob_validation import check_scale_value
from ..policy.loss_scale_policy import NORM_RULE_KNOBS, LossScalePolicy
from ..policy.peer_presets import PRESETS, PeerPreset, preset


#: torch.amp.GradScaler's default ``init_scale`` (its other defaults are LossScalePolicy's).
TORCH_INIT_SCALE = 2.0**16
#: The knobs torch's constructor and state_dict carry themselves (not inside ``policy``).
TORCH_KNOBS = ("growth_factor", "backoff_factor", "growth_interval")


def noting_passed(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate an ``__init__`` that takes the keyword ``passed``: each call hands it the names of
    the arguments the caller passed (by position or keyword), so that an argument left at its default
    and the same value passed explicitly differ -- a knob passed beside ``policy=`` overrides the
    policy's, one left out keeps it. The signature shown (``inspect.signature``, help()) is
    ``init``'s without ``passed``: its defaults are the plain numbers.

    Example::

        @noting_passed
        def __init__(self, device="cuda", init_scale=2.0**16, *, passed=frozenset()): ...
        # GradScaler("cpu", init_scale=2.0**16) is handed passed == {"device", "init_scale"}
    """
    full = inspect.signature(init)
    shown = full.replace(parameters=[p for p in full.parameters.values() if p.name != "passed"])
    positional = [
        p.name for p in shown.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][1:]  # after self

    @functools.wraps(init)
    def noting(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(positional):
            init(self, *args, **kwargs)  # raises Python's TypeError for too many positional arguments
        init(self, *args, **kwargs, passed=frozenset(positional[: len(args)]) | frozenset(kwargs))

    noting.__signature__ = shown  # type: ignore[attr-defined]
    return noting


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


def peer_policy(policy: LossScalePolicy | PeerPreset | str | None) -> tuple[LossScalePolicy | None, float]:
    """``policy=`` as a policy, and the initial scale that goes with it (a scaler's where the caller
    passed no ``init_scale``): torch's 2**16 for a ``LossScalePolicy`` (or None), the peer's for a
    preset (``tritonscale.presets.deepspeed(...)``) or a preset's name ("deepspeed": the peer's defaults).
    Example: ``peer_policy("keras")`` is Keras 3's policy and 32768.0."""
    if isinstance(policy, str):
        policy = preset(policy)
    if isinstance(policy, PeerPreset):
        policy, default = policy.policy, policy.init_scale
    elif policy is None or isinstance(policy, LossScalePolicy):
        default = TORCH_INIT_SCALE
    else:
        raise TypeError(
            "policy must be a tritonscale.LossScalePolicy, a peer's preset (tritonscale.presets.deepspeed(...)) "
            f"or a preset's name (one of {sorted(PRESETS)}), got {type(policy).__name__}"
        )
    return policy, default


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
    given: Mapping[str, Any],
) -> LossScalePolicy:
    """The policy of ``GradScaler(..., growth_factor, backoff_factor, growth_interval, policy=, **knobs)``.

    One rule for every knob beside ``policy=`` (a policy, a preset or its name): a knob given
    explicitly overrides the policy's, one left out keeps it. torch's three knobs come positionally
    or by keyword (``given``: those of them the caller passed, even at torch's values), the others
    as keywords. Example: ``GradScaler("cuda", policy="megatron", growth_interval=10)``.
    """
    unknown = sorted(set(knobs) - set(LossScalePolicy.knob_names()) | (set(knobs) & set(TORCH_KNOBS)))
    if unknown:
        raise TypeError(f"GradScaler got unexpected keyword arguments {unknown}")
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
