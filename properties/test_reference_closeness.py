"""Closeness: the fused update lies inside the rigorous enclosure of the exact step
(proofs/reference_enclosure.md) in every storage regime, as does the float64 reference;
the share of the proven radius the kernel's result uses is reported."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import RADIUS, observe


@pytest.mark.parametrize("family", sorted(fst.RULES))
@given(data=st.data())
def test_update_inside_proven_enclosure(family, data, device, backend):
    problem = data.draw(fst.problems(max_tokens=64, max_features=40), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    config = data.draw(fst.tile_configs(), label="config")
    regime = data.draw(fst.regimes(), label="regime")
    config = fst.fit_config(config, regime)
    observe(claims.within_enclosure(problem, rule, config, device, backend, regime=regime), RADIUS)
