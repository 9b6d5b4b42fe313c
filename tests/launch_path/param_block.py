"""The kernel parameter block a launch should hand ``cuLaunchKernelEx``, computed from its arguments.

Independent of Triton's launcher: from the compiled kernel's specialized signature (which
parameters are constexpr, each other parameter's type) and the bound arguments only. Triton's C
launcher (3.6 and 3.9) passes one parameter per non-constexpr argument, in declaration order, then
two trailing pointers: the global and the profile scratch (0 when the kernel needs none, as the
per-step kernels do).

    expected_params(signature, args) -> [bytes, ...]   # one entry per parameter, little-endian
"""

from __future__ import annotations

import struct

#: Specialized scalar type -> struct format of its parameter.
SCALAR_FORMATS = {
    "i1": "<b",
    "i8": "<b",
    "i16": "<h",
    "i32": "<i",
    "i64": "<q",
    "u1": "<B",
    "u8": "<B",
    "u16": "<H",
    "u32": "<I",
    "u64": "<Q",
    "fp16": "<e",
    "bf16": None,  # packed from its float32 bits below
    "fp32": "<f",
    "f32": "<f",
    "fp64": "<d",
}
#: Parameters Triton's launcher appends after the kernel's own: global and profile scratch pointers.
TRAILING_SCRATCH = 2


def pack(ty: str, value) -> bytes:
    """The bytes of one parameter of specialized type ``ty`` holding ``value``."""
    if ty.startswith("*"):
        address = 0 if value is None else value if isinstance(value, int) else value.data_ptr()
        return struct.pack("<Q", address)
    if ty == "bf16":
        return struct.pack("<f", value)[2:]
    return struct.pack(SCALAR_FORMATS[ty], value)


def expected_params(signature: dict, args: tuple, scratch: tuple[int, int] = (0, 0)) -> list[bytes]:
    """Each parameter's bytes for a launch with ``args`` (every bound argument, constexprs too, in
    declaration order) of a kernel compiled with ``signature`` (name -> specialized type).

    Args:
        signature: the compiled kernel's ``src.signature`` ("constexpr" marks a dropped argument).
        args: the launch's bound arguments, in ``signature``'s order.
        scratch: the trailing global and profile scratch addresses.
    Returns:
        one ``bytes`` per kernel parameter, the trailing scratch pointers last.
    """
    types = list(signature.values())
    if len(types) != len(args):
        raise ValueError(f"{len(args)} arguments for a signature of {len(types)}")
    block = [pack(ty, arg) for ty, arg in zip(types, args) if ty != "constexpr"]
    return block + [struct.pack("<Q", address) for address in scratch]
