"""train_step.png read back from its artists: each bar drawn to its measured value, the step's p20-p80
error bar centred on the step's median (not on the top of the stacked phases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
train_step = pytest.importorskip("train_step")
pytest.importorskip("matplotlib")

# The issue's run: the no-scaling step measured 118.8..736.0 ms; the phases' medians add up to far
# less than the step's median (medians do not add), which is where the old error bar was hung.
STEPS = {"no-scaling": (300.0, 118.8, 736.0), "torch-fused": (41.0, 40.0, 44.5), "tritonscale-fold": (39.5, 37.0, 52.0)}


def synthetic_results() -> dict:
    results = {}
    for k, (name, (median, q20, q80)) in enumerate(STEPS.items()):
        phases = {ph: {"median_ms": 1.0 + i + k, "q20_ms": 0.5 + i, "q80_ms": 2.0 + i + k}
                  for i, ph in enumerate(train_step.PHASES)}  # fmt: skip
        step = {"median_ms": median, "q20_ms": q20, "q80_ms": q80}
        results[name] = {"phases": phases, "step": step, "scaler_share": phases["scaler"]["median_ms"] / median}
    return results


def test_bars_and_error_bars_show_the_measured_values():
    results = synthetic_results()
    fig = train_step.figure(results)
    (ax,) = fig.axes
    bars = {c.get_label(): c for c in ax.containers if type(c).__name__ == "BarContainer"}
    (errors,) = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    medians = [r["step"]["median_ms"] for r in results.values()]

    step_bars = bars.pop("whole step (median)")
    assert [b.get_y() for b in step_bars] == [0.0] * len(results)
    assert [b.get_height() for b in step_bars] == medians  # each step bar drawn to its median

    centre, _, (whiskers,) = errors.lines
    assert list(centre.get_ydata()) == medians  # the error bar is centred on the plotted median
    assert list(centre.get_xdata()) == [b.get_x() + b.get_width() / 2 for b in step_bars]
    extents = [y for seg in whiskers.get_segments() for y in (seg[0][1], seg[1][1])]
    measured = [q for r in results.values() for q in (r["step"]["q20_ms"], r["step"]["q80_ms"])]
    assert extents == pytest.approx(measured, rel=1e-12)  # the whiskers span the measured p20..p80 (yerr's rounding)

    bottoms = [0.0] * len(results)
    for phase in train_step.PHASES:  # the stacked phases: each segment its phase's median, in order
        segments = bars.pop(f"{phase} (median)")
        assert [b.get_y() for b in segments] == pytest.approx(bottoms)
        heights = [r["phases"][phase]["median_ms"] for r in results.values()]
        assert [b.get_height() for b in segments] == heights
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    assert bars == {}
    train_step.figures.pyplot().close(fig)
