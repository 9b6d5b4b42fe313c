"""kernels/supported.py: each input rule has one definition, and its messages come from it."""

from __future__ import annotations

import math

import pytest
import torch

from tritonscale.grads.groups import collect_grads
from tritonscale.kernels.supported import (
    NORM_CODES,
    SUPPORTED_DTYPES,
    is_supported_grad,
    norm_code,
    raise_unsupported_grad,
)
from tritonscale.kernels.tensor_table import validate_group
from tritonscale.passes.clip_args import check_max_norm, check_norm_type, kernels_compute


def test_norm_types_map_to_distinct_kernel_codes():
    assert set(NORM_CODES) == {1.0, 2.0, math.inf}
    assert len(set(NORM_CODES.values())) == len(NORM_CODES)
    for norm_type, code in NORM_CODES.items():
        assert norm_code(norm_type) == code and kernels_compute(check_norm_type(norm_type))
    for other in (0, 3.0, -1.0, 0.5, -math.inf):  # torch computes them: so do we, with torch ops
        assert check_norm_type(other) == float(other) and not kernels_compute(other)
        with pytest.raises(ValueError, match="norm_type must be 1, 2 or inf"):
            norm_code(other)
    for bad in (math.nan, "2", None, True):
        with pytest.raises(ValueError, match="norm_type must be a number"):
            check_norm_type(bad)


@pytest.mark.parametrize("bad", [-1.0, -math.inf, math.nan, True, "1.0", None, 10**400])
def test_max_norm_must_be_a_float_from_zero_to_inf(bad):
    with pytest.raises(ValueError, match="max_norm must be a float >= 0"):
        check_max_norm(bad)
    assert check_max_norm(3) == 3.0 and isinstance(check_max_norm(3), float)
    assert check_max_norm(0) == 0.0 and check_max_norm(math.inf) == math.inf  # as torch takes them


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_unsupported_dtype_message_lists_the_supported_dtypes(dtype):
    grad = torch.zeros(4, dtype=dtype)
    assert not is_supported_grad(grad)
    with pytest.raises(TypeError) as info:
        raise_unsupported_grad(grad, "gradient 3")
    message = str(info.value)
    assert message.startswith("gradient 3 ")
    named = message.split("supported: ")[1].split(", ")
    assert named == [str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES]


@pytest.mark.parametrize(
    "grad, supported",
    [
        (torch.zeros(5, 4), True),
        (torch.zeros(5, 4).t(), True),  # dense in another dimension order
        (torch.zeros(5, 4, dtype=torch.bfloat16), True),
        (torch.zeros(10, 4)[::2], False),  # strided: a copy would drop the in-place update
        (torch.zeros(4).to_sparse(), False),
        (torch.zeros(4, dtype=torch.int32), False),
    ],
    ids=["contiguous", "transposed", "bf16", "strided", "sparse", "int"],
)
def test_the_controller_and_the_tensor_table_apply_the_same_rule(grad, supported):
    # One rule decides: the controller sends what it accepts to the kernels and the rest to torch
    # ops (int gradients excepted: a clear error); the tensor table, the kernels' door, refuses the
    # rest with a clear error.
    assert is_supported_grad(grad) is supported
    param = torch.nn.Parameter(torch.zeros(grad.shape, dtype=torch.float32))
    param.grad_dtype = None  # let the parameter hold a gradient of another dtype or layout
    param.grad = grad
    optimizer = torch.optim.SGD([param], lr=0.1)
    if supported:
        grads = collect_grads(optimizer, allow_fp16=True)
        assert grads.by_dtype[grad.device] == [[grad]] and not grads.other
        validate_group([grad])
        return
    with pytest.raises((TypeError, ValueError)) as info:
        validate_group([grad])
    assert str(info.value).startswith("gradient 0")
    if grad.is_floating_point():
        grads = collect_grads(optimizer, allow_fp16=True)
        assert not grads.by_dtype and len(grads.other[grad.device]) == 1
    else:
        with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\] has a non-floating"):
            collect_grads(optimizer, allow_fp16=True)
