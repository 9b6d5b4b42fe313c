"""train_step.png read back from its artists: the scaler's part of the step in a panel of its own,
each bar drawn to its measured value with its p20-p80 centred on its median; the whole step beside its
stacked phases, with a note wherever the stack stands above the step (medians do not add); a title
naming the steps every median is over and, for a run the re-planner cut, saying so."""

from __future__ import annotations

import json
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
        part = {"median_ms": 8.0 + 2 * k, "q20_ms": 7.0 + k, "q80_ms": 11.0 + 3 * k}  # the per-step sums' quantiles
        step = {"median_ms": median, "q20_ms": q20, "q80_ms": q80}
        results[name] = {"phases": phases, "step": step, "scaler_step_update": part,
                         "scaler_share": phases["scaler"]["median_ms"] / median}  # fmt: skip
    return results


def panels(fig):
    """(the scaler's part, the whole step): the figure's two panels, told apart by their titles."""
    part, whole = fig.axes
    assert part.get_title().startswith("the scaler's part of the step")
    assert whole.get_title().startswith("the whole step and its phases")
    return part, whole


def bars_by_label(ax) -> dict:
    return {c.get_label(): c for c in ax.containers if type(c).__name__ == "BarContainer"}


def whisker_ends(errors) -> list[float]:
    """The low and high end of every whisker of an errorbar container, bar by bar."""
    _, _, (whiskers,) = errors.lines
    return [y for seg in whiskers.get_segments() for y in (seg[0][1], seg[1][1])]


def test_whole_step_bars_and_error_bars_show_the_measured_values():
    results = synthetic_results()
    fig = train_step.figure(results)
    _, ax = panels(fig)
    bars = bars_by_label(ax)
    (errors,) = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    medians = [r["step"]["median_ms"] for r in results.values()]

    step_bars = bars.pop("whole step (median)")
    assert [b.get_y() for b in step_bars] == [0.0] * len(results)
    assert [b.get_height() for b in step_bars] == medians  # each step bar drawn to its median

    centre, _, _ = errors.lines
    assert list(centre.get_ydata()) == medians  # the error bar is centred on the plotted median
    assert list(centre.get_xdata()) == [b.get_x() + b.get_width() / 2 for b in step_bars]
    measured = [q for r in results.values() for q in (r["step"]["q20_ms"], r["step"]["q80_ms"])]
    assert whisker_ends(errors) == pytest.approx(measured, rel=1e-12)  # the measured p20..p80 (yerr's rounding)

    bottoms = [0.0] * len(results)
    for phase in train_step.PHASES:  # the stacked phases: each segment its phase's median, in order
        segments = bars.pop(f"{phase} (median)")
        assert [b.get_y() for b in segments] == pytest.approx(bottoms)
        heights = [r["phases"][phase]["median_ms"] for r in results.values()]
        assert [b.get_height() for b in segments] == heights
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    assert bars == {}
    train_step.figures.pyplot().close(fig)


def test_the_scaler_part_panel_draws_each_measured_median_with_its_p20_p80():
    # The old plot had one panel, the whole step, whose gap between variants lay in backward: it fails here.
    results = synthetic_results()
    fig = train_step.figure(results)
    ax, _ = panels(fig)
    bars = bars_by_label(ax)
    errors = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    expected = {"scaler + step + update (per-step sum)": [r["scaler_step_update"] for r in results.values()]}
    expected |= {f"{ph}: {train_step.PHASE_ROLES[ph]}": [r["phases"][ph] for r in results.values()]
                 for ph in train_step.SCALER_PHASES}  # fmt: skip
    assert list(bars) == list(expected) and len(errors) == len(expected)  # the sum, then scaler, step, update
    for (label, stats), drawn, spread in zip(expected.items(), bars.values(), errors):
        assert [b.get_y() for b in drawn] == [0.0] * len(results)
        assert [b.get_height() for b in drawn] == [s["median_ms"] for s in stats], label
        centre, _, _ = spread.lines
        assert list(centre.get_xdata()) == pytest.approx([b.get_x() + b.get_width() / 2 for b in drawn])  # on its bar
        assert list(centre.get_ydata()) == [s["median_ms"] for s in stats]
        assert whisker_ends(spread) == pytest.approx([q for s in stats for q in (s["q20_ms"], s["q80_ms"])])
    for i, name in enumerate(results):  # each variant's four bars sit around its own tick
        assert all(abs(drawn[i].get_x() + drawn[i].get_width() / 2 - i) < 0.5 for drawn in bars.values()), name
    (line,) = [line for line in ax.lines if line.get_linestyle() == "--"]  # no-scaling's sum: the optimizer alone
    assert list(line.get_ydata()) == [results["no-scaling"]["scaler_step_update"]["median_ms"]] * 2
    labels = [t.get_text() for t in ax.get_xticklabels()]
    fold = results["tritonscale-fold"]
    share = fold["scaler_step_update"]["median_ms"] / fold["step"]["median_ms"]
    assert labels[2] == f"tritonscale-fold\n12.00 ms\n[9, 17]\n{share:.1%} of the step"
    train_step.figures.pyplot().close(fig)


def stars_and_note(ax) -> tuple[list[float], list[str]]:
    """The x of every ``*`` over a stack, and every text that says medians do not add."""
    stars = [t.xy[0] for t in ax.texts if t.get_text() == "*"]
    notes = [t.get_text() for t in ax.texts if "medians do not add" in t.get_text()]
    return stars, notes


def test_a_note_says_medians_do_not_add_exactly_where_the_stack_stands_above_the_step():
    results = synthetic_results()  # the stacks: 21, 27, 33 ms against steps of 300, 41, 39.5: none above
    fig = train_step.figure(results)
    assert stars_and_note(panels(fig)[1]) == ([], [])
    train_step.figures.pyplot().close(fig)

    results["torch-fused"]["step"] = {"median_ms": 26.9, "q20_ms": 25.0, "q80_ms": 30.0}  # its stack, 27 ms, above it
    results["tritonscale-fold"]["step"] = {"median_ms": 33.0, "q20_ms": 30.0, "q80_ms": 36.0}  # level: no note
    fig = train_step.figure(results)
    _, ax = panels(fig)
    stars, notes = stars_and_note(ax)
    assert stars == [1 + 0.2] and len(notes) == 1  # over torch-fused's stack only, and one note for the panel
    (star,) = [t for t in ax.texts if t.get_text() == "*"]
    assert star.xy[1] == pytest.approx(sum(results["torch-fused"]["phases"][ph]["median_ms"]
                                           for ph in train_step.PHASES))  # fmt: skip
    train_step.figures.pyplot().close(fig)


def record(cut_note: str | None = None) -> dict:
    """A train_step.json record as ``main`` writes it (the synthetic results, the CPU preset)."""
    args = {"dtype": "float32", "autocast": "none", "max_norm": 1.0, "cut_note": cut_note,
            "preset": {"d_model": 256, "layers": 6, "context": 64, "batch": 4, "vocab": 256, "steps": 40, "warmup": 3}}
    machine = {"device": "cpu", "processor": "AMD EPYC", "threads": 2, "torch": "2.13.0+cpu", "triton": "3.9.0"}
    return {"machine": machine, "args": args, "parameters": 4_890_000, "tensors": 78, "variants": synthetic_results()}


def drawn_title(tmp_path, rec: dict) -> str:
    """The title of the PNG drawn from ``rec`` as it is saved (wrapped to the figure), on one line."""
    fig = train_step.figure(rec["variants"])
    train_step.figures.save(fig, tmp_path / "train_step.png", train_step.plot_title(rec))
    return " ".join(fig._suptitle.get_text().split())


def test_the_title_names_the_steps_every_median_is_over(tmp_path):
    title = drawn_title(tmp_path, record())
    assert "40 timed steps per variant" in title and "after 3 warm-up" in title  # the old title named neither
    assert "4.89M parameters in 78 tensors" in title and "cpu (AMD EPYC, 2 threads)" in title
    assert "CUT" not in title


def test_a_cut_run_says_so_in_its_title_planned_against_run(tmp_path):
    import replan

    note = replan.cut_note({"steps": 40}, {"steps": 10}, {"slowdown": 3.1, "time_left_s": 52.0}, 206.0)
    title = drawn_title(tmp_path, record(note))
    assert "CUT by the re-planner: 10 of 40 planned steps (the machine 3.1x slower than the pilots" in title
    assert train_step.parse_args(["--steps", "10", "--cut-note", note]).cut_note == note  # as run_all passes it


def test_replot_draws_the_png_again_from_its_json(tmp_path):
    path = tmp_path / "train_step.json"
    path.write_text(json.dumps(record()))
    assert train_step.main(["--replot", str(path)]) == 0
    assert (tmp_path / "train_step.png").stat().st_size > 0


# The issue's GPU run: medians near 40 ms, the whiskers of torch-fused up to 123 ms and of the fold
# up to 111 ms (the axis stops at 2.5x the tallest bar: one runs off the top, one nearly reaches it),
# and a title of the GPU's model and versions on a figure of three variants.
ISSUE_STEPS = {"no-scaling": (40.2, 38.0, 47.0), "torch-fused": (44.0, 41.0, 123.0),
               "tritonscale-fold": (42.5, 40.0, 111.0)}  # fmt: skip
ISSUE_TITLE = ("one training step, 101.82M parameters in 102 tensors (8 blocks, d_model 1024), 16x512 tokens, float32, "
               "autocast float16, clip 1.0\nNVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0")  # fmt: skip


def data_extents(ax, renderer) -> list:
    """Where the axes' data is drawn (pixels, cut to the axes, padded by a pixel: a whisker is a line
    of no width): each bar, each whisker segment, each cap and median marker, each drawn line."""
    boxes = [p.get_window_extent(renderer) for p in ax.patches]
    for collection in ax.collections:  # the whiskers, one segment each
        boxes += [Bbox(ax.transData.transform(segment)) for segment in collection.get_segments()]
    for line in ax.lines:
        points = line.get_transform().transform(line.get_xydata())  # axhline's x is in axes coordinates
        if line.get_linestyle() != "None":  # a drawn line (no-scaling's sum): where it runs
            boxes.append(Bbox([points.min(axis=0), points.max(axis=0)]))
        else:  # the caps and the medians' markers, one box per marker
            half = line.get_markersize() * ax.figure.dpi / 72 / 2
            boxes += [Bbox([xy - half, xy + half]) for xy in points]
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


# The stacks stand above the step of the first two variants: their ``*`` and the note are drawn too.
TALLER_STACKS = {"no-scaling": (20.0, 18.0, 25.0), "torch-fused": (26.0, 24.0, 60.0),
                 "tritonscale-fold": (42.5, 40.0, 111.0)}  # fmt: skip


@pytest.mark.parametrize("steps", [ISSUE_STEPS, TALLER_STACKS], ids=["issue", "taller-stacks"])
def test_labels_hide_no_data_overlap_nothing_and_the_title_fits_the_figure(tmp_path, steps):
    fig = train_step.figure(synthetic_results(steps))
    train_step.figures.save(fig, tmp_path / "train_step.png", ISSUE_TITLE)  # as the PNG is drawn: title, layout
    assert_reads_well(fig, len(steps))
    labels = " ".join(t.get_text() for t in panels(fig)[1].get_xticklabels())
    assert ("[41, 123]" in labels and "[40, 111]" in labels) or steps is TALLER_STACKS  # the whiskers' ends too
    stars, notes = stars_and_note(panels(fig)[1])
    assert len(stars) == (2 if steps is TALLER_STACKS else 0) and len(notes) == (steps is TALLER_STACKS)
    train_step.figures.pyplot().close(fig)


COMMITTED = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("*/train_step*/train_step.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.relative_to(p.parents[2]).as_posix() for p in COMMITTED])
def test_the_committed_results_redraw_legibly(tmp_path, path):
    rec = json.loads(path.read_text())
    fig = train_step.figure(rec["variants"])
    train_step.figures.save(fig, tmp_path / "train_step.png", train_step.plot_title(rec))
    assert_reads_well(fig, len(rec["variants"]))
    train_step.figures.pyplot().close(fig)


def assert_reads_well(fig, variants: int) -> None:
    """No text over data or over another text (titles, tick labels, axis labels, notes, legends), every
    one inside the figure, and every whisker drawn: ``fig`` as saved."""
    renderer = FigureCanvasAgg(fig).get_renderer()  # save closed it: a canvas to measure the drawn figure on
    fig.canvas.draw()
    texts = text_extents(fig, renderer)
    part, whole = panels(fig)
    for ax, bar_sets in ((part, 1 + len(train_step.SCALER_PHASES)), (whole, 1)):
        data = data_extents(ax, renderer)
        errors = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
        assert len(errors) == bar_sets and all(len(e.lines[2][0].get_segments()) == variants for e in errors)
        for text, extent in texts.items():
            hidden = [d for d in data if extent.overlaps(d)]
            assert not hidden, f"{text.get_text()!r} at {extent} covers data at {hidden}"
        ticks = [texts[t] for t in ax.get_xticklabels() if t in texts]
        assert len(ticks) == variants
    blocks = [fig._suptitle, *(t for ax in fig.axes for t in (ax.title, ax.yaxis.label, *ax.get_xticklabels(),
                                                                 *ax.texts))]  # fmt: skip
    boxes = [(t.get_text(), texts[t]) for t in blocks if t in texts]
    boxes += [(f"legend {k}", ax.get_legend().get_window_extent(renderer)) for k, ax in enumerate(fig.axes)]
    for i, (a, box_a) in enumerate(boxes):
        assert fig.bbox.x0 <= box_a.x0 and box_a.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box_a.y0, f"{a!r} runs off"
        assert box_a.y1 <= fig.bbox.y1, f"{a!r} runs off the top"
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
