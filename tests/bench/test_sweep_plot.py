"""sweep.png read back from its artists: speed-ups on a log axis, one panel per layout, the two
series told apart, each bar spanning the measured p20..p80, invalid points not drawn; in the time
panels every variant with its own marker, line style and z-order, no variant's marker on another's
(even where their times are equal), p20-p80 as bars, not overlapping bands; the speed-up's axis
naming its statistic and the rounds it is the median of, with the ratio of the medians beside it."""

from __future__ import annotations

import itertools
import json
import statistics
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


ROUNDS = (15, 30, 61)  # per size, as rounds_for gives small points more


def point(dtype: str, layout: str, numel: int, k: int) -> dict:
    """Speed-ups spanning decades (0.3x..30x), distinct per layout and size."""
    p = {"numel": numel, "dtype": dtype, "layout": layout, "invalid": []}
    p |= {v: timing(1.0 + k) for v in ("fold", "copy")}
    if dtype != "float16":
        p |= {v: timing(2.0 + k) for v in ("torch", "tritonscale", "torch-fused")}
        for key, ratio in (("ratio_tritonscale", 0.3 * 3**k), ("ratio_fold", 30.0 / 2**k)):
            rounds = ROUNDS[SIZES.index(numel)]
            p[key], p[f"{key}_spread"] = ratio, {"q20": ratio / 1.5, "q80": ratio * 1.1, "rounds": rounds}
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
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == [*series, "hollow: ratio of the medians"]
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


def time_panels(fig) -> list:
    return [ax for ax in fig.axes if ": time per step" in ax.get_title()]


def variant_lines(ax) -> dict:
    """The time panel's median line of each variant, by its label."""
    return {line.get_label(): line for line in ax.get_lines() if line.get_label() in sweep.VARIANTS}


def test_every_variant_has_its_own_marker_line_style_and_zorder():
    fig = sweep_plot.figure(synthetic_points(), sweep.VARIANTS, sweep.LAYOUT_NAMES)
    for ax in time_panels(fig):
        lines = variant_lines(ax)
        assert lines, ax.get_title()
        looks = {
            "marker": [line.get_marker() for line in lines.values()],
            # get_linestyle() names any dash tuple "--": the dash pattern itself tells them apart
            "dashes": [(line.get_linestyle(), line._unscaled_dash_pattern) for line in lines.values()],
            "zorder": [line.get_zorder() for line in lines.values()],
            "color": [line.get_color() for line in lines.values()],
        }
        for what, values in looks.items():
            assert len(set(values)) == len(values), (ax.get_title(), what, values)
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == list(sweep.VARIANTS)
    assert len({h.get_marker() for h in legend.legend_handles}) == len(sweep.VARIANTS)
    sweep_plot.figures.pyplot().close(fig)


def test_no_variant_hides_another_where_their_times_are_equal():
    """Every variant at the same median (the issue's float32 2000x4K: one dot drawn over another):
    at each size the variants' markers sit at distinct display positions, a marker's width apart."""
    points = [p | {v: timing(4.0) for v in sweep.VARIANTS if v in p} for p in synthetic_points()]
    fig = sweep_plot.figure(points, sweep.VARIANTS, sweep.LAYOUT_NAMES)
    for ax in time_panels(fig):
        centres = {name: ax.transData.transform(line.get_xydata()) for name, line in variant_lines(ax).items()}
        assert len(centres) >= 2
        for (a, xy_a), (b, xy_b) in itertools.combinations(centres.items(), 2):
            for (xa, ya), (xb, yb) in zip(xy_a, xy_b):  # the same size: the same row of the data
                assert ya == pytest.approx(yb) and abs(xa - xb) >= 4.0, (ax.get_title(), a, b, xa, xb)
    sweep_plot.figures.pyplot().close(fig)


def panel_points(points: list[dict], ax) -> list[dict]:
    """The valid points of the dtype and layout that ``ax``'s title names, by size: those it draws."""
    name = ax.get_title().split(":")[0]
    drawn = [p for p in points if f"{p['dtype']}, {sweep.LAYOUT_NAMES[p['layout']]}" == name and not p["invalid"]]
    return sorted(drawn, key=lambda p: p["numel"])


def test_time_spreads_are_bars_at_each_marker_not_bands():
    points = synthetic_points()
    fig = sweep_plot.figure(points, sweep.VARIANTS, sweep.LAYOUT_NAMES)
    for ax in time_panels(fig):
        assert not [c for c in ax.collections if type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection")]
        bars = [c for c in ax.collections if type(c).__name__ == "LineCollection"]
        drawn = panel_points(points, ax)
        lines = variant_lines(ax)
        assert len(bars) == len(lines)
        for (name, line), collection in zip(lines.items(), bars):
            segments = collection.get_segments()
            assert [seg[0][0] for seg in segments] == list(line.get_xdata())  # a bar at each marker
            assert [(seg[0][1], seg[1][1]) for seg in segments] == [(p[name]["q20_ms"], p[name]["q80_ms"])
                                                                    for p in drawn]  # fmt: skip
    sweep_plot.figures.pyplot().close(fig)


def speedup_panels(fig) -> list:
    return [ax for ax in fig.axes if ": speed-up" in ax.get_title()]


def test_the_speed_up_axis_names_its_statistic_and_the_rounds_read_from_the_data():
    fig = sweep_plot.figure(synthetic_points(), sweep.VARIANTS, sweep.LAYOUT_NAMES)
    labels = [" ".join(ax.get_ylabel().split()) for ax in speedup_panels(fig)]
    assert labels == [f"median over {min(ROUNDS)}-{max(ROUNDS)} rounds of per-round torch/ours ratios"] * 2
    sweep_plot.figures.pyplot().close(fig)
    one_size = [p for p in synthetic_points() if p["numel"] == SIZES[0]]
    fig = sweep_plot.figure(one_size, sweep.VARIANTS, sweep.LAYOUT_NAMES)
    assert all(f"median over {ROUNDS[0]} rounds" in " ".join(ax.get_ylabel().split()) for ax in speedup_panels(fig))
    sweep_plot.figures.pyplot().close(fig)


def sampled(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "q20_ms": min(ms), "q80_ms": max(ms), "samples_ms": ms}


def test_the_speed_up_is_the_per_round_median_with_the_ratio_of_the_medians_beside_it():
    """The issue's contradiction: the time panel's medians say one ratio, the speed-up another. Here
    torch's and ours' medians are both 3 ms (a ratio of 1.00) while the per-round ratios' median is
    4/3: both are drawn, the first hollow, at the same x. The speed-up is computed from the rounds,
    not read from ``ratio_*`` (files from before the per-round median hold the medians' ratio there)."""
    from timing import ratio_spread

    torch_ms, ours_ms = [1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 1.0, 2.0, 3.0, 4.0]
    p = {"numel": 4096, "dtype": "float32", "layout": "flat", "invalid": []}
    p |= {"torch": sampled(torch_ms), "tritonscale": sampled(ours_ms), "torch-fused": sampled(torch_ms),
          "fold": sampled(ours_ms), "copy": sampled([1.0] * 5)}  # fmt: skip
    stale = {"ratio": 1.0, "q20": 1.04, "q80": 1.6, "rounds": 5, "within_noise": False}  # a median over a median
    for key, *_ in sweep_plot.RATIOS:
        p[key], p[f"{key}_spread"] = 1.0, stale
    fig = sweep_plot.figure([p], sweep.VARIANTS, sweep.LAYOUT_NAMES)
    (ax,) = speedup_panels(fig)
    oracle = ratio_spread(torch_ms, ours_ms)
    for key, label, *_ in sweep_plot.RATIOS:
        lines = {line.get_label(): line for line in ax.get_lines()}
        filled, hollow = lines[label], lines[f"_{label}: ratio of the medians"]
        assert list(filled.get_ydata()) == [pytest.approx(4 / 3)] == [pytest.approx(oracle["ratio"])]
        assert list(hollow.get_ydata()) == [pytest.approx(1.0)]
        assert list(hollow.get_xdata()) == list(filled.get_xdata())
        assert hollow.get_markerfacecolor() == "none" and filled.get_markerfacecolor() != "none"
    assert "median over 5 rounds" in " ".join(ax.get_ylabel().split())
    sweep_plot.figures.pyplot().close(fig)


def test_without_rounds_the_speed_up_axis_says_it_is_the_ratio_of_the_medians():
    """A GPU's do_bench keeps no rounds: the point's ratio is the medians', no bars, no hollow twin."""
    p = {"numel": 4096, "dtype": "float32", "layout": "flat", "invalid": []}
    p |= {v: timing(2.0) for v in sweep.VARIANTS} | {"ratio_tritonscale": 1.0, "ratio_fold": 1.0}
    fig = sweep_plot.figure([p], sweep.VARIANTS, sweep.LAYOUT_NAMES)
    (ax,) = speedup_panels(fig)
    assert "ratio of the median times" in " ".join(ax.get_ylabel().split())
    assert not [line for line in ax.get_lines() if "ratio of the medians" in line.get_label()]
    sweep_plot.figures.pyplot().close(fig)


def test_redraw_draws_the_png_beside_its_json_from_that_file_alone(tmp_path):
    machine = {"device": "cpu", "processor": "test CPU", "threads": 2, "torch": "2.x", "triton": "3.x"}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"machine": machine, "layouts": sweep.LAYOUT_NAMES, "points": synthetic_points()}))
    assert sweep_plot.main([str(path)]) == 0
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
