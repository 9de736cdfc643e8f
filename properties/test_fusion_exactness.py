"""The fused update is bitwise the oracle's (materialized dW, same rule, same rounding
streams), for every rule and storage regime (fp32 or bf16 weight and state, stochastic
or nearest bf16 stores), over drawn shapes, tiles, hyperparameters and 1-3 steps, fp32
and bf16 activations, ragged edges and T = 0 included; and it is deterministic."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe

pytestmark = pytest.mark.exactness

FAMILIES = sorted(fst.RULES)


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_fused_equals_oracle(family, data, device):
    problem = data.draw(fst.problems(), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    config = data.draw(fst.tile_configs(), label="config")
    regime = data.draw(fst.regimes(), label="regime")
    config = fst.fit_config(config, regime)
    claims.fused_matches_oracle(problem, rule, config, device, regime=regime)
    observe(0)


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_repeated_call_gives_same_bits(family, data, device):
    problem = data.draw(fst.problems(max_steps=2), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    config = data.draw(fst.tile_configs(), label="config")
    regime = data.draw(fst.regimes(), label="regime")
    config = fst.fit_config(config, regime)
    claims.repeatable(problem, rule, config, device, regime=regime, oracle=data.draw(st.booleans(), label="oracle"))
    observe(0)
