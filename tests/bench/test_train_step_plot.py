"""train_step.png read back from its artists: each bar drawn to its measured value, the step's p20-p80
error bar centred on the step's median (not on the top of the stacked phases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from matplotlib.transforms import Bbox

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
train_step = pytest.importorskip("train_step")
pytest.importorskip("matplotlib")

# The issue's run: the no-scaling step measured 118.8..736.0 ms; the phases' medians add up to far
# less than the step's median (medians do not add), which is where the old error bar was hung.
STEPS = {"no-scaling": (300.0, 118.8, 736.0), "torch-fused": (41.0, 40.0, 44.5), "tritonscale-fold": (39.5, 37.0, 52.0)}


def synthetic_results(steps: dict = STEPS) -> dict:
    results = {}
    for k, (name, (median, q20, q80)) in enumerate(steps.items()):
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


# The issue's GPU run: medians near 40 ms, the whiskers of torch-fused up to 123 ms and of the fold
# up to 111 ms (the axis stops at 2.5x the tallest bar: one runs off the top, one nearly reaches it),
# and a title of the GPU's model and versions on a figure of three variants.
ISSUE_STEPS = {"no-scaling": (40.2, 38.0, 47.0), "torch-fused": (44.0, 41.0, 123.0),
               "tritonscale-fold": (42.5, 40.0, 111.0)}  # fmt: skip
ISSUE_TITLE = ("one training step, 101.82M parameters in 102 tensors (8 blocks, d_model 1024), 16x512 tokens, float32, "
               "autocast float16, clip 1.0\nNVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0")  # fmt: skip


def data_extents(ax, renderer) -> list:
    """Where the axes' data is drawn (pixels, cut to the axes, padded by a pixel: a whisker is a line
    of no width): each bar, each whisker segment, each cap and median marker."""
    boxes = [p.get_window_extent(renderer) for p in ax.patches]
    for collection in ax.collections:  # the whiskers, one segment each
        boxes += [Bbox(ax.transData.transform(segment)) for segment in collection.get_segments()]
    for line in ax.lines:  # the caps and the medians' markers, one box per marker
        half = line.get_markersize() * ax.figure.dpi / 72 / 2
        boxes += [Bbox([xy - half, xy + half]) for xy in ax.transData.transform(line.get_xydata())]
    cut = [Bbox.intersection(box, ax.bbox) for box in boxes]
    return [box.padded(1.0) for box in cut if box is not None]


def text_extents(fig, renderer) -> dict:
    """Every visible text of the figure (labels, ticks, title, legend) with its box where it has one."""
    found = {}
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text().strip():
            extent = text.get_window_extent(renderer)
            if text.get_bbox_patch() is not None:
                extent = Bbox.union([extent, text.get_bbox_patch().get_window_extent(renderer)])
            found[text] = extent
    return found


def test_labels_hide_no_data_and_the_title_fits_the_figure(tmp_path):
    fig = train_step.figure(synthetic_results(ISSUE_STEPS))
    train_step.figures.save(fig, tmp_path / "train_step.png", ISSUE_TITLE)  # as the PNG is drawn: title, layout
    renderer = FigureCanvasAgg(fig).get_renderer()  # save closed it: a canvas to measure the drawn figure on
    fig.canvas.draw()
    (ax,) = fig.axes
    data = data_extents(ax, renderer)
    assert len(ax.lines) == 3 and all(line.get_linestyle() == "None" for line in ax.lines)  # markers only
    (errors,) = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(errors.lines[2][0].get_segments()) == len(ISSUE_STEPS)  # every whisker is in ``data``
    texts = text_extents(fig, renderer)
    for text, extent in texts.items():
        hidden = [d for d in data if extent.overlaps(d)]
        assert not hidden, f"{text.get_text()!r} at {extent} covers data at {hidden}"
    ticks = [texts[t] for t in ax.get_xticklabels() if t in texts]
    assert len(ticks) == len(ISSUE_STEPS)
    assert not any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1 :])  # the labels stay readable
    labels = " ".join(t.get_text() for t in ax.get_xticklabels())
    assert "[41, 123]" in labels and "[40, 111]" in labels  # the whiskers' ends in numbers too
    title = texts[fig._suptitle]
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1, (title, fig.bbox)
    train_step.figures.pyplot().close(fig)
