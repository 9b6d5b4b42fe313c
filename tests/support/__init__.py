"""The test suite's shared instruments: what several test folders use and no test is about.

- ``compiled_placements``: where a compiled clip can run on this torch (the compiled tests' marks).
- ``host_reads``: ``HostReadGuard``, the guard that fails a test whose GPU path reads device memory
  on the host (the suite-wide fixture in ``tests/conftest.py``).
- ``launches``: ``LaunchCounter``, the Triton and torch launches of a phase.
- ``multiprocess``: ``run_ranks``, gloo ranks in subprocesses with a timeout on every group.
"""
