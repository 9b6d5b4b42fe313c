"""Backends run the gradient passes for one device; the controller (GradScaler) owns all policy.

Each backend offers the same three operations on ``groups`` (lists of same-dtype gradients on one
device) and a device-resident fp32 loss ``scale``:

* ``unscale_(groups, scale, found_inf)``: g <- g / scale in place, found_inf <- 1 on inf/NaN;
* ``check(groups, scale, norm_type, max_norm) -> CheckResult``: read-only; found_inf, the norm of
  the unscaled gradients and the combined factor inv_scale * clip_coef, all on the device;
* ``apply_(result)``: g <- g * result.factor in place.
"""

from __future__ import annotations

import torch

from . import custom_ops  # noqa: F401  registers the custom ops a traced step calls (triton_backend.py)
from .base import Backend, CheckResult, clip_coefficient, gradient_factor, inverse_scale
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

BACKENDS = ("auto", "triton", "torch")


def check_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend that runs ``name``'s passes on ``device``.

    "auto" picks Triton for GPU tensors, and for CPU tensors when the kernels were built for the
    interpreter (TRITON_INTERPRET=1 before import); otherwise torch's own foreach/amp ops.
    """
    if name == "torch":
        return TorchBackend()
    triton_ok = TritonBackend.supports(device)
    if name == "triton":
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
    "CheckResult",
    "TorchBackend",
    "TritonBackend",
    "clip_coefficient",
    "gradient_factor",
    "inverse_scale",
    "resolve_backend",
]
