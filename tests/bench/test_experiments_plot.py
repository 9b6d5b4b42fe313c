"""experiments.png read back from its artists: the gradient-norm lines break at every skipped step."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
experiments_plot = pytest.importorskip("experiments_plot")
pytest.importorskip("matplotlib")

SKIPPED = (2, 5, 6)  # an overflow at step 2 and two in a row; the others applied
NORMS = [3.0, 2.5, math.inf, 2.0, 1.5, math.inf, math.nan, 1.2, 1.1, 1.0]


def run() -> dict:
    steps = len(NORMS)
    return {"loss": [2.0 - 0.1 * i for i in range(steps)], "scale": [2.0**16] * steps, "grad_norm": list(NORMS),
            "skipped": [i in SKIPPED for i in range(steps)]}  # fmt: skip


def test_the_norm_lines_break_at_every_skipped_step():
    result = {"experiment": "overflow", "runs": {"torch": run(), "tritonscale": run()}, "max_loss_diff": 0.0}
    fig = experiments_plot.figure([result])
    norm_panel = fig.axes[3]
    assert "gradient norm" in norm_panel.get_title()
    lines = {line.get_label(): line for line in norm_panel.get_lines()}
    assert set(lines) == {"torch", "tritonscale"}
    for line in lines.values():
        assert list(line.get_xdata()) == list(range(len(NORMS)))
        drawn = [float(y) for y in line.get_ydata()]
        assert [i for i, y in enumerate(drawn) if math.isnan(y)] == list(SKIPPED)  # a gap at each skip
        applied = [n for i, n in enumerate(NORMS) if i not in SKIPPED]
        assert [y for i, y in enumerate(drawn) if i not in SKIPPED] == applied
    experiments_plot.figures.pyplot().close(fig)
