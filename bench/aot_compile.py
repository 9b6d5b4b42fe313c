"""Ahead-of-time compile of the Triton kernels for GPU targets (tests and bench/kernel_report.py).

Not a test module. It must run in a process WITHOUT ``TRITON_INTERPRET``: under the interpreter
``@triton.jit`` produces ``InterpretedFunction`` objects that cannot be lowered, and the test
suite's conftest sets the variable at import. The test therefore runs this script in a
subprocess with a cleaned environment.

Input (stdin): a JSON list of cases, each

    {"id": str, "kernel": "module:attribute", "target": [backend, arch, warp_size],
     "signature": {arg: type}, "constexprs": {arg: value}, "divisible": [arg, ...],
     "num_warps": int, "options": {option: value} (optional, e.g. enable_fp_fusion)}

A constexpr that is a NamedTuple (the policy kernel's rule) travels as
``{"namedtuple": "module:Class", "fields": {name: value}}``. A constexpr parameter with a default
that a case leaves out (the kernels' constants, ``K``) gets its default, as at a launch.

Output (stdout): a JSON object mapping each case id to what the compile produced: ``ok`` and
``error``, the global load/store instructions found in the assembly, and register/spill figures
(cuobjdump resource usage and SASS spill instructions of the cubin for CUDA, the kernel
descriptor for AMD). Only what the
tests check is extracted, so the output stays small. No GPU is needed: Triton's bundled ptxas and
LLVM AMDGPU backend do all the work.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ProcessPoolExecutor

# PTX global memory instructions, e.g. "ld.global.v4.b32", "st.global.b16".
_PTX_MEMOPS = re.compile(r"\b(?:ld|st)\.global[\w.:]*")
# AMDGCN global memory instructions, e.g. "buffer_load_dwordx4", "global_store_short".
_AMD_MEMOPS = re.compile(r"\b(?:global|buffer)_(?:load|store)_\w+")
# Fields of the AMDGPU kernel descriptor / metadata that say whether anything spilled.
_AMD_FIELDS = (
    "vgpr_count",
    "sgpr_count",
    "vgpr_spill_count",
    "sgpr_spill_count",
    "private_segment_fixed_size",
    "group_segment_fixed_size",
)
# cuobjdump --dump-resource-usage line for a function: "REG:80 STACK:0 SHARED:0 LOCAL:0 ...".
_CUDA_FIELDS = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")
# SASS local-memory store/load instructions, e.g. "STL [R1], R3 ;", "LDL.LU R11, [R1] ;".
_SASS_STL = re.compile(r"\sSTL(?:\.\w+)*\s")
_SASS_LDL = re.compile(r"\sLDL(?:\.\w+)*\s")


def _resolve(spec: str):
    """'module:attribute' -> the JITFunction (an Autotuner wraps it: the AOT path needs ``.fn``)."""
    module, attribute = spec.split(":")
    fn = getattr(importlib.import_module(module), attribute)
    from triton.runtime.autotuner import Autotuner

    return fn.fn if isinstance(fn, Autotuner) else fn


def _constexpr(value):
    """A constexpr from its JSON form: a NamedTuple rebuilt from its class and fields."""
    if isinstance(value, dict) and "namedtuple" in value:
        module, attribute = value["namedtuple"].split(":")
        return getattr(importlib.import_module(module), attribute)(**value["fields"])
    return value


def _cuobjdump() -> str | None:
    """Path of cuobjdump: Triton bundles one next to ptxas; else whatever is on PATH."""
    try:
        import triton

        path = triton.knobs.nvidia.cuobjdump.path
        if path and os.path.exists(path):
            return path
    except Exception:  # no bundled tool in this triton build: fall back to PATH
        pass
    import shutil

    return shutil.which("cuobjdump")


def _cuda_resources(cubin: bytes) -> dict[str, int] | None:
    """Registers, stack and local memory of the cubin, and its spill instructions.

    The kernels declare no local arrays, so every STL/LDL in the SASS is a register spill (what
    ptxas -v reports as "spill stores/loads"). Disassembling takes ~0.5 s, so it is only done when
    the cubin has a stack frame or local memory at all: without one nothing can have spilled.
    """
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()

        def dump(*flags: str) -> str | None:
            out = subprocess.run([tool, *flags, f.name], capture_output=True, text=True)
            return out.stdout if out.returncode == 0 else None

        usage = dump("--dump-resource-usage")
        fields = {k: int(v) for k, v in _CUDA_FIELDS.findall(usage or "")}
        if not fields:
            return None
        fields["spill_stores"] = fields["spill_loads"] = 0
        if fields["STACK"] or fields["LOCAL"]:
            sass = dump("--dump-sass")
            if sass is None:
                return None
            fields["spill_stores"] = len(_SASS_STL.findall(sass))
            fields["spill_loads"] = len(_SASS_LDL.findall(sass))
    return fields


def _amd_resources(amdgcn: str) -> dict[str, int]:
    fields = {}
    for name in _AMD_FIELDS:
        m = re.search(rf"^\s*\.{name}:\s*(\d+)", amdgcn, re.MULTILINE)
        if m:
            fields[name] = int(m.group(1))
    return fields


def _with_defaults(fn, case: dict) -> dict:
    """``case`` with each constexpr parameter it leaves out that has a default (the kernels'
    ``K: tl.constexpr = KERNEL_CONSTANTS``) bound to that default, as a launch's binder binds it."""
    import inspect

    signature, constexprs = dict(case["signature"]), dict(case["constexprs"])
    for name, parameter in inspect.signature(fn.fn).parameters.items():
        if name not in signature and parameter.default is not inspect.Parameter.empty:
            signature[name] = "constexpr"
            constexprs[name] = parameter.default
    ordered = {name: signature[name] for name in fn.arg_names if name in signature}  # declaration order
    return {**case, "signature": {**ordered, **signature}, "constexprs": constexprs}


def compile_case(case: dict) -> tuple[str, dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = {"ok": False, "error": None}
    try:
        fn = _resolve(case["kernel"])
        case = _with_defaults(fn, case)
        # A parameter left out of the signature fails deep in codegen with an opaque
        # "'NoneType' object has no attribute '_unflatten_ir'": name it instead.
        missing = [name for name in fn.arg_names if name not in case["signature"]]
        if missing:
            raise TypeError(f"signature lacks {missing} of {case['kernel']}{fn.arg_names}")
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in case["divisible"]}
        constexprs = {name: _constexpr(value) for name, value in case["constexprs"].items()}
        src = ASTSource(fn=fn, signature=case["signature"], constexprs=constexprs, attrs=attrs)
        options = {"num_warps": case["num_warps"], **case.get("options", {})}
        compiled = triton.compile(src, target=GPUTarget(*case["target"]), options=options)
    except Exception:
        result["error"] = traceback.format_exc(limit=3)
        return case["id"], result

    asm = compiled.asm
    result["ok"] = True
    result["asm_kinds"] = sorted(asm)
    if "ptx" in asm:
        ptx = asm["ptx"]
        ops = _PTX_MEMOPS.findall(ptx)
        result["fused_multiply_adds"] = len(re.findall(r"\bfma\.", ptx))
        result["float64_ops"] = len(re.findall(r"\.f64\b", ptx))
        result["ptx_local"] = ".local" in ptx
        result["resources"] = _cuda_resources(asm["cubin"]) if "cubin" in asm else None
    else:
        amdgcn = asm.get("amdgcn", "")
        ops = _AMD_MEMOPS.findall(amdgcn)
        result["float64_ops"] = len(re.findall(r"\bv_\w+_f64\b", amdgcn))
        result["hsaco_bytes"] = len(asm.get("hsaco", b""))
        result["resources"] = _amd_resources(amdgcn)
    result["loads"] = sorted({op for op in ops if "ld." in op or "_load_" in op})
    result["stores"] = sorted({op for op in ops if "st." in op or "_store_" in op})
    return case["id"], result


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("aot_compile: TRITON_INTERPRET is set; kernels would be interpreted, not compiled")
    cases = json.load(sys.stdin)
    # Compiles are CPU-bound and independent; the parent imports nothing heavy before forking.
    workers = max(1, min(len(cases), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = dict(pool.map(compile_case, cases, chunksize=4))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
