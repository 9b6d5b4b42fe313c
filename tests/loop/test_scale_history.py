"""ScaleHistory: a run's stats recorded through a StepLog (no sync) equal each step's stats() read at once."""

from __future__ import annotations

import pytest
from integrations.skip_truth import SKIP_CASES
from oracles.stats import STEPS, oracle_rows, run_case

import tritonscale
from tritonscale import ScaleHistory
from tritonscale.scaler.diagnostics import STAT_NAMES


def exact_columns(columns: dict[str, list]) -> dict[str, list[str]]:
    """repr of each value: tells 1 from 1.0 and compares NaN norms."""
    return {name: [repr(v) for v in column] for name, column in columns.items()}


def oracle_columns(case: str, backend: str = "auto") -> dict[str, list[str]]:
    oracle = [values for _, values in oracle_rows(case, backend=backend)]
    return exact_columns({name: [values[name] for values in oracle] for name in STAT_NAMES})


@pytest.mark.parametrize("case", SKIP_CASES)
def test_history_equals_the_stats_read_at_once(case):
    history = ScaleHistory()
    run_case(case, lambda step, scaler: history.record(scaler))
    assert len(history) == STEPS  # rows still in flight count too
    assert exact_columns(history.to_lists()) == oracle_columns(case)


def test_history_records_with_no_host_read(backend, forbid_host_reads):
    # A fused optimizer: the step reads nothing on the GPU paths, so the whole loop is armed.
    history = ScaleHistory()
    with forbid_host_reads.armed():
        run_case("fused_adamw", lambda step, scaler: history.record(scaler), backend=backend)
    assert exact_columns(history.to_lists()) == oracle_columns("fused_adamw", backend)


def test_history_plots(tmp_path):
    history = ScaleHistory()
    run_case("hysteresis", lambda step, scaler: history.record(scaler), steps=8)
    path = history.plot(tmp_path / "history.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert tritonscale.ScaleHistory is ScaleHistory


@pytest.mark.parametrize("case", ["sgd", "norm_spike"])  # skipped on an overflow (inf norm) / on a finite spike
def test_the_norm_line_breaks_at_every_skipped_step(case):
    history = ScaleHistory()
    run_case(case, lambda step, scaler: history.record(scaler))
    oracle = [values for _, values in oracle_rows(case)]
    skipped = [step for step, values in enumerate(oracle) if values["skipped"]]
    assert skipped and 0 < skipped[0] < STEPS - 1  # a skip between applied steps: a line could cross it

    fig = history.figure()
    ax_norm = fig.axes[1]
    line = next(line for line in ax_norm.get_lines() if line.get_label() == "grad norm (unscaled)")
    expected = [float("nan") if step in skipped else values["norm"] for step, values in enumerate(oracle)]
    assert list(line.get_xdata()) == list(range(STEPS))
    assert [repr(float(y)) for y in line.get_ydata()] == [repr(y) for y in expected]  # NaN (a gap) exactly at the skips
    spikes = [line for line in ax_norm.get_lines() if line.get_label() == "norm of a skipped step"]
    finite_skips = [step for step in skipped if oracle[step]["norm"] < float("inf")]
    assert [list(s.get_xdata()) for s in spikes] == ([finite_skips] if finite_skips else [])
    matplotlib = pytest.importorskip("matplotlib.pyplot")
    matplotlib.close(fig)
