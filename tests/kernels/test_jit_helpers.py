"""kernels/jit_helpers.py is a leaf, and its interpreter switch matches how the kernels were built."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

# By module path: the package re-exports functions named like their modules (check_pass, finalize).
apply_pass, check_pass, finalize, jit_helpers, launch_config = (
    importlib.import_module(f"tritonscale.kernels.{name}")
    for name in ("apply_pass", "check_pass", "finalize", "jit_helpers", "launch_config")
)

KERNELS = Path(jit_helpers.__file__).parent


def test_interpreter_switch_matches_every_kernel():
    for kernel in (apply_pass.apply_kernel, check_pass.check_pass_kernel, finalize.finalize_kernel):
        built_for_interpreter = type(kernel).__module__ == "triton.runtime.interpreter"
        assert built_for_interpreter is jit_helpers.INTERPRETING
    assert jit_helpers.INTERPRETING  # conftest.py sets TRITON_INTERPRET=1 before triton is imported
    assert launch_config.autotune_enabled() is False


def _package_imports(module: str) -> set[str]:
    tree = ast.parse((KERNELS / f"{module}.py").read_text())
    return {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}


def test_jit_helpers_and_supported_are_leaves_and_nothing_imports_in_a_cycle():
    assert _package_imports("jit_helpers") == set()
    assert _package_imports("supported") == set()
    # launch_config sits below the kernels: it must not reach back into a pass.
    assert _package_imports("launch_config") <= {"jit_helpers"}
    assert "tensor_table" not in _package_imports("launch_config")
