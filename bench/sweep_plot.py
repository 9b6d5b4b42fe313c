"""The sweep's figure (sweep.png): per dtype, a row of time panels and a row of speed-up panels,
one column per layout.

Time panels: median ms per step against size for each variant, with its p20-p80 as an error bar
(log axes). Each variant has its own colour, marker (hollow) and line style, its own z-order, and
its points nudged along x by a fixed step per variant, so two variants with equal times still show
both markers side by side. Bars rather than shaded bands: four bands of neighbouring variants
overlapped into one brown area (issue 49), and a band joins sizes that were never measured.

Speed-up panels, below the time panel of the same layout: torch / tritonscale and torch-fused /
fold against size on a log axis (ratios span decades). The filled markers, joined by a line, are
the median of the per-round ratios (round r: the numerator's time in round r over the
denominator's in the same round, so drift between rounds cancels), with their p20-p80 as error
bars; the panel's y label names that statistic and how many rounds it is the median of. That
median need not equal the ratio of the two medians in the time panel above (issue 49: a reader
took the difference for an error), so the ratio of the medians is drawn too, as a hollow marker at
the same x: where the two disagree, the figure shows it. The per-round median is computed here from
the point's ``samples_ms`` (``timing.ratio_spread``): files written before sweep.py stored that
median hold the ratio of the medians under ``ratio_*``. Without rounds (a GPU's do_bench keeps
none) the ratio of the medians is all there is, and the label says so.

Points the sweep marked ``invalid`` (a skipped step, a rate above the copy's) are not drawn; the
panel's title counts them.

    fig = figure(points, sweep.VARIANTS, sweep.LAYOUT_NAMES)   # a matplotlib Figure
    python bench/sweep_plot.py bench/results/cpu/sweep/sweep.json   # redraw sweep.png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import figures

STYLES = {  # colour, marker, line style: each variant is told apart by any one of the three
    "torch": ("tab:blue", "o", "-"),
    "tritonscale": ("tab:orange", "s", "--"),
    "torch-fused": ("tab:green", "^", "-."),
    "fold": ("tab:red", "D", ":"),
    "copy": ("tab:gray", "v", (0, (6, 2, 1, 2, 1, 2))),
}
VARIANT_NUDGE = 2**0.15  # x factor between neighbouring variants' points (the x axis is log2)
RATIOS = (  # key in a point, label, numerator and denominator variants, marker, x nudge (a factor)
    ("ratio_tritonscale", "torch / tritonscale", "torch", "tritonscale", "o", 2**-0.15),
    ("ratio_fold", "torch-fused / fold", "torch-fused", "fold", "s", 2**0.15),
)
SPREAD_NOTE = (
    "speed-up, filled markers: median of the per-round ratios (round r: torch's time in round r / ours in that "
    "round); hollow: the ratio of the two medians above, which can differ"
)
MEDIANS_NOTE = "speed-up: the ratio of the two medians above (no rounds kept, so no per-round spread)"


def plot(points: list[dict], path: Path, title: str, variants: tuple[str, ...], layout_names: dict) -> Path:
    """Write the figure of ``points`` (bench_point's dicts) to ``path`` (PNG)."""
    fig = figure(points, variants, layout_names)
    notes = "; ".join(f"{k}: {layout_names[k]}" for k in dict.fromkeys(p["layout"] for p in points))
    rounds = [speedup(p, key, a, b)["rounds"] for p in points for key, _, a, b, *_ in RATIOS if key in p]
    speedup_note = SPREAD_NOTE if any(r is not None for r in rounds) else MEDIANS_NOTE if rounds else ""
    caption = (f"{title}\nlayouts: {notes}\nbars: p20-p80 of the timed rounds (across 1x: noise); a size's points are "
               f"nudged apart along x, so that none hides another\n{speedup_note}").rstrip()  # fmt: skip
    height = fig.get_figheight()
    return figures.save(fig, path, caption, rect=(0, 0.35 / height, 1, 1 - 0.45 / height))


def figure_title(machine: dict, cut_note: str | None = None) -> str:
    """The figure's first title line, for the machine of a sweep.json, and the re-planner's cut
    (``replan.cut_note``) on a line of its own when run_all cut the sweep."""
    from timing import describe

    title = f"clip + optimizer step + scale update on {describe(machine)}"
    return f"{title}\n{cut_note}" if cut_note else title


def redraw(json_path: Path, variants: tuple[str, ...]) -> Path:
    """Draw the sweep.png beside ``json_path`` (a sweep.json) again from that file alone."""
    data = json.loads(json_path.read_text())
    title = figure_title(data["machine"], data.get("cut_note"))
    return plot(data["points"], json_path.with_suffix(".png"), title, variants, data["layouts"])


def figure(points: list[dict], variants: tuple[str, ...], layout_names: dict):
    """The matplotlib Figure: per dtype a row of time panels and, where torch's baseline ran, a row of
    speed-up panels; one column per layout, in the points' order."""
    plt = figures.pyplot()
    dtypes = list(dict.fromkeys(p["dtype"] for p in points))
    layouts = list(dict.fromkeys(p["layout"] for p in points))
    rows = [(dtype, kind) for dtype in dtypes for kind in ("time", "speed-up")
            if kind == "time" or has_ratios([p for p in points if p["dtype"] == dtype])]  # fmt: skip
    fig, axes = plt.subplots(len(rows), len(layouts), figsize=(5.6 * len(layouts), 3.6 * len(rows)), squeeze=False,
                             sharex="col")  # fmt: skip
    for row, (dtype, kind) in zip(axes, rows):
        for ax, layout in zip(row, layouts):
            series = [p for p in points if p["dtype"] == dtype and p["layout"] == layout]
            series.sort(key=lambda p: p["numel"])
            name = f"{dtype}, {layout_names[layout]}"
            if kind == "time":
                time_panel(ax, series, name, variants, has_ratios(series))
            else:
                speedup_panel(ax, series, name)
            sizes = [p["numel"] for p in series] or [1]
            ax.set_xlim(min(sizes) / 1.6, max(sizes) * 1.6)  # room for the nudged markers, one size or many
    for ax in axes[-1]:
        ax.set_xlabel("gradient elements")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    return fig


def has_ratios(series: list[dict]) -> bool:
    return any(key in p for p in series for key, *_ in RATIOS)


def invalid_note(series: list[dict]) -> str:
    bad = sum(1 for p in series if p.get("invalid"))
    return f" ({bad} invalid point{'s' * (bad != 1)} not drawn)" if bad else ""


def bars(ax, xs: list[float], lows: list[float], highs: list[float], color: str, zorder: float) -> None:
    """Error bars spanning exactly ``lows[i]..highs[i]`` at ``xs[i]`` (one LineCollection), with caps."""
    ax.vlines(xs, lows, highs, color=color, lw=1.1, zorder=zorder)
    ax.plot(xs + xs, lows + highs, linestyle="none", marker="_", ms=6, color=color, zorder=zorder)


def time_panel(ax, series: list[dict], name: str, variants: tuple[str, ...], baseline: bool) -> None:
    """Median ms per step against size for each variant, with its p20-p80 bars; variant i's points
    sit at size * VARIANT_NUDGE ** (i - centre) and are drawn at z-order 3 + i."""
    title = f"{name}: time per step{invalid_note(series)}"
    if not baseline:  # float16: torch's GradScaler refuses to unscale float16 gradients
        title += "\nno speed-up: torch.amp.GradScaler refuses these gradients"
    series = [p for p in series if not p.get("invalid")]
    centre = (len(variants) - 1) / 2
    for i, variant in enumerate(variants):
        have = [p for p in series if variant in p]
        if not have:
            continue
        colour, marker, linestyle = STYLES[variant]
        x = [p["numel"] * VARIANT_NUDGE ** (i - centre) for p in have]
        zorder = 3 + i
        bars(ax, x, [p[variant]["q20_ms"] for p in have], [p[variant]["q80_ms"] for p in have], colour, zorder)
        ax.plot(x, [p[variant]["median_ms"] for p in have], label=variant, color=colour, marker=marker, ms=5,
                mfc="none", mew=1.2, linestyle=linestyle, lw=1.2, zorder=zorder)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("ms per step (median, p20-p80 bars)")
    ax.grid(True, which="both", alpha=0.3)


def speedup(point: dict, key: str, numerator: str, denominator: str) -> dict:
    """The speed-up drawn for ``point``: ``ratio``, ``q20``, ``q80`` and ``rounds``, the median and
    quantiles of the per-round ratios, from the samples (``timing.ratio_spread``) when both variants
    kept theirs round by round, else from the point's stored spread; ``rounds`` None and no band
    when the point has neither (a GPU's do_bench: ``ratio`` is the ratio of the medians)."""
    a, b = point[numerator].get("samples_ms"), point[denominator].get("samples_ms")
    if a and b and len(a) == len(b):
        from timing import ratio_spread

        return ratio_spread(a, b)
    spread = point.get(f"{key}_spread")
    if spread:
        return {"ratio": point[key], "q20": spread["q20"], "q80": spread["q80"], "rounds": spread.get("rounds")}
    return {"ratio": point[key], "q20": point[key], "q80": point[key], "rounds": None}


def medians_ratio(point: dict, numerator: str, denominator: str) -> float:
    """The ratio of the two variants' median times: what the time panel above shows."""
    return point[numerator]["median_ms"] / point[denominator]["median_ms"]


def statistic_label(rounds: list[int | None]) -> str:
    """The speed-up axis's label: the statistic drawn, and over how many rounds (read from the data)."""
    counts = sorted({r for r in rounds if r is not None})
    if not counts:
        return "torch/ours: ratio of the\nmedian times (no rounds kept)"
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"median over {span} rounds\nof per-round torch/ours ratios"


def speedup_panel(ax, series: list[dict], name: str) -> None:
    """The two speed-ups against size on a log axis: the per-round medians with their p20-p80 bars,
    the ratios of the medians as hollow markers where there are rounds, a legend."""
    from matplotlib.lines import Line2D

    ax.set_title(f"{name}: speed-up (>1: tritonscale faster){invalid_note(series)}", fontsize=9)
    series = [p for p in series if not p.get("invalid")]
    drawn, rounds, hollow = [], [], False
    for key, label, numerator, denominator, marker, nudge in RATIOS:
        have = [p for p in series if key in p]
        if not have:
            continue
        colour = STYLES[denominator][0]
        spreads = [speedup(p, key, numerator, denominator) for p in have]
        xs, ys = [p["numel"] * nudge for p in have], [s["ratio"] for s in spreads]
        lows, highs = [s["q20"] for s in spreads], [s["q80"] for s in spreads]
        bars(ax, xs, lows, highs, colour, zorder=3)
        ax.plot(xs, ys, label=label, color=colour, marker=marker, ms=5, lw=1.2, zorder=3)
        with_rounds = [(x, medians_ratio(p, numerator, denominator)) for x, p, s in zip(xs, have, spreads)
                       if s["rounds"] is not None]  # fmt: skip
        if with_rounds:
            ax.plot(*zip(*with_rounds), label=f"_{label}: ratio of the medians", color=colour, marker=marker, ms=9,
                    mfc="none", mew=1.0, linestyle="none", zorder=4)  # fmt: skip
            drawn += [y for _, y in with_rounds]
            hollow = True
        drawn += lows + highs + ys
        rounds += [s["rounds"] for s in spreads]
    if not drawn:
        ax.text(0.5, 0.5, "no valid point", ha="center", va="center", transform=ax.transAxes)
        return
    ratio_axis(ax, min(drawn), max(drawn))
    ax.set_ylabel(statistic_label(rounds), fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    if hollow:
        handles.append(Line2D([], [], color="black", marker="o", ms=9, mfc="none", mew=1.0, linestyle="none"))
        labels.append("hollow: ratio of the medians")
    ax.legend(handles, labels, fontsize=7, loc="best")


def ratio_axis(ax, low: float, high: float) -> None:
    """A log2 y axis labelled 0.5x, 1x, 2x...: wide enough for 0.5x..2x and the data, a line at 1x."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(0.5, low / 1.25), max(2.0, high * 1.25))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    """Redraw each sweep.json named on the command line (its PNG beside it)."""
    import sweep  # here, not at the top: sweep imports this module

    for name in argv if argv is not None else sys.argv[1:]:
        print(f"wrote {redraw(Path(name), sweep.VARIANTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
