"""Layer level, on a real process group: a column-, row- or sequence-parallel fused
layer (PyTorch tensor parallelism on DTensors, or Megatron-style explicit collectives)
steps its shard to exactly the matching slice of the unsharded fused layer's weight
and state, bitwise, for every rule, over several steps (proofs/sharding.md). In the
bf16 regimes too: stochastic rounding is keyed on the global element index."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from forge_verify.checks import strategies as fst
from forge_verify.checks.catalog import CATALOG
from forge_verify.checks.problems import Problem
from forge_verify.distributed.sharding import SHARDINGS, LayerCase, layers_match_slice

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]

FAMILIES = sorted(fst.RULES)
# A quarter of the profile's examples keeps the multi-process tier inside its CI budget
# (an interpreted launch costs ~0.16 s). No shrinking: a failing job takes its ranks
# down, so every shrink attempt would start a new pool; the first failing example is
# reported as drawn.
EXAMPLES = max(2, settings.default.max_examples // 4)
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
WORLD_SIZE = 2


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=EXAMPLES, phases=PHASES)
@given(data=st.data())
def test_sharded_update_equals_slice_of_unsharded(family, data, rank_pool):
    """fp32 regime, drawn shapes (uneven row shards), tiles, activations and 1-3 steps."""
    problem = data.draw(fst.sharded_problems(WORLD_SIZE), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    config = data.draw(fst.tile_configs(), label="config")
    sharding = data.draw(st.sampled_from(SHARDINGS), label="sharding")
    rank_pool(WORLD_SIZE).run(layers_match_slice, LayerCase(problem, config=config), [rule], [sharding])


@settings(max_examples=EXAMPLES, phases=PHASES)
@given(data=st.data())
def test_sharded_update_equals_slice_in_low_precision_regimes(data, rank_pool):
    """bf16 weights or state (stochastic or nearest rounding) and q8 state: each element's
    rounding is keyed on its index in the global weight, so the shard rounds as the whole."""
    regime = data.draw(fst.regimes(), label="regime")
    problem = data.draw(fst.sharded_problems(WORLD_SIZE, max_steps=2, q8_state=regime.state_format == "q8"),
                        label="problem")
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    rule = data.draw(fst.RULES[family], label="rule")
    config = fst.fit_config(data.draw(fst.tile_configs(), label="config"), regime)
    sharding = data.draw(st.sampled_from(SHARDINGS), label="sharding")
    rank_pool(WORLD_SIZE).run(layers_match_slice, LayerCase(problem, regime, config), [rule], [sharding])


FIXED_PROBLEM = Problem(tokens=8, out_features=10, in_features=8, dtype=torch.float32, steps=2, seed=11)
ONE_RULE_PER_FAMILY = [entry.sharding for entry in CATALOG]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_sharding_and_rule_on_1_2_and_4_ranks(world_size, rank_pool):
    """Every engine and layout, one rule of every family, on one fixed small problem with
    uneven row shards, two steps, on 1, 2 and 4 ranks (the drawn properties above vary
    everything else on 2)."""
    rank_pool(world_size).run(layers_match_slice, LayerCase(FIXED_PROBLEM), ONE_RULE_PER_FAMILY, timeout_s=300)
