"""Ahead-of-time compilation of every Triton kernel for real GPU targets, with no GPU present.

The rest of the suite runs the kernels through Triton's interpreter, which never lowers them: a
kernel that fails to compile for sm_90, sm_80 or gfx942, or one whose loads lost their 16-byte
vectorisation, would go unnoticed until it reached a GPU. These tests lower every kernel through
Triton's real pipeline (ptxas for CUDA, the LLVM AMDGPU backend for ROCm) and check the output.

``conftest.py`` sets ``TRITON_INTERPRET=1`` at import, so the compiles run once per module in a
subprocess (``bench/aot_compile.py``) whose environment lacks it; the tests here only read its JSON.

Signatures mirror what Triton's launcher specialises for real launches: it marks a pointer
``tt.divisibility=16`` when its address is 16-byte aligned (true of torch allocations and of
``flatten_grads_`` buffers) and an integer when it is a multiple of 16. So every pointer gets the
attribute, and ``num_items`` gets it only in "padded" cases: ``flatten_grads_`` pads buffers to a
multiple of 16 elements precisely so that it does. TABLE launches cannot carry the attribute
through the addresses they load, so ``ALIGNED=True`` (host-checked) asserts it in the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tritonscale
from tritonscale import LossScalePolicy
from tritonscale.kernels.interfaces import STEP_OFF
from tritonscale.kernels.launch_config import (
    CHUNK,
    DEFAULT_BLOCK,
    DEFAULT_NUM_WARPS,
    FINALIZE_MAX_BLOCK,
    FINALIZE_NUM_WARPS,
    streaming_configs,
)

HELPER = Path(__file__).resolve().parents[1] / "bench" / "aot_compile.py"
#: The folder holding the tritonscale this process imported (the checkout, or site-packages).
PACKAGE_ROOT = Path(tritonscale.__file__).resolve().parents[1]

TARGETS = {
    "sm90": ["cuda", 90, 32],
    "sm80": ["cuda", 80, 32],
    "gfx942": ["hip", "gfx942", 64],
}
CUDA_TARGETS = ("sm90", "sm80")
DTYPES = ("fp32", "fp16", "bf16")
NORMS = {0: "Linf", 1: "L1", 2: "L2"}  # kernel NORM code -> id fragment
# finalize() picks next_power_of_2(partials): 1024 for one group at 4 programs/SM on a 132-SM H100.
FINALIZE_BLOCK_P = 1024

CHECK = "tritonscale.kernels.check_pass:check_pass_kernel"
APPLY = "tritonscale.kernels.apply_pass:apply_kernel"
FINALIZE = "tritonscale.kernels.finalize:finalize_kernel"
POLICY = "tritonscale.kernels.policy_update:policy_update_kernel"

# Runtime argument types. Python ints below 2**31 are passed as i32 by Triton's launcher, which
# is what every realistic call sees; the i64 variants (buffers over 2**31 elements) are a few cases.
_CHECK_ARGS = (
    "grad_ptr",
    "tensors_ptr",
    "chunks_ptr",
    "num_items",
    "partials_ptr",
    "partials_stride",
)
_APPLY_ARGS = (
    "grad_ptr",
    "tensors_ptr",
    "chunks_ptr",
    "num_items",
    "factor_ptr",
    "found_inf_ptr",
    "size_key",
)
_FINALIZE_SIG = {
    "partials_ptr": "*fp32",
    "num_partials": "i32",
    "partials_stride": "i32",
    "scale_ptr": "*fp32",
    "result_ptr": "*fp32",
    "max_norm": "fp32",
    "earlier_ptr": "*fp32",
    "norm_stats_ptr": "*fp32",
    "spike_stats_ptr": "*fp64",
}
#: finalize's step constexprs (kernels/finalize.py STEP_OFF) for the steps a scaler launches: none
#: (a plain check), the default policy folding into a fused step, and a rich policy (every norm rule,
#: the z-score window, ZClip) with an earlier flag, as passes/step_decision.py maps them.
FINALIZE_STEPS = {
    "": {**STEP_OFF, "HAS_EARLIER": False},
    "-fold": {**STEP_OFF, "HAS_EARLIER": True, "FOLD": True, "UNFIT_OVERFLOWS": True, "DECIDE": True},
    "-rich": {
        **STEP_OFF,
        "HAS_EARLIER": True,
        "FOLD": True,
        "UNFIT_OVERFLOWS": True,
        "DECIDE": True,
        "NORM_ABOVE": 100.0,
        "NORM_FACTOR": 5.0,
        "NORM_WARMUP": 10,
        "SIGMA": 6.0,
        "WINDOW": 128,
        "MIN_SEEN": 64,
        "BLOCK_W": 128,
        "ZCLIP_Z": 2.5,
        "ZCLIP_WARMUP": 25,
        "ZCLIP_EPS": 1e-6,
    },
    "-rich-percentile": {
        **STEP_OFF,
        "HAS_EARLIER": False,
        "UNSCALE_ON_OVERFLOW": True,
        "DECIDE": True,
        "SKIP_ON_OVERFLOW": False,
        "ZCLIP_Z": 2.5,
        "ZCLIP_WARMUP": 25,
        "ZCLIP_PERCENTILE": True,
    },
}


def _grad_signature(args: tuple[str, ...], dtype: str, num_items: str) -> dict[str, str]:
    sig = {name: "*i64" if name in ("tensors_ptr", "chunks_ptr") else "*fp32" for name in args if name.endswith("_ptr")}
    sig["grad_ptr"] = f"*{dtype}"
    sig.update({name: "i32" for name in args if not name.endswith("_ptr")})
    sig["num_items"] = num_items
    return {name: sig[name] for name in args}  # keep declaration order


def _case(case_id, kernel, target, signature, constexprs, *, padded=True, num_warps=DEFAULT_NUM_WARPS, options=None):
    divisible = [name for name, ty in signature.items() if ty.startswith("*")]
    if padded and "num_items" in signature:
        divisible.append("num_items")
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    return {
        "id": case_id,
        "kernel": kernel,
        "target": TARGETS[target],
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
        "num_warps": num_warps,
        "options": options or {},  # further compile options, as the launcher passes them
    }


def _layout(flat: bool, aligned: bool) -> str:
    return "flat" if flat else ("table-aligned" if aligned else "table")


def check_case(
    target,
    dtype,
    flat,
    norm=2,
    *,
    aligned=False,
    padded=True,
    num_items="i32",
    block=DEFAULT_BLOCK,
    num_warps=DEFAULT_NUM_WARPS,
):
    layout = _layout(flat, aligned)
    suffix = ("" if padded else "-unpadded") + ("-i64" if num_items == "i64" else "")
    if (block, num_warps) != (DEFAULT_BLOCK, DEFAULT_NUM_WARPS):
        suffix += f"-B{block}w{num_warps}"
    return _case(
        f"check-{target}-{dtype}-{layout}-{NORMS[norm]}{suffix}",
        CHECK,
        target,
        _grad_signature(_CHECK_ARGS, dtype, num_items),
        {"NORM": norm, "FLAT": flat, "ALIGNED": aligned, "CHUNK_SIZE": CHUNK, "BLOCK": block},
        padded=padded,
        num_warps=num_warps,
    )


def apply_case(
    target,
    dtype,
    flat,
    *,
    aligned=False,
    check=True,
    invert=False,
    padded=True,
    num_items="i32",
    block=DEFAULT_BLOCK,
    num_warps=DEFAULT_NUM_WARPS,
):
    layout = _layout(flat, aligned)
    mode = ("check" if check else "nocheck") + ("-invert" if invert else "")
    suffix = ("" if padded else "-unpadded") + ("-i64" if num_items == "i64" else "")
    if (block, num_warps) != (DEFAULT_BLOCK, DEFAULT_NUM_WARPS):
        suffix += f"-B{block}w{num_warps}"
    return _case(
        f"apply-{target}-{dtype}-{layout}-{mode}{suffix}",
        APPLY,
        target,
        _grad_signature(_APPLY_ARGS, dtype, num_items),
        {
            "INVERT": invert,
            "CHECK": check,
            "FLAT": flat,
            "ALIGNED": aligned,
            "CHUNK_SIZE": CHUNK,
            "BLOCK": block,
        },
        padded=padded,
        num_warps=num_warps,
    )


def finalize_case(target, norm, has_clip=True, block_p=FINALIZE_BLOCK_P, step=""):
    clip = "clip" if has_clip else "noclip"
    return _case(
        f"finalize-{target}-{NORMS[norm]}-{clip}-P{block_p}{step}",
        FINALIZE,
        target,
        dict(_FINALIZE_SIG),
        {"NORM": norm, "HAS_CLIP": has_clip, "BLOCK_P": block_p, **FINALIZE_STEPS[step]},
        num_warps=FINALIZE_NUM_WARPS,
        options={"enable_fp_fusion": False},  # finalize() launches it so
    )


GATHER_STATS = "tritonscale.kernels.loop_state:gather_stats_kernel"
ADVANCE_LR = "tritonscale.kernels.loop_state:advance_lr_kernel"


def loop_state_cases(target: str) -> list[dict]:
    """The loop's one-program kernels (kernels/loop_state.py): stats() gathered (with and without a
    norm and a found_inf yet) and SkipAwareLR.step for one and three param groups. Their pointers
    are 0-dim views at any offset: nothing is declared 16-byte divisible."""
    values = {"scale": "*fp32", "tracker": "*i32", "norm": "*fp32", "found_inf": "*fp32", "counters": "*i32"}
    gather_sig = {f"{name}_ptr": ty for name, ty in values.items()}
    gather_sig |= {"out_scale": "*fp32", "out_tracker": "*i32", "out_norm": "*fp32", "out_found_inf": "*fp32"}
    gather_sig |= {f"out_{name}": "*i32" for name in ("skipped", "skipped_steps", "consecutive", "hysteresis")}
    slots = {"SKIPPED": 3, "SKIPPED_STEPS": 2, "CONSECUTIVE": 1, "HYSTERESIS": 0}
    lr_sig = {"skipped_ptr": "*i32", "count_ptr": "*i64", "calls_ptr": "*i64", "tables_ptr": "*fp32",
              "lr_addresses": "*i64", "total_steps": "i32"}  # fmt: skip
    cases = []
    for has in (True, False):
        case = _case(f"gather_stats-{target}-{'full' if has else 'empty'}", GATHER_STATS, target, dict(gather_sig),
                     {**slots, "HAS_NORM": has, "HAS_FOUND_INF": has}, num_warps=1)  # fmt: skip
        cases.append({**case, "divisible": []})
    for groups in (1, 3):
        case = _case(f"advance_lr-{target}-G{groups}", ADVANCE_LR, target, dict(lr_sig),
                     {"NUM_GROUPS": groups, "BLOCK_G": 1 if groups == 1 else 4}, num_warps=1)  # fmt: skip
        cases.append({**case, "divisible": []})
    return cases


_POLICY_SIG = {
    "scale_ptr": "*fp32",
    "tracker_ptr": "*i32",
    "counters_ptr": "*i32",
    "norm_stats_ptr": "*fp32",
    "spike_ptr": "*fp64",
    **{f"{flag}{k}_ptr": "*fp32" for flag in ("found", "skip") for k in range(4)},
    "norm_ptr": "*fp32",
    "found_out_ptr": "*fp32",
    "check_out_ptr": "*fp64",
    "hold": "i32",
}
#: A default policy (one optimizer, unclipped) and a rich one (every kind of state, the host checks,
#: two optimizers, a norm): the kernel's smallest and largest specialisations.
POLICY_CASES = {
    "default": (LossScalePolicy(), {"NUM_FOUND": 1, "NUM_SKIPS": 1, "HAS_NORM": False, "CHECKS": False}),
    "rich": (
        LossScalePolicy(
            hysteresis=2,
            skip_norm_factor=5.0,
            skip_norm_sigma=3.0,
            skip_norm_window=128,
            clip_norm_z=2.5,
            min_scale=1.0,
            on_min_scale="raise",
            max_consecutive_skips=5,
            growth_delay=2,
        ),
        {"NUM_FOUND": 2, "NUM_SKIPS": 2, "HAS_NORM": True, "CHECKS": True},
    ),  # fmt: skip
}


def policy_case(target, name):
    from tritonscale.policy.kernel_form import kernel_rule

    policy, launch = POLICY_CASES[name]
    rule = {
        "namedtuple": "tritonscale.kernels.policy_update:UpdateRule",
        "fields": kernel_rule(policy.validate())._asdict(),
    }
    constexprs = {**launch, "COUNT_ONLY": False, "R": rule}
    case = _case(f"policy-{target}-{name}", POLICY, target, dict(_POLICY_SIG), constexprs, num_warps=1)
    case["options"] = {"enable_fp_fusion": False}  # the rule rounds after every operation, as its tensor ops
    return case


def _build_cases() -> list[dict]:
    cases = []
    # FLAT launches always pass ALIGNED=False; TABLE launches pass whether the host found every
    # tensor 16-byte aligned with a multiple of 16 elements.
    layouts = ((True, False), (False, False), (False, True))  # (FLAT, ALIGNED)
    for target in TARGETS:
        for dtype in DTYPES:
            for flat, aligned in layouts:
                cases.append(check_case(target, dtype, flat, aligned=aligned))
                cases.append(apply_case(target, dtype, flat, aligned=aligned))
        for norm in (0, 1):  # L2 is covered above for every dtype/layout
            for flat in (True, False):
                cases.append(check_case(target, "fp32", flat, norm))
        for norm in NORMS:
            cases.append(finalize_case(target, norm))
        cases.append(finalize_case(target, 2, has_clip=False))
        cases += loop_state_cases(target)
        for step in FINALIZE_STEPS:
            if step:
                cases.append(finalize_case(target, 2, step=step))
    # The remaining apply modes (plain unscale_ is CHECK+INVERT; a clip-only step is neither).
    for check, invert in ((True, True), (False, False), (False, True)):
        for flat in (True, False):
            cases.append(apply_case("sm90", "fp16", flat, check=check, invert=invert))
    # Unpadded buffers: num_items without divisibility, the case flatten_grads_ exists to avoid.
    for target in CUDA_TARGETS:
        cases.append(check_case(target, "fp16", True, padded=False))
        cases.append(apply_case(target, "fp16", True, padded=False))
    # Buffers over 2**31 elements get an i64 num_items (and, on ROCm, no tt.pointer_range=32: the
    # launcher only marks tensors of at most 2 GiB, and no case here marks any).
    for target in TARGETS:
        cases.append(check_case(target, "fp16", True, num_items="i64"))
        cases.append(apply_case(target, "fp16", True, num_items="i64"))
    # Every autotune candidate of the FLAT apply pass (compiled on a real GPU at first use); fp32
    # holds the most bytes in registers per element, so it is where spills would show first. The
    # check pass is never autotuned (launch_config.check_config): the default cases above are it.
    for config in streaming_configs()[1:]:
        block, warps = config.kwargs["BLOCK"], config.num_warps
        cases.append(apply_case("sm90", "fp32", True, block=block, num_warps=warps))
    # The largest finalize block (finalize() caps BLOCK_P there).
    cases.append(finalize_case("sm90", 2, block_p=FINALIZE_MAX_BLOCK))
    cases += [policy_case(target, name) for target in TARGETS for name in POLICY_CASES]
    return cases


CASES = _build_cases()

# Deliberately int32-indexed variants of the streaming kernels (the kernel's source with the named
# replacements; bench/aot_compile.py builds them): each is a way a 64-bit guarantee is lost, and
# the 64-bit check must fail on every one. Not kernels anything launches: compiled for the check.
_FLAT_LOOP = "range(pid * BLOCK, num_items, num_programs * BLOCK)"
INT32_MUTATIONS = {
    # STYLE point 5 forgotten: pid * BLOCK multiplied in 32 bits, then widened for the address.
    "pid": [
        ["tl.program_id(0).to(tl.int64)", "tl.program_id(0)"],
        ["tl.num_programs(0).to(tl.int64)", "tl.num_programs(0)"],
    ],
    # The loop bound rounded up in the size's own type: n + BLOCK - 1 wraps for an i32 n near 2**31.
    "size": [[_FLAT_LOOP, "range(pid * BLOCK, tl.cdiv(num_items, BLOCK) * BLOCK, num_programs * BLOCK)"]],
    # A 32-bit counter stepped up to a 32-bit size: no operand is large, the counter wraps.
    "counter": [[_FLAT_LOOP, "range(0, num_items, BLOCK)"]],
}


def _mutant(case: dict, mutation: str) -> dict:
    return {**case, "id": f"{case['id']}-int32{mutation}", "mutate": INT32_MUTATIONS[mutation]}


MUTANT_CASES = [
    _mutant(make(target, "fp16", flat, num_items=size), mutation)
    for target in ("sm90", "gfx942")
    for make, flat, size, mutation in (
        (check_case, True, "i64", "pid"),
        (apply_case, True, "i64", "pid"),
        (check_case, False, "i32", "pid"),  # the chunk-row counter of the TABLE path
        (check_case, True, "i32", "size"),
        (apply_case, True, "i32", "counter"),
    )
]
MUTANT_IDS = [c["id"] for c in MUTANT_CASES]
CASE_IDS = [c["id"] for c in CASES]
assert len(set(CASE_IDS + MUTANT_IDS)) == len(CASE_IDS) + len(MUTANT_IDS), "duplicate case ids"
CUDA_IDS = [c["id"] for c in CASES if c["target"][0] == "cuda"]
AMD_IDS = [c["id"] for c in CASES if c["target"][0] == "hip"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    """Compile every case once, in a subprocess without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the interpreter tests use too
    # A fresh cache: every run really compiles, and nothing is written to ~/.triton.
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    # The kernels this process tests, not whichever copy an install would map the name to.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(HELPER)],
        input=json.dumps(CASES + MUTANT_CASES),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path_factory.getbasetemp(),
        timeout=300,
    )
    assert proc.returncode == 0, f"compile helper failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def _result(compiled, case_id):
    result = compiled[case_id]
    assert result["ok"], f"{case_id} did not compile:\n{result['error']}"
    return result


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_compiles(compiled, case_id):
    result = _result(compiled, case_id)
    expected = "ptx" if case_id in CUDA_IDS else "amdgcn"
    assert expected in result["asm_kinds"]
    if expected == "amdgcn":
        assert result["hsaco_bytes"] > 0, "no code object produced"


# --- 16-byte vector memory access on the FLAT path --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_flat_check_loads_are_16_byte_vectors(compiled, target, dtype):
    result = _result(compiled, check_case(target, dtype, True)["id"])
    # The check kernel's only global loads are gradient loads: all of them must be v4.
    assert result["loads"] and all(op.startswith("ld.global.v4.") for op in result["loads"]), result["loads"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_flat_apply_loads_and_stores_are_16_byte_vectors(compiled, target, dtype):
    result = _result(compiled, apply_case(target, dtype, True)["id"])
    # Besides the gradient there are the scalar fp32 factor load and found_inf store (b32):
    # anything else (b16, v2) would be a gradient access that lost its vectorisation.
    assert "ld.global.v4.b32" in result["loads"], result["loads"]
    assert "st.global.v4.b32" in result["stores"], result["stores"]
    assert set(result["loads"]) <= {"ld.global.v4.b32", "ld.global.b32"}, result["loads"]
    assert set(result["stores"]) <= {"st.global.v4.b32", "st.global.b32"}, result["stores"]


PADDED_FLAT_CUDA_IDS = [
    c["id"] for c in CASES if c["constexprs"].get("FLAT") and c["target"][0] == "cuda" and "num_items" in c["divisible"]
]


@pytest.mark.parametrize("case_id", PADDED_FLAT_CUDA_IDS)
def test_all_flat_variants_vectorise(compiled, case_id):
    """Every padded FLAT variant (modes, i64 size, autotune configs) keeps v4 loads."""
    result = _result(compiled, case_id)
    assert any(op.startswith("ld.global.v4.") for op in result["loads"]), result["loads"]


@pytest.mark.parametrize("kernel", ["check", "apply"])
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_unpadded_flat_fp16_is_not_vectorised(compiled, target, kernel):
    """Without num_items % 16 == 0 the masked loads cannot be v4: why flat buffers are padded."""
    make_case = check_case if kernel == "check" else apply_case
    result = _result(compiled, make_case(target, "fp16", True, padded=False)["id"])
    accesses = result["loads"] + result["stores"]
    assert "ld.global.b16" in result["loads"], accesses  # element-wise gradient loads instead
    assert not any(".v4." in op or ".v2." in op for op in accesses), accesses


@pytest.mark.parametrize("dtype", DTYPES)
def test_gfx942_flat_loads_are_dwordx4(compiled, dtype):
    check = _result(compiled, check_case("gfx942", dtype, True)["id"])
    loads = check["loads"]
    assert loads and all(op.endswith("_load_dwordx4") for op in loads), loads
    apply = _result(compiled, apply_case("gfx942", dtype, True)["id"])
    assert any(op.endswith("_load_dwordx4") for op in apply["loads"]), apply["loads"]
    assert any(op.endswith("_store_dwordx4") for op in apply["stores"]), apply["stores"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["check", "apply"])
def test_aligned_table_accesses_are_16_byte_vectors(compiled, kernel, target, dtype):
    """ALIGNED=True asserts alignment through the loaded table addresses (tl.multiple_of)."""
    make_case = check_case if kernel == "check" else apply_case
    result = _result(compiled, make_case(target, dtype, False, aligned=True)["id"])
    # On gfx942 the gradient accesses of the TABLE path are buffer_* ops (the apply kernel's
    # global_load_dwordx4 reads the int64 tables), so the buffer form is the one to look for.
    vector_load, vector_store = (
        ("ld.global.v4.b32", "st.global.v4.b32")
        if target in CUDA_TARGETS
        else ("buffer_load_dwordx4", "buffer_store_dwordx4")
    )
    assert vector_load in result["loads"], result["loads"]
    if kernel == "apply":
        assert vector_store in result["stores"], result["stores"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["check", "apply"])
def test_unaligned_table_accesses_are_scalar(compiled, kernel, target, dtype):
    """Without ALIGNED nothing is known about a table address: one element per access."""
    make_case = check_case if kernel == "check" else apply_case
    result = _result(compiled, make_case(target, dtype, False)["id"])
    accesses = result["loads"] + result["stores"]
    if target in CUDA_TARGETS:
        assert not any(".v4." in op or ".v2." in op for op in accesses), accesses
    else:
        assert not any(op.startswith("buffer_") and "dwordx" in op for op in accesses), accesses


# --- the policy kernel ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICY_CASES))
@pytest.mark.parametrize("target", TARGETS)
def test_policy_kernel_compiles_with_its_float64_arithmetic(compiled, target, name):
    result = _result(compiled, policy_case(target, name)["id"])
    # The rich policy's spike rules keep float64 averages. (A float32 scale times a float64 factor
    # rounded once is the float32 product where the factor is a float32 number: LLVM narrows it.)
    assert (result["float64_ops"] > 0) == (name == "rich"), result["float64_ops"]
    if target in CUDA_TARGETS:  # contraction off: every product rounded, as the tensor ops round it
        assert result["fused_multiply_adds"] == 0


# --- no spills --------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", CUDA_IDS)
def test_cuda_ptx_declares_no_local_memory(compiled, case_id):
    # Triton's PTX declares .local only for explicit local arrays; register spills are decided
    # later by ptxas, so the cubin check below is the one that catches them.
    assert not _result(compiled, case_id)["ptx_local"], "PTX declares .local memory"


@pytest.mark.parametrize("case_id", CUDA_IDS)
def test_cuda_cubin_has_no_spills(compiled, case_id):
    usage = _result(compiled, case_id)["resources"]
    if usage is None:
        pytest.skip("cuobjdump not available: cubin resource usage not checked")
    # ptxas spills registers to the stack frame with STL/LDL; none of the kernels needs any.
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, f"ptxas spilled: {usage}"
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"local memory in use: {usage}"


@pytest.mark.parametrize("case_id", AMD_IDS)
def test_gfx942_no_vgpr_spills(compiled, case_id):
    usage = _result(compiled, case_id)["resources"]
    # SGPR spills go to VGPR lanes (no memory traffic) and are common; VGPR spills and any
    # scratch (private segment) would be real spills to memory.
    assert usage.get("vgpr_spill_count") == 0, usage
    assert usage.get("private_segment_fixed_size") == 0, usage


# --- 64-bit indexing --------------------------------------------------------------------------
# bench/index_width.py follows every value derived from a program id, a program count, an integer
# argument or a loaded 64-bit integer through the PTX (CUDA) and the LLVM IR (both targets; on
# gfx942 the IR the AMDGPU backend lowers to AMDGCN) and reports each narrow add/sub/mul/mad/shl
# or truncation it reaches, and each narrow counter compared with such a value. None may remain
# where an offset can pass 2**31: docs/architecture.md, "64-bit indexing".

STREAMING_IDS = [c["id"] for c in CASES if c["kernel"] in (CHECK, APPLY)]


def _index_width():
    import importlib.util

    spec = importlib.util.spec_from_file_location("index_width", HELPER.parent / "index_width.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PTX_HEAD = ".param .u32 k_param_3\n{\nmov.u32 %r1, %ctaid.x;\nld.param.b32 %r9, [k_param_3];\n"
#: The same address, pid * 4096 elements of 2 bytes from %rd1, two ways: only the first is 64-bit.
#: Both end in a wide multiply or shift into the address; what comes before it decides.
PTX_WIDE = _PTX_HEAD + "mul.wide.u32 %rd2, %r1, 8192;\nadd.s64 %rd3, %rd1, %rd2;\n}"
PTX_NARROW = _PTX_HEAD + "shl.b32 %r2, %r1, 12;\nmul.wide.s32 %rd2, %r2, 2;\nadd.s64 %rd3, %rd1, %rd2;\n}"
PTX_SIZE = _PTX_HEAD + "add.s32 %r3, %r9, 4095;\nshr.s32 %r4, %r3, 12;\n}"  # cdiv(n, 4096) in 32 bits
PTX_COUNTER = _PTX_HEAD + "$L__BB0_1:\nadd.s32 %r5, %r5, 4096;\nsetp.lt.s32 %p1, %r5, %r9;\n@%p1 bra $L__BB0_1;\n}"
_LL_HEAD = "define void @k(ptr %0, i32 %1) {\n  %3 = tail call i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()\n"
LL_WIDE = _LL_HEAD + "  %4 = sext i32 %3 to i64\n  %5 = shl i64 %4, 12\n}"
LL_NARROW = _LL_HEAD + "  %4 = shl i32 %3, 12\n  %5 = sext i32 %4 to i64\n}"
LL_TRUNC = _LL_HEAD + "  %4 = sext i32 %1 to i64\n  %5 = shl i64 %4, 1\n  %6 = trunc i64 %5 to i32\n}"


def test_index_width_check_on_known_patterns():
    """The check's rules on hand-written code (no compile): the 64-bit form passes; a 32-bit
    pid * BLOCK, a bound rounded up in an i32 size, a 32-bit counter stepped to an i32 size and a
    truncated 64-bit offset are each reported."""
    iw = _index_width()
    assert iw.ptx_narrow_index_ops(PTX_WIDE) == []
    assert iw.ptx_narrow_index_ops(PTX_NARROW) == ["shl.b32 %r2, %r1, 12"]
    assert iw.ptx_narrow_index_ops(PTX_SIZE) == ["add.s32 %r3, %r9, 4095"]
    assert iw.ptx_narrow_index_ops(PTX_COUNTER) == ["add.s32 %r5, %r5, 4096"]
    assert iw.llir_narrow_index_ops(LL_WIDE) == []
    assert iw.llir_narrow_index_ops(LL_NARROW) == ["%4 = shl i32 %3, 12"]
    assert iw.llir_narrow_index_ops(LL_TRUNC) == ["%6 = trunc i64 %5 to i32"]


@pytest.mark.parametrize("case_id", STREAMING_IDS)
def test_streaming_offsets_are_computed_in_64_bits(compiled, case_id):
    narrow = _result(compiled, case_id)["narrow_index"]
    assert set(narrow) == ({"ptx", "llir"} if case_id in CUDA_IDS else {"llir"})
    assert narrow == {form: [] for form in narrow}, f"32-bit arithmetic on a large offset: {narrow}"


@pytest.mark.parametrize("case_id", MUTANT_IDS)
def test_64_bit_check_fails_on_int32_variants(compiled, case_id):
    """The check itself: each deliberately int32-indexed variant is reported, in every form."""
    narrow = _result(compiled, case_id)["narrow_index"]
    assert narrow["llir"], "the LLVM IR check missed an int32-indexed kernel"
    if "ptx" in narrow:
        assert narrow["ptx"], "the PTX check missed an int32-indexed kernel"


@pytest.mark.parametrize("kernel", ["check", "apply"])
@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_64_bit_sizes_cost_the_inner_loop_nothing(compiled, target, kernel):
    """A size past 2**31 (an i64 num_items) compiles to the same inner loop as an i32 one, and the
    loop's 64-bit integer work is the address math alone: a counter, a pointer and the bound
    checks of its two 16-byte accesses per thread."""
    make_case = check_case if kernel == "check" else apply_case
    small = _result(compiled, make_case(target, "fp16", True)["id"])["inner_loop"]
    large = _result(compiled, make_case(target, "fp16", True, num_items="i64")["id"])["inner_loop"]
    assert small == large, (small, large)
    assert large["int64_ops"] <= 8, large
