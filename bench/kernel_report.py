"""Static report of the compiled kernels: registers, spills, shared memory, global access widths.

Question answered: what does each kernel compile to on a real GPU target, with no GPU present?
Every kernel is compiled ahead of time (``bench/aot_compile.py``, in a subprocess without
TRITON_INTERPRET) at its default launch configuration, for each gradient dtype and layout:

* FLAT: a padded flat buffer (pointer and length specialised as multiples of 16);
* TABLE: a pointer table with ``ALIGNED`` (addresses and sizes host-checked multiples of 16);
* TABLE unaligned: any tensors.

Access widths are of the gradient loads/stores; on AMD they also count the 16-byte reads of the
int64 pointer-table rows, which cannot be told apart in the assembly.

    python bench/kernel_report.py                       # sm_90 and gfx942
    python bench/kernel_report.py --targets sm80 --out out/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {"sm90": ["cuda", 90, 32], "sm80": ["cuda", 80, 32], "gfx942": ["hip", "gfx942", 64]}
DTYPES = ("fp32", "fp16", "bf16")
LAYOUTS = {"flat": (True, False), "table-aligned": (False, True), "table": (False, False)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=["sm90", "gfx942"])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--out", type=Path, default=Path("out/kernel_report.json"))
    return parser.parse_args(argv)


def _signature(arg_names, grad_dtype: str, constexprs: dict) -> dict[str, str]:
    """Argument types as the launcher would specialise them (ints as i32, pointers by role)."""
    types = {"grad_ptr": f"*{grad_dtype}", "tensors_ptr": "*i64", "chunks_ptr": "*i64", "max_norm": "fp32"}
    signature = {}
    for name in arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = "*fp32" if name.endswith("_ptr") else "i32"
    return signature


def build_cases(targets: list[str], dtypes: list[str]) -> list[dict]:
    # Imported here: the report process itself may run under the interpreter; only names are needed.
    from tritonscale.kernels.apply_pass import apply_kernel
    from tritonscale.kernels.check_pass import check_pass_kernel
    from tritonscale.kernels.launch_config import CHUNK, FINALIZE_NUM_WARPS, streaming_configs

    default = streaming_configs()[0]
    cases = []
    for target in targets:
        for dtype in dtypes:
            for layout, (flat, aligned) in LAYOUTS.items():
                common = {"FLAT": flat, "ALIGNED": aligned, "CHUNK_SIZE": CHUNK}
                divisible = ["grad_ptr", "num_items"] if flat else []
                check = {**common, "NORM": 2, "BLOCK": default.kwargs["BLOCK"]}
                apply = {**common, "INVERT": False, "CHECK": False, "BLOCK": default.kwargs["BLOCK"]}
                for kernel, fn, constexprs, warps in (
                    ("check_pass", check_pass_kernel, check, default.num_warps),
                    ("apply_pass", apply_kernel, apply, default.num_warps),
                ):
                    cases.append({
                        "id": f"{kernel}-{target}-{dtype}-{layout}",
                        "kernel": f"tritonscale.kernels.{kernel}:{fn.__name__}",
                        "target": TARGETS[target],
                        "signature": _signature(fn.arg_names, dtype, constexprs),
                        "constexprs": constexprs,
                        "divisible": divisible,
                        "num_warps": warps,
                    })  # fmt: skip
        from tritonscale.kernels.finalize import finalize_kernel
        from tritonscale.kernels.interfaces import STEP_OFF

        # As finalize() launches it for a plain clip: the step's rules off, fused multiply-adds off.
        constexprs = {"NORM": 2, "HAS_CLIP": True, "BLOCK_P": 1024, **STEP_OFF, "HAS_EARLIER": False}
        cases.append({
            "id": f"finalize-{target}-fp32-partials",
            "kernel": "tritonscale.kernels.finalize:finalize_kernel",
            "target": TARGETS[target],
            "signature": _signature(finalize_kernel.arg_names, "fp32", constexprs),
            "constexprs": constexprs,
            "divisible": [],
            "num_warps": FINALIZE_NUM_WARPS,
            "options": {"enable_fp_fusion": False},
        })  # fmt: skip
    return cases


def compile_all(cases: list[dict]) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "aot_compile.py")], input=json.dumps(cases), capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"aot_compile failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def widest(ops: list[str]) -> str:
    """The widest global access: v4/x4 = 16 bytes per thread per instruction."""
    for marker, label in (("v4", "16 B"), ("x4", "16 B"), ("v2", "8 B"), ("x2", "8 B")):
        if any(marker in op for op in ops):
            return label
    return "scalar" if ops else "-"


def main(argv=None, progress=None) -> int:
    """Compile and report; ``progress(done, total)`` is called once the compiles are done (run_all's bar)."""
    args = parse_args(argv)
    cases = build_cases(args.targets, args.dtypes)
    results = compile_all(cases)
    if progress is not None:
        progress(1, 1)
    rows = []
    print(f"{'kernel':<44} {'regs':>5} {'spills':>6} {'shared':>7} {'loads':>7} {'stores':>7}")
    for case in cases:
        r = results[case["id"]]
        if not r["ok"]:
            print(f"{case['id']:<44} FAILED: {r['error'].splitlines()[-1]}")
            rows.append({"id": case["id"], "ok": False, "error": r["error"]})
            continue
        res = r.get("resources") or {}
        regs = res.get("REG", res.get("vgpr_count"))
        spills = res.get("spill_stores", 0) + res.get("spill_loads", 0) + res.get("vgpr_spill_count", 0)
        shared = res.get("SHARED", res.get("group_segment_fixed_size"))
        grad_loads = [op for op in r["loads"] if "b64" not in op]  # the int64 table loads are not gradients
        row = {"id": case["id"], "ok": True, "registers": regs, "spills": spills, "shared_bytes": shared,
               "loads": r["loads"], "stores": r["stores"], "load_width": widest(grad_loads),
               "store_width": widest(r["stores"])}  # fmt: skip
        rows.append(row)
        print(f"{case['id']:<44} {regs if regs is not None else '?':>5} {spills:>6} "
              f"{shared if shared is not None else '?':>7} {row['load_width']:>7} {row['store_width']:>7}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
