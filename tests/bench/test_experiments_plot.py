"""experiments.png read back from its artists: the gradient-norm lines break at every skipped step,
a non-finite norm is marked on the panel's top edge and the gaps explained in its title exactly when
the data have one, and the skipped-steps count has integer ticks only."""

from __future__ import annotations

import json
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


def overflow_result() -> dict:
    return {"experiment": "overflow", "runs": {"torch": run(), "tritonscale": run()}, "max_loss_diff": 0.0}


def test_the_norm_lines_break_at_every_skipped_step():
    fig = experiments_plot.figure([overflow_result()])
    norm_panel = fig.axes[3]
    assert "gradient norm" in norm_panel.get_title()
    lines = {line.get_label(): line for line in norm_panel.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"torch", "tritonscale"}
    for line in lines.values():
        assert list(line.get_xdata()) == list(range(len(NORMS)))
        drawn = [float(y) for y in line.get_ydata()]
        assert [i for i, y in enumerate(drawn) if math.isnan(y)] == list(SKIPPED)  # a gap at each skip
        applied = [n for i, n in enumerate(NORMS) if i not in SKIPPED]
        assert [y for i, y in enumerate(drawn) if i not in SKIPPED] == applied
    experiments_plot.figures.pyplot().close(fig)


def finite_result() -> dict:
    """An experiment with no skipped step: every norm finite."""
    steps = len(NORMS)
    finite = {"loss": [2.0] * steps, "scale": [1.0] * steps, "grad_norm": [1.0] * steps, "skipped": [False] * steps}
    return {"experiment": "lm-bf16", "runs": {"torch": finite, "tritonscale": dict(finite)}, "max_loss_diff": 0.0}


def test_the_norm_gaps_are_marked_and_explained_exactly_where_a_norm_is_not_finite():
    fig = experiments_plot.figure([overflow_result(), finite_result()])
    overflow_norms, finite_norms = fig.axes[3], fig.axes[3 + len(experiments_plot.COLUMNS)]
    assert "non-finite norm" in overflow_norms.get_title()
    assert "non-finite norm" not in finite_norms.get_title() and "gaps" not in finite_norms.get_title()
    non_finite = [i for i, n in enumerate(NORMS) if not math.isfinite(n)]
    marks = {line.get_label(): line for line in overflow_norms.get_lines() if "non-finite" in line.get_label()}
    assert set(marks) == {"_torch: non-finite norm", "_tritonscale: non-finite norm"}
    for line in marks.values():
        assert list(line.get_xdata()) == non_finite and list(line.get_ydata()) == [1.0] * len(non_finite)
        assert line.get_transform() == overflow_norms.get_xaxis_transform()  # y: the top edge, whatever the data
    assert marks["_torch: non-finite norm"].get_markersize() > marks["_tritonscale: non-finite norm"].get_markersize()
    assert not [line for line in finite_norms.get_lines() if "non-finite" in line.get_label()]
    experiments_plot.figures.pyplot().close(fig)


def test_the_skipped_steps_count_has_integer_ticks_only():
    fig = experiments_plot.figure([overflow_result(), finite_result()])
    fig.canvas.draw()
    counts = [ax for ax in fig.axes if "skipped steps so far" in ax.get_title()]
    assert len(counts) == 2
    for ax in counts:
        low, high = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if low <= t <= high]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    experiments_plot.figures.pyplot().close(fig)


def test_redraw_draws_the_png_beside_its_json_from_that_file_alone(tmp_path):
    machine = {"device": "cpu", "processor": "test CPU", "threads": 2, "torch": "2.x", "triton": "3.x"}
    path = tmp_path / "experiments.json"
    path.write_text(json.dumps({"machine": machine, "results": [overflow_result(), finite_result()]}))
    assert experiments_plot.main([str(path)]) == 0
    assert (tmp_path / "experiments.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
