"""sweep.png read back from its artists: speed-ups on a log axis, one panel per layout, the two
series told apart, each bar spanning the measured p20..p80, invalid points not drawn."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
sweep = pytest.importorskip("sweep")
sweep_plot = pytest.importorskip("sweep_plot")
pytest.importorskip("matplotlib")

SIZES = (4096, 16384, 65536)


def timing(ms: float) -> dict:
    return {"median_ms": ms, "q20_ms": 0.9 * ms, "q80_ms": 1.2 * ms, "bytes": 1, "fraction_of_copy_bandwidth": 0.5}


def point(dtype: str, layout: str, numel: int, k: int) -> dict:
    """Speed-ups spanning decades (0.3x..30x), distinct per layout and size."""
    p = {"numel": numel, "dtype": dtype, "layout": layout, "invalid": []}
    p |= {v: timing(1.0 + k) for v in ("fold", "copy")}
    if dtype != "float16":
        p |= {v: timing(2.0 + k) for v in ("torch", "tritonscale", "torch-fused")}
        for key, ratio in (("ratio_tritonscale", 0.3 * 3**k), ("ratio_fold", 30.0 / 2**k)):
            p[key], p[f"{key}_spread"] = ratio, {"q20": ratio / 1.5, "q80": ratio * 1.1}
    return p


def synthetic_points() -> list[dict]:
    plan = [(d, lay, n) for d in ("float32", "float16") for lay in ("flat", "200") for n in SIZES]
    points = [point(d, lay, n, k) for k, (d, lay, n) in enumerate(plan)]
    points[1]["invalid"] = ["fold skipped a timed step"]  # float32, flat, 16384
    return points


def test_speedup_panels_are_log_one_per_layout_with_the_measured_bars():
    points = synthetic_points()
    fig = sweep_plot.figure(points, sweep.VARIANTS, sweep.LAYOUT_NAMES)
    speedups = [ax for ax in fig.axes if ": speed-up" in ax.get_title()]
    assert [ax.get_title().split(":")[0] for ax in speedups] == ["float32, " + sweep.LAYOUT_NAMES[lay]
                                                                 for lay in ("flat", "200")]  # fmt: skip
    for ax in speedups:
        assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
        layout = "flat" if "flat" in ax.get_title() else "200"
        drawn = [p for p in points if p["dtype"] == "float32" and p["layout"] == layout and not p["invalid"]]
        series = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert set(series) == {"torch / tritonscale", "torch-fused / fold"}
        assert {line.get_marker() for line in series.values()} == {"o", "s"}  # told apart by marker and colour
        assert len({line.get_color() for line in series.values()}) == 2
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(series)
        bars = [c for c in ax.collections if type(c).__name__ == "LineCollection"]
        for (key, label, *_), collection in zip(sweep_plot.RATIOS, bars):
            assert list(series[label].get_ydata()) == [p[key] for p in drawn]  # the ratio, at every valid point
            spans = [(seg[0][1], seg[1][1]) for seg in collection.get_segments()]
            assert spans == [(p[f"{key}_spread"]["q20"], p[f"{key}_spread"]["q80"]) for p in drawn]
        low, high = ax.get_ylim()
        assert low <= min(p[k]["q20"] for p in drawn for k in ("ratio_tritonscale_spread", "ratio_fold_spread"))
        assert high >= max(p[k]["q80"] for p in drawn for k in ("ratio_tritonscale_spread", "ratio_fold_spread"))
    titles = [ax.get_title() for ax in fig.axes]
    flat_time = next(t for t in titles if t.startswith("float32, one flat") and ": time" in t)
    assert "1 invalid point not drawn" in flat_time
    sweep_plot.figures.pyplot().close(fig)
