"""Every row of the single-process harness, in one list: the entry points, the loop objects, the
optimizer rows and the state rows. The coverage test (test_coverage.py) reads the same list."""

from .entry_points import ENTRY_POINTS
from .loop_rows import LOOP_ROWS
from .optimizer_rows import OPTIMIZER_ROWS
from .state_rows import STATE_ROWS

ROWS = [*ENTRY_POINTS, *LOOP_ROWS, *OPTIMIZER_ROWS, *STATE_ROWS]
