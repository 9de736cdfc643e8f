"""Exactness must not depend on the shard shape. A config chosen per shard shape (a
different BLOCK_T for the shard than for the whole weight) breaks the layer-level
property wherever BLOCK_T changes bits (forge_verify.numerics.findings: the interpreter);
where it does not (compiled on an H200), the same run shows no difference, as
recorded. The library pins one config, so shards and whole always agree
(test_sharding_exactness.py)."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.problems import Problem
from forge_verify.distributed.sharding import per_shard_config_changes_bits, shape_keyed_config
from forge_verify.numerics import findings

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]


@pytest.mark.parametrize("layout", ["column", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_config_chosen_per_shard_shape_breaks_exactness_where_block_t_matters(layout, dtype, backend, rank_pool):
    problem = Problem(tokens=128, out_features=32, in_features=40, dtype=dtype, steps=1, seed=5)
    # The demonstration needs the shard and the whole to get different token blocks.
    assert shape_keyed_config(32, 40).block_t != shape_keyed_config(16, 40).block_t
    assert shape_keyed_config(32, 40).block_t != shape_keyed_config(32, 20).block_t
    differs = rank_pool(2).run(per_shard_config_changes_bits, problem, fk.AdamW(lr=1e-2), layout)
    expected = findings.BLOCK_T_CHANGES_BITS[(backend, dtype)]
    assert any(differs) == expected, (
        f"per-shard configs {'changed' if any(differs) else 'did not change'} the shards' bits on {backend} "
        f"({dtype}), but forge_verify.numerics.findings records BLOCK_T changing bits: {expected}")
