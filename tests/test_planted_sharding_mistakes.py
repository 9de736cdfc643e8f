"""The sharding property can fail: a Megatron-style shard whose stochastic rounding is
keyed on its local element indices (no WeightSlice) is caught, with a message naming
the rank, the layout and the first differing element."""

import pytest
import torch

import forge_kernels as fk
import forge_kernels.parallel_linear as parallel_linear
from forge_verify.checks.problems import Problem, Regime
from forge_verify.distributed.sharding import LayerCase, layers_match_slice

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]


def _without_weight_slices(case, rules, shardings):
    """Job: the property, with the parallel layers built as if shards were whole weights."""
    planted = parallel_linear.WeightSlice
    parallel_linear.WeightSlice = lambda row_start, col_start, global_shape: None
    try:
        layers_match_slice(case, rules, shardings)
    except AssertionError as error:
        return str(error)
    finally:
        parallel_linear.WeightSlice = planted
    return None


# Column shards of rank 0 start at row 0 with the whole row length, where local and
# global indices coincide; every other shard is caught.
@pytest.mark.parametrize("layout, caught_ranks", [("column", [1]), ("row", [0, 1])])
def test_shard_keyed_on_local_indices_is_caught(layout, caught_ranks, rank_pool):
    problem = Problem(tokens=8, out_features=16, in_features=16, dtype=torch.float32, steps=1, seed=2)
    case = LayerCase(problem, Regime(weight=torch.bfloat16, state_format="bf16", rounding="stochastic", seed=4))
    errors = rank_pool(2).run(_without_weight_slices, case, [fk.AdamW(lr=1e-2)], [("megatron", layout)])
    assert [rank for rank, error in enumerate(errors) if error] == caught_ranks, errors
    for rank in caught_ranks:
        assert f"rank {rank} of 2, megatron {layout}, step 1" in errors[rank] and "differ bitwise" in errors[rank]
