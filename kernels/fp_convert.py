"""Float conversions at the kernels' loads and stores.

On a GPU these are plain casts (one ``cvt`` each, rounding to nearest even). Triton's interpreter
(3.9) truncates float32 -> bfloat16 instead of rounding, and misreads bfloat16 subnormals, so under
the interpreter bfloat16 goes through its bits -- exact on any backend. The switch is a constexpr
fixed when this module is imported, which is also when ``@triton.jit`` picks the interpreter.
"""

import triton
import triton.language as tl
from triton import knobs

BF16_VIA_BITS = tl.constexpr(bool(knobs.runtime.interpret))


@triton.jit
def to_f32(x):
    """Widen a loaded block to float32 exactly."""
    if BF16_VIA_BITS and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def from_f32(x, dtype: tl.constexpr):
    """Round a float32 block to ``dtype``, to nearest even."""
    if BF16_VIA_BITS and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, (b >> 16) | 0x40, r)  # NaN stays NaN (a payload in the low bits would carry)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
