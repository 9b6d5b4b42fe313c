"""finalize (kernels/finalize.py): the norm at float32's edge, all-zero groups, a fixed reduction order.

Its results against tritonscale.kernels.reference on every kind of input are checked with the check
pass it reduces (tests/kernels/test_check_pass.py); these are the cases about finalize's own rules.
"""

import math

import pytest
import torch
from oracles.kernel_cases import DTYPES, FP32_MAX, NORM_TYPES, UNALIGNED, bits, dtype_id, make_grads, run_check

from tritonscale.kernels import apply_factor_
from tritonscale.kernels.launch_config import CHUNK, DEFAULT_BLOCK
from tritonscale.kernels.reference import f32, finalize_ref, inv_scale_of


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's f64 -> f32
@pytest.mark.parametrize("norm_type", [1.0, 2.0], ids=lambda n: f"norm={n:g}")
@pytest.mark.parametrize("max_norm", [None, 5.0], ids=["no-clip", "clip"])
def test_norm_above_float32_range_is_inf_but_not_found_inf(norm_type, max_norm):
    """Worked example: four gradients of float32's max with scale 1 have a 2-norm of 2 * 3.4e38 and a
    1-norm of 4 * 3.4e38, both above float32's range: norm = inf, but no element is non-finite, so
    found_inf = 0 and clip_grad_norm_'s rule gives clip_coef = 5 / inf = 0, factor = 0."""
    grads = [torch.full((4,), FP32_MAX)]
    layout, _, res, _ = run_check(grads, 1.0, norm_type, max_norm)
    found_inf, norm, clip_coef, factor = res
    assert found_inf == 0.0 and norm == math.inf
    assert (clip_coef, factor) == ((1.0, 1.0) if max_norm is None else (0.0, 0.0))
    assert finalize_ref(grads, 1.0, norm_type, max_norm).norm > FP32_MAX


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sizes", [[1], [UNALIGNED], [0, 17, UNALIGNED, 3]], ids=["one", "flat", "table"])
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
def test_all_zero_gradients(dtype, sizes, norm_type):
    grads = [torch.zeros(n, dtype=dtype) for n in sizes]
    grads[-1].view(-1)[0] = -0.0  # the sign of zero must not matter either
    layout, _, res, result = run_check(grads, 3.0, norm_type, 1.0)
    assert res == [0.0, 0.0, 1.0, f32(inv_scale_of(3.0))]
    apply_factor_(layout, result[3:4])
    assert all(bool((g == 0).all()) for g in grads)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=lambda n: f"norm={n:g}")
@pytest.mark.parametrize(
    "sizes", [[4 * CHUNK + 999], [CHUNK + 1, 5, CHUNK, 3 * DEFAULT_BLOCK, CHUNK + 7]], ids=["FLAT", "TABLE"]
)
def test_check_and_finalize_are_deterministic(sizes, norm_type):
    grads = make_grads(sizes, torch.float32, seed=13, magnitude=3.0)
    layout1, partials1, _, result1 = run_check(grads, 3.0, norm_type, 0.5)
    layout2, partials2, _, result2 = run_check(grads, 3.0, norm_type, 0.5)
    assert layout1.programs == layout2.programs == 4  # more chunks than programs: grid-stride loops
    assert torch.equal(bits(partials1), bits(partials2)), "partials differ between identical runs"
    assert torch.equal(bits(result1), bits(result2)), f"{result1.tolist()} != {result2.tolist()}"
