"""Norm tolerances, for every test that compares a norm with a float64 oracle.

A plain module rather than conftest.py, which pytest loads itself and tests should not import:
``from oracles.tolerances import NORM_RTOL`` works from every test folder, since tests/ is on
sys.path (pytest's default import mode puts the folder of the top-level conftest.py there).
"""

import torch

# The one tolerance table for norms, relative to a float64 oracle over the same stored values
# (elementwise unscale/clip results and scale updates are compared exactly).
#
# Kernels: all of the difference is float32 accumulation. In the property tests each of the 4096
# lanes of a program sums at most 48 terms (TABLE: <= 6 tensors of <= 70000 elements are <= 12
# chunk rows, 3 per program, 16 blocks each; FLAT: 70000 elements / 2 programs / 4096 < 16). Every
# term is exact up to one rounding (|g| * 2**k is exact, squaring rounds once), all terms are >= 0,
# and the 4096-lane sum adds ~12 levels of pairwise rounding. Worst case for the 1-norm (no square
# root to halve it): (48 + 12 + 2) * 2**-24 ~= 3.7e-6, plus the final rounding to float32 (6e-8).
# 1e-5 leaves a ~2.5x margin for every dtype; observed differences are ~1e-7. Multi-step runs over
# up to ~1e6 elements in other summation orders stay within it too.
NORM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
# float64 gradients go through torch ops in float64; only the reported norm is float32 (one rounding).
NORM_RTOL[torch.float64] = 1e-5
# The torch backend, where it differs: bfloat16 on CPU rounds each tensor's norm to bfloat16 once
# (torch's own clip_grad_norm_ precision, <= 2**-9 relative; see backends/torch_backend.py), and
# combining such norms keeps that relative bound. 2**-8: twice torch's own same-dtype error.
TORCH_BACKEND_NORM_RTOL = {**NORM_RTOL, torch.bfloat16: 2.0**-8}
# torch's own clip coefficient, against which a clipped gradient is compared: float32 as the norm;
# for bfloat16 gradients torch computes it in bfloat16, where the per-tensor norms, their total,
# norm + 1e-6 and max_norm / that each round once (2**-9 relative each).
TORCH_CLIP_COEF_RTOL = {**NORM_RTOL, torch.bfloat16: 4 * 2.0**-9}
# The spike rules' ZClip clip value (tritonscale/policy/spike_rules.py) against ZClip's Python: both
# float64, op for op, but CPython's `x ** 0.5` and `x ** 2` go through libm's pow, which is not
# correctly rounded (1 ulp off sqrt(x) / x * x for ~1 value in 500), while the device rule uses
# IEEE sqrt and products. A few such ulps, carried through the exponential average (each update
# shrinks an earlier error by alpha), and the final rounding to float32 (2**-24): 2**-22 is 4 float32
# ulps, far below any difference a wrong rule makes (the clip values of a wrong rule differ by >1%).
SPIKE_CLIP_RTOL = 2.0**-22
