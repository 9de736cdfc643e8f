"""How many processes a run of the claims takes, and how many torch threads each: one
place for the policy that ``forge-verify check``, ``make test`` (pytest-xdist's
``-n auto``) and the rank pools share."""

import os

import forge_kernels as fk


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers() -> int:
    """Processes to run tests or properties in: one per usable core (the interpreter is
    single-threaded Python; compiled, each worker compiles its own kernels), at most 8 on
    a GPU machine, where every worker also holds a CUDA context."""
    cores = usable_cores()
    return cores if fk.interpreting() else min(cores, 8)


def threads_per_process(processes: int) -> int:
    """torch threads for each of ``processes`` that share the usable cores."""
    return max(1, usable_cores() // processes)
