"""Whether a compiled kernel computes its memory offsets in 64 bits: a data-flow check of its PTX
and LLVM IR (used by ``bench/aot_compile.py``; tests/test_compile_targets.py asserts on it).

What must not happen is a narrow (32- or 16-bit) integer operation that can wrap on a value large
enough to matter. Such values start at the *sources*:

* the program id and the number of programs (``%ctaid``/``%nctaid`` in PTX; the NVVM/AMDGPU
  intrinsics and the implicit-argument loads that give them in LLVM IR);
* the kernel's integer arguments (element counts, strides): a Python int below 2**31 reaches the
  kernel as an i32 that may sit just under 2**31, so ``n + BLOCK - 1`` already wraps;
* 64-bit integers the kernel loads from memory (the tensor table's addresses, sizes and starts).

Everything computed from a source is *tainted* (flow-insensitively: a register assigned anywhere
from a tainted operand is tainted everywhere, which over-approximates and so never misses a
path). A tainted value may be compared, widened (``cvt.s64.s32``, ``sext``), multiplied *wide*
(``mul.wide.s32``: a 64-bit product of 32-bit operands, which cannot wrap) and combined with
bitwise operations (they cannot carry past their width), but it must not meet a narrow ``add``,
``sub``, ``mul``, ``mad`` or ``shl``, nor be truncated to fewer than 64 bits: those are where an
offset past 2**31 wraps. That is exactly the int32-indexing bug: ``pid * BLOCK`` multiplied in 32
bits (``shl.b32 %r, %ctaid, 12``) and only then sign-extended for the address
(``mul.wide.s32 %rd, %r, 2``). Note that the final ``mul.wide.s32`` appears in the buggy and the
correct code alike: seeing it proves nothing; what precedes it does.

A loop counter needs one more rule: ``for i in range(0, n, BLOCK)`` in 32 bits steps ``i`` by a
constant, no operand of its ``add`` is tainted, yet it wraps once ``n`` nears 2**31. So a narrow
value compared (in a narrow comparison) with a tainted one must not be made by narrow arithmetic
either (in LLVM IR: neither it nor, for a loop phi, its incoming values).

Two kinds of value are not propagated: predicates (a comparison's outcome carries no offset) and
values loaded through a tainted address (the gradient data, not an index). Values made from the
thread index and constants alone (a lane's offset inside its block, the shared-memory slots of a
reduction) are not sources, so their 32-bit arithmetic is not reported.
"""

from __future__ import annotations

import re

# --- PTX ------------------------------------------------------------------------------------------

_PTX_REG = re.compile(r"%[a-z]+\d+")
_PTX_SREG_SOURCE = re.compile(r"%n?ctaid\.[xyz]")
# An integer parameter (not a pointer): ".param .u32 name" / ".param .u64 name" without ".ptr".
_PTX_INT_PARAM = re.compile(r"\.param\s+\.[usb](?:32|64|16)\s+(\w+)\s*[,)]?\s*$")
# Narrow integer arithmetic that can wrap: add/sub/mul(.lo/.hi)/mad/shl/neg on a 16/32-bit type.
# "mul.wide"/"mad.wide" produce a 64-bit result from 32-bit operands and cannot wrap.
_PTX_NARROW_ARITH = re.compile(r"^(?:add|sub|mul|mad|shl|neg|mul24|mad24)(?:\.(?:lo|hi|cc|sat))*\.[usb](?:16|32)$")
# Truncation of a 64-bit integer to a narrower one: cvt.u32.u64, cvt.s16.s64, ...
_PTX_TRUNC = re.compile(r"^cvt(?:\.\w+)*\.[usb](?:8|16|32)\.[usb]64$")


def _ptx_instructions(ptx: str):
    """(opcode, destination registers, source registers, text) of every PTX instruction."""
    for raw in ptx.split(";"):
        # Comments, directives, labels and the braces of scopes ("{" / "}" alone on a line) are not code.
        lines = [line.split("//")[0].strip() for line in raw.splitlines()]
        code = [line for line in lines if line and line not in ("{", "}") and not line.startswith(".")]
        text = " ".join(line for line in code if not line.endswith(":"))
        text = re.sub(r"^\$\S+:\s*", "", text).strip()
        if not text:
            continue
        if text.startswith("@"):  # guard predicate: not a data operand
            text = text.split(None, 1)[1] if " " in text else ""
        parts = text.split(None, 1)
        if not parts:
            continue
        opcode, operands = parts[0], parts[1] if len(parts) > 1 else ""
        if opcode.startswith(("st.", "bra", "ret", "bar", "red.")):  # no destination
            yield opcode, [], _PTX_REG.findall(operands), text
            continue
        # The destination is the first operand (a register or a {vector} of them).
        if operands.startswith("{"):
            dest_text, _, rest = operands[1:].partition("}")
        else:
            dest_text, _, rest = operands.partition(",")
        yield opcode, _PTX_REG.findall(dest_text), _PTX_REG.findall(rest), text


def ptx_narrow_index_ops(ptx: str) -> list[str]:
    """The PTX instructions where a value derived from a program id, a program count, an integer
    argument or a loaded 64-bit integer meets narrow arithmetic or a truncation (empty: the kernel
    indexes in 64 bits)."""
    int_params = set()
    for line in ptx.splitlines():
        m = _PTX_INT_PARAM.search(line.split("//")[0])
        if m and ".ptr" not in line:
            int_params.add(m.group(1))
    insts = list(_ptx_instructions(ptx))
    tainted: set[str] = set()

    def is_source(opcode, dests, srcs, text):
        if _PTX_SREG_SOURCE.search(text):
            return True
        if opcode.startswith("ld.param"):
            name = re.search(r"\[\s*(\w+)", text)
            return bool(name and name.group(1) in int_params)
        # A 64-bit integer load from global memory: the tensor table.
        return opcode.startswith("ld.global") and any(d.startswith("%rd") for d in dests)

    changed = True
    while changed:  # fixpoint: loops assign registers before their textual uses
        changed = False
        for opcode, dests, srcs, text in insts:
            if not dests or all(d in tainted for d in dests):
                continue
            if opcode.startswith("setp"):  # predicates carry no offset
                continue
            if is_source(opcode, dests, srcs, text) or (
                not opcode.startswith("ld.") and any(s in tainted for s in srcs if not s.startswith("%p"))
            ):
                tainted.update(d for d in dests if not d.startswith("%p"))
                changed = True
    # A narrow counter compared with a large bound: `for i in range(0, n, BLOCK)` in 32 bits
    # steps i without any tainted operand, but wraps once n is near 2**31.
    bounded_by_large = set()
    for opcode, dests, srcs, text in insts:
        if re.match(r"^setp\.\w+\.[usb](?:16|32)$", opcode) and any(s in tainted for s in srcs):
            bounded_by_large.update(s for s in srcs if s not in tainted)
    found = []
    for opcode, dests, srcs, text in insts:
        narrow = _PTX_NARROW_ARITH.match(opcode) or _PTX_TRUNC.match(opcode)
        if narrow and (any(s in tainted for s in srcs) or any(d in bounded_by_large for d in dests)):
            found.append(text)
        elif opcode.startswith("mov.b64") and dests and any(s in tainted for s in srcs) and "{" in text.split(",")[0]:
            found.append(text)  # mov.b64 {%r1, %r2}, %rd: a split into halves is a truncation
    return found


_PTX_LOOP_COMMENT = re.compile(r"(?:Inner Loop Header: Depth=(\d+)|in Loop: Header=(\w+) Depth=(\d+))")


def ptx_inner_loop(ptx: str) -> dict[str, int]:
    """Instruction counts of the innermost loop of a PTX kernel (the deepest loop LLVM's block
    comments name): ``instructions`` in all, and how many are 64-bit and narrow integer
    arithmetic (``int64_ops``, ``int32_ops``: add/sub/mul/mad/shl/min/max/setp on .s64/.u64/.b64,
    resp. .s32/.u32/.b32). Empty without a loop."""
    blocks: list[tuple[str | None, int | None, list[str]]] = []  # (loop header, depth, lines)
    current: list[str] = []
    header, depth = None, None
    label = None
    for line in ptx.splitlines():
        code, _, comment = line.partition("//")
        code = code.strip()
        block_label = code.startswith("$L__BB") and code.endswith(":")  # not the $L__tmp debug labels
        if block_label or comment.strip().startswith("%bb."):
            blocks.append((header, depth, current))
            current, header, depth = [], None, None
            label = code[len("$L__") : -1] if block_label else None
        m = _PTX_LOOP_COMMENT.search(comment)
        if m:
            if m.group(1):
                header, depth = label, int(m.group(1))
            else:
                header, depth = m.group(2), int(m.group(3))
        if code and not code.endswith(":") and not code.startswith("."):
            current.append(code)
    blocks.append((header, depth, current))
    loops = [(d, h) for h, d, _ in blocks if d is not None]
    if not loops:
        return {}
    deepest = max(d for d, _ in loops)
    inner = next(h for d, h in loops if d == deepest)
    lines = [code for h, d, body in blocks if h == inner for code in body]
    ops = [line.split()[1] if line.startswith("@") else line.split()[0] for line in lines]
    int_ops = re.compile(r"^(?:add|sub|mul|mad|shl|min|max|setp\.\w+|and|or)(?:\.\w+)*\.")
    return {
        "instructions": len(ops),
        "int64_ops": sum(1 for op in ops if int_ops.match(op) and re.search(r"\.[usb]64$", op)),
        "int32_ops": sum(1 for op in ops if int_ops.match(op) and re.search(r"\.[usb]32$", op)),
    }


# --- LLVM IR --------------------------------------------------------------------------------------

_LL_DEF = re.compile(r"^\s*(%[\w.]+)\s*=\s*(.*)$")
_LL_VALUE = re.compile(r"%[\w.]+")
_LL_SOURCE_CALL = re.compile(
    r"@llvm\.(?:nvvm\.read\.ptx\.sreg\.n?ctaid|amdgcn\.workgroup\.id|amdgcn\.implicitarg\.ptr)"
)
# Narrow integer arithmetic (scalar or vector) and truncation.
_LL_NARROW = re.compile(r"^(?:add|sub|mul|shl)\b[\w ]*?\s(?:<\d+ x )?i(?:8|16|32)\b")
_LL_TRUNC = re.compile(r"^trunc\s+(?:<\d+ x )?i64\b.*\bto\s+(?:<\d+ x )?i(?:8|16|32)\b")


def llir_narrow_index_ops(llir: str) -> list[str]:
    """The LLVM IR instructions of the kernel where a tainted value (see the module docstring)
    meets narrow arithmetic or a truncation to fewer than 64 bits (empty: 64-bit indexing). On
    gfx942 this is the IR the AMDGPU backend lowers to AMDGCN; its instruction selection keeps the
    IR's integer semantics, so what is 64-bit here is 64-bit in the machine code."""
    define = re.search(r"^define[^\n]*\{$", llir, re.MULTILINE)
    if define is None:
        return []
    header = define.group(0)
    body = llir[define.end() : llir.index("\n}", define.end())]
    # Integer arguments: "i32 %3", "i64 inreg %3", "i32 noundef %x".
    tainted = set(re.findall(r"\bi(?:32|64)\s+(?:(?:inreg|noundef|signext|zeroext)\s+)*(%[\w.]+)", header))
    defs = []
    for line in body.splitlines():
        m = _LL_DEF.match(line.split(", !dbg")[0].split(", !tbaa")[0])
        if m:
            defs.append((m.group(1), m.group(2)))
    changed = True
    while changed:
        changed = False
        for name, rhs in defs:
            if name in tainted or rhs.startswith(("icmp", "fcmp")) or re.match(r"^\w+ i1\b", rhs):
                continue
            if rhs.startswith("load "):
                # A program count (AMDGPU implicit argument) or a 64-bit table value; never data
                # loaded through a tainted pointer.
                source = "addrspace(4)" in rhs or re.match(r"^load (?:<1 x )?i64\b", rhs) is not None
            elif "call" in rhs.split("@")[0] and "@" in rhs:
                callee = rhs.split("@", 1)[1]
                source = bool(_LL_SOURCE_CALL.search("@" + callee))
                if not source and "load" in callee.split("(")[0]:
                    continue  # a memory read: its value is data
                source = source or any(v in tainted for v in _LL_VALUE.findall(callee))
            else:
                source = any(v in tainted for v in _LL_VALUE.findall(rhs))
            if source:
                tainted.add(name)
                changed = True
    # A narrow counter compared with a large bound (see ptx_narrow_index_ops): the compared value,
    # or a loop phi's incoming value, defined by narrow arithmetic.
    rhs_of = dict(defs)
    bounded_by_large = set()
    for name, rhs in defs:
        if re.match(r"^icmp \w+ (?:<\d+ x )?i(?:8|16|32)\b", rhs):
            values = _LL_VALUE.findall(rhs)
            if any(v in tainted for v in values):
                for v in values:
                    if v not in tainted:
                        bounded_by_large.add(v)
                        if rhs_of.get(v, "").startswith("phi "):
                            bounded_by_large.update(_LL_VALUE.findall(rhs_of[v]))
    found = []
    for name, rhs in defs:
        narrow = _LL_NARROW.match(rhs) or _LL_TRUNC.match(rhs)
        if narrow and (any(v in tainted for v in _LL_VALUE.findall(rhs)) or name in bounded_by_large):
            found.append(f"{name} = {rhs}")
    return found
