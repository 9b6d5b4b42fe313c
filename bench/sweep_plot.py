"""The sweep's figure (sweep.png): per dtype, a row of time panels and a row of speed-up panels,
one column per layout.

Time panels: median ms per step against size for each variant, with its p20-p80 band (log axes).
Speed-up panels, below the time panel of the same layout: torch / tritonscale and torch-fused /
fold against size on a log axis (ratios span decades), with the p20-p80 of the per-round ratios
as error bars, each series with its own colour and marker and nudged apart along x so neither
hides the other. Points the sweep marked ``invalid`` (a skipped step, a rate above the copy's) are
not drawn; the panel's title counts them.

    fig = figure(points, sweep.VARIANTS, sweep.LAYOUT_NAMES)   # a matplotlib Figure
"""

from __future__ import annotations

from pathlib import Path

import figures

COLORS = {
    "torch": "tab:blue",
    "tritonscale": "tab:orange",
    "torch-fused": "tab:green",
    "fold": "tab:red",
    "copy": "tab:gray",
}
RATIOS = (  # key in a point, label, colour, marker, x nudge (a factor: the x axis is log)
    ("ratio_tritonscale", "torch / tritonscale", COLORS["tritonscale"], "o", 2**-0.12),
    ("ratio_fold", "torch-fused / fold", COLORS["fold"], "s", 2**0.12),
)


def plot(points: list[dict], path: Path, title: str, variants: tuple[str, ...], layout_names: dict) -> Path:
    """Write the figure of ``points`` (bench_point's dicts) to ``path`` (PNG)."""
    fig = figure(points, variants, layout_names)
    notes = "; ".join(f"{k}: {layout_names[k]}" for k in dict.fromkeys(p["layout"] for p in points))
    caption = f"{title}\nlayouts: {notes}; bands and bars: 20%-80% of the repeats"
    height = fig.get_figheight()
    return figures.save(fig, path, caption, rect=(0, 0.35 / height, 1, 1 - 0.45 / height))


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


def time_panel(ax, series: list[dict], name: str, variants: tuple[str, ...], baseline: bool) -> None:
    """Median ms per step against size for each variant, with its p20-p80 band."""
    title = f"{name}: time per step{invalid_note(series)}"
    if not baseline:  # float16: torch's GradScaler refuses to unscale float16 gradients
        title += "\nno speed-up: torch.amp.GradScaler refuses these gradients"
    series = [p for p in series if not p.get("invalid")]
    for variant in variants:
        have = [p for p in series if variant in p]
        if not have:
            continue
        x = [p["numel"] for p in have]
        ax.plot(x, [p[variant]["median_ms"] for p in have], marker="o", ms=3, label=variant, color=COLORS[variant],
                linestyle="--" if variant == "copy" else "-")  # fmt: skip
        ax.fill_between(x, [p[variant]["q20_ms"] for p in have], [p[variant]["q80_ms"] for p in have],
                        color=COLORS[variant], alpha=0.2, lw=0)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("ms per step (median, p20-p80 band)")
    ax.grid(True, which="both", alpha=0.3)


def speedup_panel(ax, series: list[dict], name: str) -> None:
    """The two speed-ups against size on a log axis, p20-p80 bars, a legend."""
    title = f"{name}: speed-up (>1: tritonscale faster){invalid_note(series)}"
    ax.set_title(title, fontsize=9)
    series = [p for p in series if not p.get("invalid")]
    drawn = []
    for key, label, color, marker, nudge in RATIOS:
        have = [p for p in series if key in p]
        if not have:
            continue
        xs, ys = [p["numel"] * nudge for p in have], [p[key] for p in have]
        spreads = [p.get(f"{key}_spread") or {"q20": y, "q80": y} for p, y in zip(have, ys)]
        lows, highs = [s["q20"] for s in spreads], [s["q80"] for s in spreads]
        ax.plot(xs, ys, label=label, color=color, marker=marker, ms=5, lw=1.2)
        # The bars span exactly p20..p80 of the per-round ratios (no clipping where the ratio of the
        # medians falls outside them), with caps.
        ax.vlines(xs, lows, highs, color=color, lw=1.2)
        ax.plot(xs + xs, lows + highs, linestyle="none", marker="_", ms=7, color=color)
        drawn += lows + highs + ys
    if not drawn:
        ax.text(0.5, 0.5, "no valid point", ha="center", va="center", transform=ax.transAxes)
        return
    ratio_axis(ax, min(drawn), max(drawn))
    ax.legend(fontsize=7, loc="best")


def ratio_axis(ax, low: float, high: float) -> None:
    """A log2 y axis labelled 0.5x, 1x, 2x...: wide enough for 0.5x..2x and the data, a line at 1x."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(0.5, low / 1.25), max(2.0, high * 1.25))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("time ratio (p20-p80 bars; across 1x: noise)")
    ax.grid(True, which="major", alpha=0.3)
