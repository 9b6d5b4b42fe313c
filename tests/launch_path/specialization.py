"""What Triton's launcher should specialize a launch on, restated from the documented rules.

Independent of Triton's binder: from the kernel's declared parameters and the launch's arguments.
A tensor is a pointer to its dtype, 16-byte aligned when its ``data_ptr()`` is a multiple of 16;
``None`` and an int equal to 1 become constexprs (they leave the parameter block); other ints are
``i32`` below 2**31 (``i64`` below 2**63, else ``u64``), divisible when a multiple of 16; a bool is
``i1``, a float ``fp32``. Declared ``tl.constexpr`` parameters are constexprs.
"""

from __future__ import annotations

import torch

#: torch dtype -> Triton's pointer element type name.
POINTEE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def arg_type(value, declared_constexpr: bool) -> tuple[str, bool]:
    """(specialized type, divisible by 16) of one argument."""
    if declared_constexpr or value is None:
        return "constexpr", False
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        ty = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        return ty, value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"no rule here for an argument of type {type(value).__name__}")


def expected_specialization(arg_names: list[str], constexpr_indices, args: tuple) -> tuple[dict, set]:
    """(name -> specialized type, the names specialized as divisible by 16) for ``args``.

    Args:
        arg_names: the kernel's parameters in declaration order (``JITFunction.arg_names``).
        constexpr_indices: the indices of its ``tl.constexpr`` parameters (``JITFunction.constexprs``).
        args: the launch's bound arguments, in the same order.
    Returns:
        the signature Triton should compile for, and the divisible parameters.
    """
    signature, divisible = {}, set()
    for index, (name, value) in enumerate(zip(arg_names, args, strict=True)):
        ty, aligned = arg_type(value, index in constexpr_indices)
        signature[name] = ty
        if aligned:
            divisible.add(name)
    return signature, divisible


def triton_divisible(src) -> set:
    """The parameters a compiled kernel's source (``ASTSource``) marks ``tt.divisibility=16``."""
    names = src.fn.arg_names
    return {
        names[path[0]]
        for path, attributes in src.attrs.items()
        if any(a[0] == "tt.divisibility" and a[1] == 16 for a in attributes)
    }
