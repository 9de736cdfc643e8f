"""Shared pytest set-up for tests/ and properties/: hypothesis profile, backend
markers and the device fixture."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.distributed import RankPools
from forge_verify.hypothesis_profiles import load_profile

load_profile()


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
