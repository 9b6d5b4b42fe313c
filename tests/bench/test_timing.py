"""bench/timing.py's ratio: one statistic, drawn with its own band. The headline ratio is the median
of the per-round ratios, so it always lies inside their p20-p80 band (a median of a over a median of
b did not: 6 of 52 speed-ups of a sweep sat outside their own bars, e.g. ``0.75 [1.07, 1.36]``)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import ratio_spread  # noqa: E402

times = st.floats(1e-4, 1e2, allow_nan=False)


@given(st.lists(st.tuples(times, times), min_size=1, max_size=30))
@example([(1.0, 2.0), (3.0, 3.25), (3.0, 3.25)])  # statistics' p80 an ulp below the median
@example([(1.6562855686750602, 1.0), (1.6562855686750604, 1.0)])  # the median rounds up past p80
def test_the_ratio_is_the_median_of_the_rounds_and_lies_in_its_band(rounds):
    a, b = [r[0] for r in rounds], [r[1] for r in rounds]
    spread = ratio_spread(a, b)
    assert spread["ratio"] == statistics.median([x / y for x, y in rounds])
    assert spread["q20"] <= spread["ratio"] <= spread["q80"], spread


def test_a_drifting_pair_keeps_its_ratio_in_the_band():
    # Round by round b is ~1.2x slower, but b's slow rounds and a's slow rounds are different ones.
    a = [1.0, 1.0, 1.0, 3.0, 3.0]
    b = [1.2, 1.2, 3.6, 3.6, 3.6]
    spread = ratio_spread(b, a)
    assert spread["ratio"] == 1.2 and spread["q20"] <= 1.2 <= spread["q80"], spread
