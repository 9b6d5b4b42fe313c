"""Run a function on real torch.distributed ranks (gloo, CPU processes) and collect what each returns.

Every process group gets a timeout, and the parent waits with a deadline and kills what is left,
so a test can fail but never hang. Workers are module-level functions (spawn pickles them by
name); each returns a picklable value, saved with torch.save and handed back in rank order.

A failure is reported from what every rank left behind, not from whichever the parent saw fail
first: the ranks start their workers together (no rank can leave while a peer is still
connecting), each raising rank's traceback is kept whole in a file of its own, and the parent waits
for every rank to end (a rank waiting on a failed peer ends within the group's timeout) or for the
deadline. No grace period decides what the report holds.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Every collective gives up after this long (a rank that died leaves the others waiting).
GROUP_TIMEOUT = datetime.timedelta(seconds=30)
#: Lines of a rank's stderr quoted in a report (it holds what a rank printed dying in C++).
STDERR_LINES = 20


def _path(tmp: str, rank: int, kind: str) -> str:
    return os.path.join(tmp, f"rank{rank}.{kind}")


def _keep(path: str, write: Callable[[str], None]) -> None:
    """Write under another name and rename: the parent sees a whole file or none."""
    write(path + ".partial")
    os.replace(path + ".partial", path)


def _start_together(store: dist.Store, rank: int, world_size: int) -> None:
    """Return once every rank's process group is up. init_process_group can return on one rank
    while a peer is still connecting, and a rank that raised at once and left would break that
    connect ("Connection closed by peer"): the peer would never run its worker. The file store,
    unlike the group, outlives a rank that leaves."""
    store.set(f"connected{rank}", "1")
    store.wait([f"connected{peer}" for peer in range(world_size)], GROUP_TIMEOUT)


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, worker: Callable, world_size: int, tmp: str, args: tuple) -> None:
    # The rank's stderr goes to a file the parent quotes (gloo aborts from C++, where nothing
    # reaches Python).
    log = open(_path(tmp, rank, "stderr"), "w")
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)  # 2-4 ranks share the 2-core machine
    try:
        store = dist.FileStore(os.path.join(tmp, "rendezvous"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
        _start_together(store, rank, world_size)
        result = worker(rank, world_size, *args)
    except BaseException:
        # Kept before the rank leaves the group, which can abort it from C++ and print more than
        # any tail of its stderr would hold.
        text = traceback.format_exc()
        _keep(_path(tmp, rank, "traceback"), lambda path: Path(path).write_text(text))
        _leave()
        raise
    _keep(_path(tmp, rank, "pt"), lambda path: torch.save(result, path))
    try:
        # Leave together: gloo can abort a rank ("terminate called without an active exception")
        # whose peer tears the group down while it is still connected.
        dist.barrier()
    finally:
        _leave()
    # Skip interpreter finalization: a gloo group still referenced somewhere (a cycle gc has not
    # collected) would be destroyed there, with its threads, and that can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RanksFailed(Exception):
    """A rank raised or died; ``results`` holds what the other ranks returned, by rank."""

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def run_ranks(worker: Callable, world_size: int, *args: Any, deadline_s: float = 240.0) -> list[Any]:
    """``worker(rank, world_size, *args)`` on ``world_size`` spawned ranks; their results in rank
    order. If a rank raises, dies or runs past ``deadline_s`` before every rank has saved its
    result, RanksFailed carries every rank's outcome (its traceback, the signal that ended it, the
    tail of its stderr) and the results of those that returned."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _entry, args=(worker, world_size, tmp, args), nprocs=world_size, join=False, start_method="spawn"
        )
        overdue = _wait_for_every_rank(context.processes, time.monotonic() + deadline_s)
        for path in context.error_files:  # torch's copies of the tracebacks kept above
            if os.path.exists(path):
                os.remove(path)
        results = {}
        for rank in range(world_size):
            if os.path.exists(_path(tmp, rank, "pt")):
                results[rank] = torch.load(_path(tmp, rank, "pt"), weights_only=False)
        # A rank that died after every rank had saved its result died leaving the group (gloo's
        # teardown), not in the work under test: the results stand.
        if len(results) == world_size:
            return [results[rank] for rank in range(world_size)]
        failed = [rank for rank in range(world_size) if rank not in results]
        headline = f"{worker.__name__} on {world_size} ranks: ranks {failed} saved no result"
        if overdue:
            headline = f"{worker.__name__} on {world_size} ranks ran past {deadline_s} s (killed ranks {overdue})"
        reports = [_rank_report(tmp, rank, process, rank in overdue) for rank, process in enumerate(context.processes)]
        raise RanksFailed(headline + "".join(reports), results)


def _wait_for_every_rank(processes: list, end: float) -> list[int]:
    """Wait until every process has ended or ``end`` (monotonic) has passed; kill what is left and
    return those ranks."""
    pending = {process.sentinel: rank for rank, process in enumerate(processes)}
    while pending and (left := end - time.monotonic()) > 0:
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=left):
            del pending[sentinel]
    for rank in pending.values():
        processes[rank].kill()
    for process in processes:
        process.join()
    return sorted(pending.values())


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _read(tmp: str, rank: int, kind: str) -> str:
    path = Path(_path(tmp, rank, kind))
    return path.read_text(errors="replace") if path.exists() else ""


def _rank_report(tmp: str, rank: int, process, overdue: bool) -> str:
    """How one rank ended: its traceback if it raised, its exit, and the tail of its stderr."""
    if overdue:
        ending = "still running at the deadline: killed"
    elif process.exitcode < 0:
        ending = f"terminated with signal {_signal_name(-process.exitcode)}"
    else:
        ending = f"exited with code {process.exitcode}"
    raised = _read(tmp, rank, "traceback").rstrip()
    report = f"\n\n-- rank {rank}: {'raised, then ' if raised else ''}{ending}"
    if raised:
        report += "\n" + raised
    stderr = _read(tmp, rank, "stderr").splitlines()[-STDERR_LINES:]
    if stderr:
        report += f"\n--- rank {rank} stderr (last {STDERR_LINES} lines) ---\n" + "\n".join(stderr)
    return report


class CollectiveCounter:
    """Counts the collectives a rank issues through torch.distributed's Python API."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "barrier")

    def __init__(self) -> None:
        self.calls = 0
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        return counted

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls
