"""The ``@triton.jit`` helpers every kernel shares, and the one interpreter switch.

A leaf module: it imports nothing from this package, so any kernel file (and the host-side
launch configuration) can import it without a cycle.

``INTERPRETING`` says whether ``@triton.jit`` built this package's kernels for Triton's
interpreter. The decorator decides when it runs, from ``TRITON_INTERPRET`` at that moment, so the
flag is read off a function decorated here, at import, in the same way as every kernel after it.

Float conversions: on a GPU they are plain casts (one ``cvt`` each, rounding to nearest even).
Triton's interpreter (3.9) truncates float32 -> bfloat16 instead of rounding, and misreads
bfloat16 subnormals, so under the interpreter bfloat16 goes through its bits -- exact on any
backend.
"""

import triton
import triton.language as tl


@triton.jit
def _decorated_probe():
    pass


# Compared by module name, not isinstance: importing triton.runtime.interpreter needs numpy, which
# plain (torch-backend) use of tritonscale does not.
INTERPRETING: bool = type(_decorated_probe).__module__ == "triton.runtime.interpreter"


# No module constant is read inside a kernel (Triton would check it on every launch,
# kernels/interfaces.py): the interpreter's conversions are their own functions.
if INTERPRETING:

    @triton.jit
    def to_f32(x):
        """Widen a loaded block to float32 exactly (bfloat16 through its bits)."""
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def from_f32(x, dtype: tl.constexpr):
        """Round a float32 block to ``dtype``, to nearest even (bfloat16 through its bits)."""
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            r = tl.where(x != x, (b >> 16) | 0x40, r)  # NaN stays NaN (a payload in the low bits would carry)
            return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

else:

    @triton.jit
    def to_f32(x):
        """Widen a loaded block to float32 exactly."""
        return x.to(tl.float32)

    @triton.jit
    def from_f32(x, dtype: tl.constexpr):
        """Round a float32 block to ``dtype``, to nearest even."""
        return x.to(dtype)


@triton.jit
def pow2_inverse(x):
    """2**-floor(log2 x), clamped to stay a normal float32 (x = 0 gives 2**126)."""
    e = tl.floor(tl.log2(tl.maximum(x, 1.1754944e-38)))  # below the smallest normal: same clamp, no log2(0)
    e = tl.minimum(tl.maximum(e, -126.0), 126.0)
    return tl.exp2(-e)


@triton.jit
def chunk_span(tensors_ptr, chunks_ptr, chunk, elem_ptr, CHUNK_SIZE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to the first element of chunk row ``chunk`` of a tensor table and the number of
    elements in it (the table's layout: ``tensor_table``)."""
    owner = tl.load(chunks_ptr + 2 * chunk)
    start = tl.load(chunks_ptr + 2 * chunk + 1)
    address = tl.load(tensors_ptr + 2 * owner)
    numel = tl.load(tensors_ptr + 2 * owner + 1)
    p_chunk = address.to(tl.pointer_type(elem_ptr.dtype.element_ty)) + start
    length = tl.minimum(numel - start, CHUNK_SIZE)
    if ALIGNED:
        # Checked on the host when the table was built (start is a multiple of CHUNK_SIZE).
        p_chunk = tl.multiple_of(p_chunk, 16)
        length = tl.multiple_of(length, 16)
    return p_chunk, length
