"""Negative controls: a step whose tokens are split across ranks (data, context
parallelism) or micro-batches (accumulation). A fused step per part is not the step
(its distance is measured by ``forge-verify sharding``); the two alternatives of
forge_kernels.token_split take the true step: the linear decomposition is exact when
every sum is (dyadic data) and otherwise differs by reassociation only (measured);
the bucketed materialized step has the bits of the standard pipeline."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.problems import Regime
from forge_verify.distributed import token_split_controls as tc

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]

WORLD_SIZE = 2


@pytest.mark.parametrize("split", tc.SPLITS)
def test_split_steps_on_dyadic_data(split, rank_pool):
    """Small-integer data, power-of-two SGD scalars: every sum is exact, so the linear
    decomposition and the materialized step give the true step's bits, and the naive
    fused step per part does not."""
    rule = fk.SGD(lr=2**-4, momentum=0.5, weight_decay=2**-3)
    for rank, result in enumerate(rank_pool(WORLD_SIZE).run(tc.split_step_deviation, split, rule, 1, 0, True)):
        assert result["linear"]["max_ulp"] == 0 and result["materialized"]["max_ulp"] == 0, (rank, result)
        assert result["naive"]["max_ulp"] > 0, (rank, result)


@pytest.mark.parametrize("split", tc.SPLITS)
@pytest.mark.parametrize("regime", [Regime(), Regime(weight=torch.bfloat16, state_format="bf16", seed=9)],
                         ids=["fp32", "bf16-stochastic"])
def test_bucketed_materialized_step_equals_standard_pipeline(split, regime, rank_pool):
    rank_pool(WORLD_SIZE).run(tc.bucketed_equals_standard_pipeline, split, fk.AdamW(lr=1e-2), 5, regime)


@pytest.mark.parametrize("method, fault", [("linear", "nan"), ("linear", "shape"), ("materialized", "nan"),
                                           ("materialized", "shape"), ("materialized", "seed")])
def test_a_part_refused_on_one_rank_is_refused_on_every_rank_and_writes_nothing(method, fault, rank_pool):
    """Rank 1 alone holds a bad part or argument: it raises its own error, rank 0 one
    naming rank 1 (it had waited in the reduction for a rank that raised alone, or stepped
    its first bucket before rank 1 refused the seed), and neither writes."""
    own = {"nan": "NonFiniteInputError: ", "shape": "but x has 31 input features",
           "seed": "seed must be an integer in [0, 2**63)"}[fault]
    errors = rank_pool(WORLD_SIZE).run(tc.one_rank_refused, method, fault)
    (error0, changed0), (error1, changed1) = errors
    assert error1 is not None and own in error1, error1
    assert error0 is not None and f"{method}_split_step was refused on ranks [1] of the process group" in error0, error0
    assert not changed0 and not changed1
