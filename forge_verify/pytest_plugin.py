"""The pytest set-up every run of the claims needs, as a plugin: the hypothesis profile,
the markers, the warning filters, backend skips and the ``device``, ``backend`` and
``rank_pool`` fixtures.

The checkout's ``conftest.py`` loads it for ``make test``; ``forge-verify check`` loads it
with ``-p``, so the properties also run from an installed package, where no conftest is.
"""

import re
from pathlib import Path

import pytest
import torch

import forge_kernels as fk

from .checks.profiles import load_profile
from .distributed.ranks import RankPools
from .distributed.workers import default_workers, threads_per_process

load_profile()

MARKERS = (
    "exactness: bitwise claims (fused == oracle, determinism, invariances)",
    "interpreter: needs the Triton CPU interpreter (skipped when kernels run compiled)",
    "gpu: needs a CUDA GPU (skipped without one)",
    "multigpu: needs two or more CUDA GPUs",
    "distributed: starts several processes in one process group (gloo on the CPU, NCCL on GPUs)",
    "stats: statistical tests with fixed seeds and thresholds derived in advance",
    "mpmath: arbitrary-precision references",
    "slow: long sweeps, left out of the default run (select with -m slow)",
)


def _outside_the_project() -> str:
    """A warning filter's module field matching every file but the project's own. For a
    warning the compiler raises, the module the filter matches (``re.match``, from the
    start) is the compiled file's path without ``.py``; the project's own files are
    ``forge_kernels``'s and ``forge_verify``'s and, in a checkout, its tests, properties and
    benchmarks. Third-party code lies in site-packages or, on the lent GPU machine, wherever
    ``pip install --target`` put it, so the field names what it excludes."""
    here = Path(__file__).parent
    own = {here, Path(fk.__file__).parent}
    if (here.parent / "pyproject.toml").is_file():  # a checkout, not site-packages
        own |= {here.parent / name for name in ("tests", "properties", "benchmarks")}
    own |= {path.resolve() for path in own}
    # ':' separates a filter's fields; '.' matches it as well
    paths = "|".join(sorted(re.escape(str(path)).replace(":", ".") for path in own))
    return rf"(?!({paths})[\\/])"  # no "(?:": its colon would end the field


WARNING_FILTERS = (
    "error",
    "ignore::DeprecationWarning:triton.*",
    # A third-party module compiled from source (no bytecode cache: pip's --no-compile, or
    # PYTHONDONTWRITEBYTECODE) warns of its own invalid string escapes, DeprecationWarning
    # on Python 3.11 and SyntaxWarning from 3.12 (the H200's Python); as errors they made
    # importing it (torchao, through transformers) fail depending on whether a .pyc already
    # existed. The project's own files must compile clean, so there they stay errors.
    f"ignore:invalid escape sequence:DeprecationWarning:{_outside_the_project()}",
    f"ignore:invalid escape sequence:SyntaxWarning:{_outside_the_project()}",
    # torch's autograd thread issues its first cuBLAS call on GPU before a context is current; benign
    "ignore:Attempting to run cuBLAS, but there was no current CUDA context:UserWarning",
)


def _share_cores(config):
    """In a pytest-xdist worker, give torch its share of the usable cores: one torch
    thread pool per core in every worker would oversubscribe them. No bit depends on it:
    the interpreted kernels' sums avoid BLAS (proofs/interpreter_reduction.md,
    tests/test_interpreter_reduction.py)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        torch.set_num_threads(threads_per_process(int(workers)))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (``-p no:xdist``) pytest must not refuse it
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``) takes forge-verify check's worker count."""
    return default_workers()


def pytest_configure(config):
    _share_cores(config)
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    for line in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)


def pytest_report_header(config):
    backend = "Triton interpreter (CPU)" if fk.interpreting() else f"compiled on {torch.cuda.get_device_name()}"
    return f"forge kernels: {backend}"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none on this machine")
    if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if item.get_closest_marker("interpreter") and not fk.interpreting():
        pytest.skip("checks interpreter behaviour; kernels run compiled here")


@pytest.fixture(scope="session")
def device():
    """The device kernel inputs live on: cuda when compiled, cpu under the interpreter."""
    return fk.kernel_device()


@pytest.fixture(scope="session")
def backend():
    """The accumulation backend name used by the tolerance table."""
    return "interpreter" if fk.interpreting() else "gpu"


@pytest.fixture(scope="session")
def rank_pools():
    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def rank_pool(rank_pools):
    """``rank_pool(world_size)``: a live pool of that many ranks; skips where NCCL has
    fewer GPUs than ranks."""
    def get(world_size):
        if rank_pools.backend == "nccl" and torch.cuda.device_count() < world_size:
            pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs; this machine has "
                        f"{torch.cuda.device_count()}")
        return rank_pools.get(world_size)
    return get
