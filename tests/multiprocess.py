"""Run a function on real torch.distributed ranks (gloo, CPU processes) and collect what each returns.

Every process group gets a timeout, and the parent waits with a deadline and kills what is left,
so a test can fail but never hang. Workers are module-level functions (spawn pickles them by
name); each returns a picklable value, saved with torch.save and handed back in rank order.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Every collective gives up after this long (a rank that died leaves the others waiting).
GROUP_TIMEOUT = datetime.timedelta(seconds=30)


def _entry(rank: int, worker: Callable, world_size: int, tmp: str, args: tuple) -> None:
    # The rank's stderr goes to a file the parent quotes if the rank dies without a traceback
    # (gloo aborts from C++, where nothing reaches Python).
    log = open(os.path.join(tmp, f"rank{rank}.stderr"), "w")
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)  # 2-4 ranks share the 2-core machine
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    try:
        try:
            result = worker(rank, world_size, *args)
        except BaseException:
            # Into the rank's stderr file too: the parent reports whichever rank it sees fail
            # first (a peer's broken connection can win that race), and quotes every stderr.
            traceback.print_exc()
            sys.stderr.flush()
            raise
        # Saved under another name and renamed: the parent sees a whole result or none.
        path = os.path.join(tmp, f"rank{rank}.pt")
        torch.save(result, path + ".partial")
        os.replace(path + ".partial", path)
        # Leave together: gloo can abort a rank ("terminate called without an active exception")
        # whose peer tears the group down while it is still connected.
        dist.barrier()
    finally:
        dist.destroy_process_group()
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
    result, RanksFailed carries the failure (with the rank's traceback, or the tail of its stderr
    when it died in C++) and the survivors' results; a raising rank's peers get a grace period."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _entry, args=(worker, world_size, tmp, args), nprocs=world_size, join=False, start_method="spawn"
        )
        end = time.monotonic() + deadline_s
        failure = None
        try:
            while not context.join(timeout=1.0, grace_period=20.0):
                if time.monotonic() > end:
                    failure = TimeoutError(f"{worker.__name__} on {world_size} ranks ran past {deadline_s} s")
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            failure = error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = {}
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if os.path.exists(path):
                results[rank] = torch.load(path, weights_only=False)
        # A failure after every rank has saved its result came from leaving the group (gloo's
        # teardown), not from the work under test: the results stand.
        if failure is not None and len(results) < world_size:
            raise RanksFailed(f"{failure}{_stderr_tails(tmp, world_size)}", results) from failure
        return [results[rank] for rank in range(world_size)]


def _stderr_tails(tmp: str, world_size: int, lines: int = 20) -> str:
    tails = []
    for rank in range(world_size):
        path = os.path.join(tmp, f"rank{rank}.stderr")
        text = open(path).read().splitlines()[-lines:] if os.path.exists(path) else []
        if text:
            tails.append(f"\n--- rank {rank} stderr (last {lines} lines) ---\n" + "\n".join(text))
    return "".join(tails)


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
