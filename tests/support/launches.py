"""The launch counter the tests use: it lives in ``bench/launch_count.py`` (one home, which the
docs' table, ``bench/launch_table.py``, and the host-time bar import too)."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if _BENCH not in sys.path:
    sys.path.append(_BENCH)

from launch_count import CLIPS, LaunchCounter, count_scaled_step, launches_nothing, no_op_launches, total  # noqa: E402

__all__ = ["CLIPS", "LaunchCounter", "count_scaled_step", "launches_nothing", "no_op_launches", "total"]
