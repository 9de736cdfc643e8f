"""The rank harness: jobs run on every rank of a real process group; a rank that
raises, dies, blocks in a collective or overruns its deadline fails the job with
its traceback, promptly, and never hangs the test run."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from forge_verify.distributed.ranks import RankError, RankPool
from forge_verify.distributed.sharding import device

pytestmark = pytest.mark.distributed


def _rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0], device=device())
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: its peer never joins


def _rank_one_skips_the_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def _exit_abruptly():
    os._exit(3)


def _sleep(seconds):
    time.sleep(seconds)


def test_job_runs_on_every_rank_in_one_group(rank_pool):
    assert rank_pool(2).run(_rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_raising_rank_fails_the_job_with_its_traceback_while_its_peer_waits():
    with RankPool(2, "gloo") as pool:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"(?s)rank 1 of 2 raised.*ValueError: planted failure on rank 1"):
            pool.run(_rank_one_raises)
        assert time.monotonic() - start < 20
        assert not pool.alive


def test_collective_without_its_peer_times_out():
    with RankPool(2, "gloo", collective_timeout_s=2) as pool:
        with pytest.raises(RankError, match=r"(?s)rank 0 of 2 raised.*(Timed out|timed out|Timeout)"):
            pool.run(_rank_one_skips_the_collective, timeout_s=60)


def test_dead_rank_fails_the_job():
    with RankPool(1, "gloo") as pool:
        with pytest.raises(RankError, match="died with exit code 3"):
            pool.run(_exit_abruptly)


def test_job_past_its_deadline_fails_and_stops_the_ranks():
    with RankPool(1, "gloo") as pool:
        with pytest.raises(RankError, match=r"ranks \[0\] of 1 did not answer within 1 s"):
            pool.run(_sleep, 60, timeout_s=1)
        assert not pool.alive


def test_stopped_ranks_leave_at_once():
    """Ranks asked to stop leave as soon as they have left their group, without the
    interpreter's teardown (seconds on the CPU, more with NCCL): within a second, not
    terminated after the close's wait."""
    pool = RankPool(2, "gloo")
    pool.run(_rank_and_sum)
    processes = list(pool._processes)
    start = time.monotonic()
    pool.close(wait_s=30)
    assert time.monotonic() - start < 1.0
    assert [p.exitcode for p in processes] == [0, 0]


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="positive integer"):
        RankPool(0)
