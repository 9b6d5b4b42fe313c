"""What the kernels accept: gradient dtypes and layouts, norm types. One home per rule.

The controller (``tritonscale.grads.groups``) and the host-side tensor table both call these, so a
rule and its error message are written once. The user's ``max_norm``/``norm_type`` arguments are
checked in ``tritonscale/passes/clip_args.py``.
"""

from __future__ import annotations

import math
from typing import NoReturn

import torch

#: Gradient dtypes the kernels read and write (accumulation is always float32).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Code passed to the kernels for the max-abs (infinity) norm; 1 and 2 are passed as themselves.
NORM_INF = 0
#: torch-style ``norm_type`` -> the kernels' constexpr ``NORM`` code.
NORM_CODES = {1.0: 1, 2.0: 2, math.inf: NORM_INF}


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def norm_code(norm_type: float) -> int:
    """Map a torch-style ``norm_type`` (1, 2 or inf) to the kernels' code; anything else raises."""
    code = NORM_CODES.get(float(norm_type)) if isinstance(norm_type, (int, float)) else None
    if code is None:
        raise ValueError(f"norm_type must be 1, 2 or inf, got {norm_type!r}")
    return code


def is_dense(t: torch.Tensor) -> bool:
    """True when the elements of ``t`` fill exactly ``numel`` consecutive slots (any dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def is_supported_grad(grad: torch.Tensor) -> bool:
    """True when the kernels can update ``grad`` in place. Runs for every gradient of every step,
    so the cheap tests come first; ``raise_unsupported_grad`` says which one failed."""
    return grad.dtype in SUPPORTED_DTYPES and grad.layout is torch.strided and is_dense(grad)


def raise_unsupported_grad(grad: torch.Tensor, where: str) -> NoReturn:
    """Raise the clear error for a gradient ``is_supported_grad`` refused; ``where`` names it."""
    if grad.layout is not torch.strided:
        raise TypeError(f"{where} has a {grad.layout} gradient; tritonscale supports dense (strided) gradients only")
    if not grad.is_floating_point():
        raise TypeError(f"{where} has a non-floating gradient of dtype {grad.dtype}")
    if grad.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where} has a {grad.dtype} gradient; supported: {_dtype_names(SUPPORTED_DTYPES)}")
    # .contiguous() would hand the kernels a copy and silently drop the in-place update.
    raise ValueError(
        f"{where}: gradient of shape {tuple(grad.shape)} and stride {grad.stride()} is not dense; "
        "tritonscale updates gradients in place and will not work on a copy"
    )
