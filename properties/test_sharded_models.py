"""Model level, under PyTorch tensor parallelism (and Megatron-style layers): a
two-layer MLP (column then row parallel) and a transformer block with sequence
parallelism train for several steps to the same bits fused and through the oracle.
Against the unsharded model the row-parallel reduction reorders sums with or without
FORGE: the fused model's forward and input gradient are bitwise plain PyTorch TP's,
and with exactly representable data TP and unsharded agree bitwise. The deviation on
ordinary data is measured by ``forge-verify sharding`` (README), not asserted."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.catalog import CATALOG
from forge_verify.checks.problems import Regime
from forge_verify.distributed import sharded_models as sm

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]

WORLD_SIZE = 2
TWO_RULES = [fk.AdamW(lr=1e-2, weight_decay=0.1), fk.SGD(lr=0.05, momentum=0.9, nesterov=True)]
EVERY_FAMILY = [entry.sharding for entry in CATALOG]


@pytest.mark.parametrize("kind, engine, rules", [
    ("mlp", "dtensor", TWO_RULES), ("mlp", "megatron", TWO_RULES), ("block", "dtensor", TWO_RULES[:1]),
], ids=["mlp-dtensor", "mlp-megatron", "block-sp-dtensor"])
def test_fused_model_equals_oracle_model_under_tp(kind, engine, rules, rank_pool):
    rank_pool(WORLD_SIZE).run(sm.fused_equals_oracle, kind, engine, rules, 3)


@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_fused_model_equals_oracle_model_under_tp_in_bf16(engine, rank_pool):
    """bf16 weights, activations and state, stochastic rounding keyed on global indices."""
    regime = Regime(weight=torch.bfloat16, state_format="bf16", rounding="stochastic", seed=21)
    rank_pool(WORLD_SIZE).run(sm.fused_equals_oracle, "mlp", engine, TWO_RULES, 3, 0, regime)


@pytest.mark.parametrize("kind", sm.MODELS, ids=["mlp", "block-sp"])
def test_fused_forward_and_input_gradient_are_plain_tps(kind, rank_pool):
    rank_pool(WORLD_SIZE).run(sm.forward_matches_plain_tp, kind, fk.AdamW(lr=1e-2))


@pytest.mark.parametrize("rule", EVERY_FAMILY, ids=repr)
def test_tp_equals_unsharded_on_exactly_representable_data(rule, rank_pool):
    """Integer weights and inputs, ReLU, a loss whose gradient is a power-of-two multiple
    of integers: every sum is exact in any order, so the all-reduce's reordering vanishes
    and the first step is bitwise the unsharded one, fused and plain. (The rule's own
    rounding then leaves the representable set, so later steps are not claimed.)"""
    for rank, result in enumerate(rank_pool(WORLD_SIZE).run(sm.deviation_from_unsharded, "mlp", rule, 1, 0, True)):
        assert result == {"fused": [0], "plain": [0]}, f"rank {rank}: largest ulp distance per step {result}"
