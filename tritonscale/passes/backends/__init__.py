"""Backends run the gradient passes for one device; the controller (GradScaler) owns all policy.

Each backend offers the same three operations on ``groups`` (lists of same-dtype gradients on one
device) and a device-resident fp32 loss ``scale``:

* ``unscale_(groups, scale, found_inf)``: g <- g / scale in place, found_inf <- 1 on inf/NaN;
* ``check(groups, scale, norm_type, max_norm) -> CheckResult``: read-only; found_inf, the norm of
  the unscaled gradients and the combined factor inv_scale * clip_coef, all on the device;
* ``apply_(result)``: g <- g * result.factor in place.
"""

from __future__ import annotations

import enum

import torch

from ...kernels import TRITON_FOUND, triton_missing
from . import custom_ops  # noqa: F401  registers the custom ops a traced step calls (triton_backend.py)
from .base import Backend, CheckResult, clip_coefficient, gradient_factor, inverse_scale
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend


class BackendName(str, enum.Enum):
    """The names ``GradScaler(backend=...)`` takes. A ``str`` enum: each member equals its word
    (``BackendName.TORCH == "torch"``), so callers keep passing and comparing the plain strings."""

    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"

    __str__ = str.__str__  # "torch", not "BackendName.TORCH", in messages and f-strings
    __format__ = str.__format__


BACKENDS = tuple(name.value for name in BackendName)


def check_backend_name(name: str) -> str:
    """``name`` as the plain string the controller keeps (``scaler.backend``), or a ValueError that
    lists the names that work."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == BackendName.TRITON and not TRITON_FOUND:  # refused when built, not at the first step
        raise triton_missing("GradScaler(backend='triton')")
    return BackendName(name).value


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend that runs ``name``'s passes on ``device``.

    "auto" picks Triton for GPU tensors, and for CPU tensors when the kernels were built for the
    interpreter (TRITON_INTERPRET=1 before import); otherwise torch's own foreach/amp ops.
    """
    if name == BackendName.TORCH:
        return TorchBackend()
    triton_ok = TritonBackend.supports(device)
    if name == BackendName.TRITON:
        if not TRITON_FOUND:
            raise triton_missing("GradScaler(backend='triton')")
        if not triton_ok:
            raise RuntimeError(
                f"backend='triton' cannot run on {device}: CPU tensors need TRITON_INTERPRET=1 set "
                "before triton is imported; other devices need a GPU Triton supports"
            )
        return TritonBackend()
    return TritonBackend() if triton_ok else TorchBackend()


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendName",
    "CheckResult",
    "TorchBackend",
    "TritonBackend",
    "clip_coefficient",
    "gradient_factor",
    "inverse_scale",
    "resolve_backend",
]
