"""The gradient passes of one step, per device, through the chosen backend.

``collect_grads`` (grad_groups.py) hands over ``{device: [same-dtype gradient lists]}``; these
functions run check pass -> finalize (-> apply pass) on each device and return the device-side
results (found_inf, norm, clip coefficient). Nothing here reads a device value on the host, and
nothing knows about optimizers or stages: that is the controller's (grad_scaler.py).
"""

from __future__ import annotations

import torch

from .backends import CheckResult, inverse_scale, resolve_backend
from .grad_groups import DeviceGroups
from .scale_outputs import PerDevice


def _zero_found_infs(groups: DeviceGroups) -> dict[torch.device, torch.Tensor]:
    # No gradients, no entry: as in torch, a step with no inf check recorded is an error.
    return {d: torch.zeros((), dtype=torch.float32, device=d) for d in groups}


def unscale_grads_(groups: DeviceGroups, scale: torch.Tensor, backend: str) -> dict[torch.device, torch.Tensor]:
    """g <- g / scale in place, one fused read+check+write pass per group; found_inf per device."""
    found_infs = _zero_found_infs(groups)
    per_device_scale = PerDevice(scale)
    for device, device_groups in groups.items():
        resolve_backend(backend, device).unscale_(device_groups, per_device_scale.get(device), found_infs[device])
    return found_infs


def check_grads(groups: DeviceGroups, scale: torch.Tensor, backend: str) -> dict[torch.device, torch.Tensor]:
    """Read-only inf/NaN check of the still-scaled gradients (a fused optimizer divides them
    itself); found_inf per device. No cross-device reduction is needed for found_inf."""
    found_infs = _zero_found_infs(groups)
    for device, device_groups in groups.items():
        result = resolve_backend(backend, device).check(device_groups, scale.to(device, non_blocking=True), 2.0, None)
        found_infs[device] = result.found_inf
    return found_infs


def clip_grads(
    groups: DeviceGroups,
    scale: torch.Tensor | None,
    norm_type: float,
    max_norm: float,
    *,
    apply: bool,
    unscale_on_overflow: bool = False,
    backend: str,
) -> tuple[torch.device, CheckResult]:
    """Check pass -> finalize (-> apply pass, with ``apply``) on the one device holding ``groups``.

    ``scale`` None: nothing to unscale, clip only. On inf/NaN the gradients are left as they came
    (the step is skipped); with ``unscale_on_overflow`` (a policy whose overflowed steps go ahead)
    they are unscaled, not clipped -- what ``unscale_`` leaves -- and ``clip_coef`` reads 1, so a
    fold hands the optimizer the plain scale. Returns the device and its results.
    """
    if len(groups) > 1:
        devices = ", ".join(map(str, groups))
        raise NotImplementedError(f"clip_grad_norm_() over gradients on several devices ({devices})")
    device = next(iter(groups), scale.device if scale is not None else torch.device("cpu"))
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=device)
    runner = resolve_backend(backend, device)
    scale = scale.to(device, non_blocking=True)
    result = runner.check(groups.get(device, []), scale, norm_type, max_norm)
    if unscale_on_overflow:
        overflow = result.found_inf > 0
        result.clip_coef = torch.where(overflow, torch.ones_like(result.clip_coef), result.clip_coef)
        result.factor = torch.where(overflow, inverse_scale(scale).reshape(()), result.factor)
    if apply:
        runner.apply_(result)
    return device, result
