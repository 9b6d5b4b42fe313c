"""No function of the package is over 60 lines: one that is does several things (docs/controller.md).

Counted from the ``def`` line to the last line of the body, docstring included, for every
function and method under ``tritonscale/`` (the kernels, ``tritonscale/kernels/``, included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tritonscale

MAX_LINES = 60
PACKAGE = Path(tritonscale.__file__).parent


def long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_60_lines():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 40, "the package's modules were not found"
    assert PACKAGE / "kernels" / "check_pass.py" in paths, "the kernels were not found"
    assert [f for path in paths for f in long_functions(path)] == []


def test_the_count_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"def long():\n{body}\n")
    assert long_functions(path) == [f"long.py:1 long ({MAX_LINES + 1} lines)"]
