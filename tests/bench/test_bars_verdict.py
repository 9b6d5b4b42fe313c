"""bench/bars.py's verdict on a target: met or missed only beyond the run's noise. A round whose
ideal was disturbed printed "ideal/ours = 1.421 [0.680, 1.686] within noise (target >= 0.85: met)"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their helpers by name
bars = pytest.importorskip("bars")


def spread(ratio: float, q20: float, q80: float) -> dict:
    return {"ratio": ratio, "q20": q20, "q80": q80, "rounds": 21, "within_noise": q20 <= 1.0 <= q80}


@pytest.mark.parametrize(
    ("band", "target", "expected"),
    [
        ((1.421, 0.680, 1.686), ">= 0.85", None),  # the disturbed round: the band straddles the target
        ((0.661, 0.609, 0.689), ">= 0.85", False),
        ((0.900, 0.860, 0.950), ">= 0.85", True),
        ((1.028, 0.999, 1.065), ">= 1.0", None),
        ((1.080, 1.050, 1.150), "<= 1.10", None),
        ((1.020, 0.990, 1.050), "<= 1.10", True),
        ((1.200, 1.150, 1.300), "<= 1.10", False),
    ],
)
def test_a_target_is_met_or_missed_only_by_the_whole_band(band, target, expected):
    assert bars.target_verdict(spread(*band), target) is expected


def test_the_printed_line_says_when_the_band_straddles_the_target(capsys):
    samples = {"ideal": [1.0, 2.0, 4.0, 1.0, 2.0], "ours": [2.0, 2.0, 2.0, 2.0, 2.0]}
    timed = {name: {"median_ms": sorted(s)[2], "samples_ms": s} for name, s in samples.items()}
    line = bars.ratio_line("1", "case", "ideal", "ours", timed, ">= 0.85")
    assert line["met"] is None
    assert "(target >= 0.85: not clear: its p20-p80 straddles it)" in capsys.readouterr().out
