"""The multi-process harness itself: a rank that dies or hangs is reported, with what it printed;
every raising rank's traceback is in the report, whatever it prints dying and whichever rank ends
first; and a rank that dies only while leaving the group, after every rank saved its result, fails
nothing."""

import os
import sys
import time

import pytest
import torch.distributed as dist
from support.multiprocess import RanksFailed, run_ranks


def dies_in_cpp_worker(rank: int, world: int) -> int:
    if rank == 1:
        print("rank 1: about to abort", file=sys.stderr, flush=True)
        os.abort()  # no Python traceback, like gloo's "terminate called without an active exception"
    return rank


def test_a_rank_that_dies_without_a_traceback_is_reported_with_its_stderr():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(dies_in_cpp_worker, 2, deadline_s=60)
    message = str(failed.value)
    assert "SIGABRT" in message and "rank 1: about to abort" in message
    assert 1 not in failed.value.results


def dies_leaving_the_group_worker(rank: int, world: int) -> list[int]:
    if rank == 1:
        dist.destroy_process_group = lambda *args, **kwargs: os.abort()
    return [rank, world]


def test_a_rank_that_dies_leaving_the_group_after_saving_its_result_does_not_fail():
    assert run_ranks(dies_leaving_the_group_worker, 2, deadline_s=60) == [[0, 2], [1, 2]]


def hangs_worker(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def test_a_rank_that_hangs_is_killed_at_the_deadline_and_reported():
    start = time.monotonic()
    # 30 s: rank 0 must start and finish inside the deadline even on a loaded machine (at load 4.5
    # on 2 cores 10 s was not enough to import torch in a spawned rank); rank 1 sleeps 120 s.
    with pytest.raises(RanksFailed, match="ran past 30 s") as failed:
        run_ranks(hangs_worker, 2, deadline_s=30)
    assert time.monotonic() - start < 90
    assert failed.value.results == {0: 0}


def both_raise_worker(rank: int, world: int) -> int:
    if rank == 0:
        raise RuntimeError("rank 0 gives up first")  # reported first: its process ends first
    time.sleep(1.0)
    raise ValueError("rank 1's own error")


def both_ranks_report(worker) -> str:
    """The failure report of ``worker`` on 2 ranks, which must name both ranks' own errors."""
    with pytest.raises(RanksFailed) as failed:
        run_ranks(worker, 2, deadline_s=60)
    message = str(failed.value)
    assert "rank 0 gives up first" in message and "rank 1's own error" in message
    return message


def test_every_raising_ranks_traceback_is_in_the_report_whichever_is_seen_first():
    both_ranks_report(both_raise_worker)


def raises_then_dies_printing_worker(rank: int, world: int) -> int:
    if rank == 0:
        raise RuntimeError("rank 0 gives up first")
    time.sleep(1.0)

    def abort_like_gloo(*args, **kwargs):
        # What gloo prints when it aborts a rank leaving a broken group: a C++ backtrace.
        print("terminate called after throwing an instance of 'gloo::IoException'", file=sys.stderr)
        for frame in range(40):
            print(f"frame #{frame}: <C++ frame>", file=sys.stderr)
        sys.stderr.flush()
        os.abort()

    dist.destroy_process_group = abort_like_gloo
    raise ValueError("rank 1's own error")


def test_a_raising_ranks_traceback_is_in_the_report_whatever_it_prints_dying():
    message = both_ranks_report(raises_then_dies_printing_worker)
    assert "SIGABRT" in message and "frame #39" in message  # how rank 1 ended is reported too
