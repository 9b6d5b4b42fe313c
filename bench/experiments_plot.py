"""The experiments' figure: one row per experiment, torch's run and tritonscale's told apart.

Columns: the loss; the loss difference tritonscale - torch (the two curves coincide when the runs
agree, so the difference is what shows whether they do); the loss scale; the gradient norm before
clipping (broken at every skipped step: no norm was applied there); the skipped steps so far.
torch is drawn as a thick light line and tritonscale as a thin dark dashed line on top of it, so
both stay visible where they coincide. One legend, below the panels, off the data.

A gap in a norm line is explained where it is (issue 49: readers took the gaps for missing data):
a step whose norm was non-finite (inf or NaN: the step was skipped) gets a triangle on the panel's
top edge, one per run, sized like its line (torch's large and light, tritonscale's small and dark
on top, so coinciding triangles stay visible), and the panel's title says what the gaps and the
triangles are, only when the data have such a step. The skipped-steps count has integer ticks.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import figures

STYLES = {
    "torch": dict(color="#9ecae1", lw=4.0, zorder=1),
    "tritonscale": dict(color="#a63603", lw=1.1, ls="--", zorder=3),
}
OTHER = dict(color="tab:green", lw=1.0, ls=":", zorder=2)  # the overflow experiment's policy run
GAP_MARKER_SIZE = {"torch": 9.0, "tritonscale": 3.5}  # points, like the lines' widths: nested where they coincide
OTHER_GAP_MARKER_SIZE = 6.0  # between the two
WHAT = {
    "lm-fp16": "transformer LM, float16 autocast",
    "lm-bf16": "transformer LM, bfloat16 autocast, no loss scaling",
    "mlp-fp16": "MLP regression, float16 autocast",
    "overflow": "LM, float16, init scale 2^24, lr spike at 40-45%",
}
COLUMNS = (
    ("loss", "loss", "linear"),
    ("loss difference, tritonscale - torch", "difference of the losses", "linear"),
    ("loss scale", "scale (log2)", "log2"),
    ("gradient norm before clipping", "norm (log)", "log"),
    ("skipped steps so far", "steps skipped", "linear"),
)


def cumulative(flags: list[bool]) -> list[int]:
    out, total = [], 0
    for flag in flags:
        total += flag
        out.append(total)
    return out


def applied_norms(series: dict) -> list[float]:
    """The norm of each applied step, NaN at a skipped step or a norm a log axis cannot show: the
    line breaks there (a line joining the neighbours would draw a norm no step applied)."""
    return [n if math.isfinite(n) and n > 0 and not skipped else math.nan
            for n, skipped in zip(series["grad_norm"], series["skipped"])]  # fmt: skip


def gap_note(runs: dict[str, dict]) -> str:
    """The norm panel's note on its gaps: one clause for each reason ``applied_norms`` breaks a line
    that occurs in ``runs`` (a non-finite norm, the step skipped, also marked on the top edge; a
    skipped step with a finite norm; a norm of 0 or below, off a log axis), a line each; "" when no
    line breaks."""
    reasons = []
    if any(not math.isfinite(n) for s in runs.values() for n in s["grad_norm"]):
        reasons.append("gaps and \u25bc on the top edge: non-finite norm (step skipped)")
    if any(skipped and math.isfinite(n) for s in runs.values() for n, skipped in zip(s["grad_norm"], s["skipped"])):
        reasons.append("gaps: skipped step, its finite norm not applied")
    if any(math.isfinite(n) and n <= 0 for s in runs.values() for n in s["grad_norm"]):
        reasons.append("gaps: norm 0 (off the log axis)")
    return "\n".join(reasons)


def mark_non_finite(ax, run_name: str, series: dict, style: dict) -> None:
    """A triangle on ``ax``'s top edge (x: the step, in data; y: the edge, in axes fraction) at each
    step of ``series`` whose norm was non-finite, in the run's colour and z-order."""
    steps = [i for i, n in enumerate(series["grad_norm"]) if not math.isfinite(n)]
    if steps:
        ax.plot(steps, [1.0] * len(steps), transform=ax.get_xaxis_transform(), linestyle="none", marker="v",
                ms=GAP_MARKER_SIZE.get(run_name, OTHER_GAP_MARKER_SIZE), color=style["color"],
                zorder=style["zorder"], clip_on=False, label=f"_{run_name}: non-finite norm")  # fmt: skip


def count_axis(ax, counts: list[int]) -> None:
    """A y axis for a count: integer ticks only, from 0 to at least 1 (a run of no skip reads 0)."""
    from matplotlib.ticker import MaxNLocator

    top = max([1, *counts])
    ax.set_ylim(-0.05 * top, 1.05 * top)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def draw_row(row, result: dict) -> None:
    """One experiment's five panels."""
    runs = result["runs"]
    for run_name, s in runs.items():
        style = STYLES.get(run_name, OTHER)
        steps = range(len(s["loss"]))
        row[0].plot(steps, s["loss"], label=run_name, **style)
        row[2].plot(steps, s["scale"], label=run_name, **style)
        row[3].plot(steps, applied_norms(s), label=run_name, **style)
        mark_non_finite(row[3], run_name, s, style)
        row[4].plot(steps, cumulative(s["skipped"]), label=run_name, **style)
    count_axis(row[4], [sum(s["skipped"]) for s in runs.values()])
    if not any(math.isfinite(n) for s in runs.values() for n in applied_norms(s)):
        row[3].text(0.5, 0.5, "no step applied:\nevery step skipped", ha="center", va="center",
                    transform=row[3].transAxes)  # fmt: skip
    diff = [b - a for a, b in zip(runs["torch"]["loss"], runs["tritonscale"]["loss"])]
    row[1].plot(range(len(diff)), diff, color=STYLES["tritonscale"]["color"], lw=1.0)
    row[1].axhline(0.0, color="black", lw=0.6)
    if not any(diff):
        row[1].text(0.5, 0.5, "identical at every step", ha="center", va="center", transform=row[1].transAxes)
    name = result["experiment"]
    width = f", d_model {result['d_model']}" if result.get("d_model") else ""
    for ax, (title, ylabel, scale) in zip(row, COLUMNS):
        ax.set_title(f"{name}: {title}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        if scale == "log2":
            ax.set_yscale("log", base=2)
        elif scale == "log":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    note = gap_note(runs)
    if note:  # lifted clear of the triangles centred on the top edge
        pad = 6.0 + max(GAP_MARKER_SIZE.values()) / 2
        row[3].set_title(f"{name}: {COLUMNS[3][0]}\n{note}", fontsize=9, pad=pad)
    row[0].set_title(f"{name}: {WHAT.get(name, '')}{width}\nloss (max |diff| from torch {result['max_loss_diff']:.2g})",
                     fontsize=9)  # fmt: skip


def figure_title(machine: dict, cut_note: str | None = None) -> str:
    """The figure's first title line, for the machine of an experiments.json, and the re-planner's
    cut (``replan.cut_note``) on a line of its own when run_all cut the experiments."""
    from timing import describe

    title = f"torch.amp.GradScaler vs tritonscale on {describe(machine)}"
    return f"{title}\n{cut_note}" if cut_note else title


def redraw(json_path: Path) -> Path:
    """Draw the experiments.png beside ``json_path`` (an experiments.json) again from that file alone."""
    data = json.loads(json_path.read_text())
    title = figure_title(data["machine"], data.get("args", {}).get("cut_note"))
    return plot(data["results"], json_path.with_suffix(".png"), title)


def plot(results: list[dict], path: Path, title: str) -> Path:
    """The figure at ``path`` (PNG)."""
    fig = figure(results)
    note = "torch: thick light line; tritonscale: thin dashed line drawn on top (they coincide where the runs agree)"
    height = fig.get_figheight()
    return figures.save(fig, path, f"{title}\n{note}", rect=(0, 0.45 / height, 1, 1.0 - 0.2 / height))


def figure(results: list[dict]):
    """The matplotlib Figure: one row of panels per experiment (experiments.py's result dicts), one legend."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(len(results), len(COLUMNS), figsize=(22, 3.3 * len(results) + 1.0), squeeze=False)
    for row, result in zip(axes, results):
        draw_row(row, result)
    handles, labels = {}, []
    for ax in axes[:, 0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[k] for k in labels], labels, loc="lower center", ncol=len(labels), fontsize=9,
               bbox_to_anchor=(0.5, 0.0), frameon=False)  # fmt: skip
    return fig


def main(argv: list[str] | None = None) -> int:
    """Redraw each experiments.json named on the command line (its PNG beside it)."""
    for name in argv if argv is not None else sys.argv[1:]:
        print(f"wrote {redraw(Path(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
