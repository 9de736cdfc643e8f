"""N ranks on one machine, for the sharding properties.

``RankPool(world_size)`` starts the ranks once through ``torch.multiprocessing``
(spawn), each joined into one process group (gloo on the CPU, NCCL with one GPU per
rank), and then runs jobs on all of them: ``pool.run(fn, *args)`` calls
``fn(*args)`` on every rank and returns the list of their results. Keeping the ranks
alive between jobs is what lets a hypothesis property afford many examples: a rank
start (importing torch and Triton) costs seconds, a job milliseconds.

Nothing can collide between concurrent runs: the ranks meet through a ``FileStore``
in a fresh temporary directory, not a TCP port, and gloo and NCCL bind their own
connections to ports the OS picks. Nothing can hang: every collective has the
process group's timeout, every wait in the parent has a deadline, and a rank that
raises or dies fails the job with its traceback (or exit code) and takes the pool
down, so its peers, possibly blocked in a collective, are terminated, not waited on.
"""

import datetime
import io
import os
import queue
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported before any job so that a rank decides where kernels run (compiled or the
# CPU interpreter) before any Triton code is decorated, as the parent did.
import forge_kernels  # noqa: F401

from .workers import threads_per_process

# NVLink multicast (NVLS, symmetric-memory multicast) stays off on the GPU machines
# these ranks run on.
RANK_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
COLLECTIVE_TIMEOUT_S = 60.0
START_TIMEOUT_S = 180.0
JOB_TIMEOUT_S = 120.0
_READY = "ready"


class RankError(AssertionError):
    """A rank raised, died or did not answer in time; the message holds its traceback."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _serialize(value) -> bytes:
    # Bytes, not tensors, cross the queue: no shared-memory handles outlive the job.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rank_main(rank, world_size, store_path, backend, collective_timeout_s, start_timeout_s, jobs, results):
    os.environ.update(RANK_ENVIRONMENT)
    # The ranks share the machine's cores; each taking all of them would oversubscribe.
    torch.set_num_threads(threads_per_process(world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        # Spawned ranks start seconds apart on a loaded machine; the group's connection waits
        # with the collective timeout, so wait for every rank first, within the start's.
        store.set_timeout(datetime.timedelta(seconds=start_timeout_s))
        store.set(f"arrived/{rank}", "1")
        store.wait([f"arrived/{r}" for r in range(world_size)])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    except BaseException:
        results.put((rank, _READY, False, traceback.format_exc()))
        return
    results.put((rank, _READY, True, None))
    while True:
        job = jobs[rank].get()
        if job is None:
            break
        job_id, fn, args = job
        try:
            results.put((rank, job_id, True, _serialize(fn(*args))))
        except BaseException:
            results.put((rank, job_id, False, traceback.format_exc()))
    dist.destroy_process_group()
    # Every answer is in the parent's hands (it asked this rank to stop after reading them);
    # leave without the interpreter's teardown of torch and Triton, which was most of a
    # pool's shutdown (tests/test_distributed_harness.py::test_stopped_ranks_leave_at_once).
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``world_size`` ranks in one process group, kept alive to run jobs.

    ``backend`` defaults to NCCL when CUDA is available (rank r on GPU r), else gloo.
    """

    def __init__(self, world_size: int, backend: str | None = None, *,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self.backend = backend or default_backend()
        if self.backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"NCCL with {world_size} ranks needs {world_size} GPUs; "
                             f"this machine has {torch.cuda.device_count()}")
        self._tmp = tempfile.TemporaryDirectory(prefix="forge-ranks-")
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._next_job = 0
        self._processes = mp.start_processes(
            _rank_main, args=(world_size, os.path.join(self._tmp.name, "store"), self.backend,
                              collective_timeout_s, start_timeout_s, self._jobs, self._results),
            nprocs=world_size, join=False, start_method="spawn").processes
        self._collect(_READY, start_timeout_s, "start")

    @property
    def alive(self) -> bool:
        return self._processes is not None

    def run(self, fn, *args, timeout_s: float = JOB_TIMEOUT_S) -> list:
        """``fn(*args)`` on every rank (``fn`` importable by name); the ranks' return values."""
        if not self.alive:
            raise RuntimeError("this RankPool was closed (or a job failed and took it down)")
        self._next_job += 1
        job_id = self._next_job
        for jobs in self._jobs:
            jobs.put((job_id, fn, args))
        payloads = self._collect(job_id, timeout_s, f"{getattr(fn, '__qualname__', fn)}")
        return [torch.load(io.BytesIO(p), weights_only=False) for p in payloads]

    def _collect(self, job_id, timeout_s, what):
        answers = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            try:
                rank, answered, ok, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                self._check_alive(what)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(answers))
                    self.close(wait_s=0)
                    raise RankError(f"{what}: ranks {missing} of {self.world_size} did not answer within "
                                    f"{timeout_s:.0f} s (the ranks were terminated)")
                continue
            # Answers belong to this job: a failed job takes the pool down with it.
            assert answered == job_id, (answered, job_id)
            if not ok:
                self.close(wait_s=0)
                raise RankError(f"{what}: rank {rank} of {self.world_size} raised (the ranks were "
                                f"terminated):\n{payload}")
            answers[rank] = payload
        return [answers[r] for r in range(self.world_size)]

    def _check_alive(self, what):
        dead = [(r, p.exitcode) for r, p in enumerate(self._processes) if p.exitcode is not None]
        if dead:
            self.close(wait_s=0)
            raise RankError(f"{what}: rank {dead[0][0]} of {self.world_size} died with exit code {dead[0][1]} "
                            "(the other ranks were terminated)")

    def request_stop(self):
        """Ask every live rank to leave after its current job (close() then reaps them)."""
        for jobs, process in zip(self._jobs, self._processes or ()):
            if process.is_alive():
                jobs.put(None)

    def close(self, wait_s: float = 10.0):
        """Stop the ranks: ask them to leave, wait up to ``wait_s``, then terminate the
        rest (after a failure at once: the others may be blocked in a collective)."""
        if self._processes is None:
            return
        self.request_stop()
        processes, self._processes = self._processes, None
        deadline = time.monotonic() + wait_s
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
        self._results.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RankPools:
    """One live RankPool per world size, started on first use and started again after
    a failure took it down (the pytest fixture ``rank_pool`` hands them out)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend or default_backend()
        self._pools = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, self.backend)
        return pool

    def close(self):
        # All pools wind down together rather than one after the other.
        for pool in self._pools.values():
            pool.request_stop()
        for pool in self._pools.values():
            pool.close(wait_s=3.0)
        self._pools.clear()
