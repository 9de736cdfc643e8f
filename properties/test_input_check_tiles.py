"""Without the input scan (``input_check="tiles"``) a non-finite input fails exactly the
tiles whose sums it reaches.

Claim (proofs/input_check_tiles.md): for one NaN or infinite element of x (dy), the
fused step and its oracle name exactly the epilogue parts whose columns (rows) hold it,
leave those parts' weight and state bits as they were, give every other part the bits
of the same step on clean inputs, and store nothing non-finite; in every rule family,
storage regime and tile config, with the other operand's row at that token zero (the
products are then 0 * inf = NaN) or not.
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("family", sorted(fst.RULES))
@given(data=st.data())
def test_a_non_finite_input_fails_exactly_the_tiles_it_reaches(family, data, device):
    problem = data.draw(fst.problems(max_steps=1, allow_no_tokens=False), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    regime = data.draw(fst.regimes(), label="regime")
    config = fst.fit_config(data.draw(fst.tile_configs(), label="config"), regime)
    where = data.draw(st.sampled_from(("x", "dy")), label="input")
    size = problem.in_features if where == "x" else problem.out_features
    bad = (where, data.draw(st.integers(0, problem.tokens - 1), label="token"),
           data.draw(st.integers(0, size - 1), label="index"),
           data.draw(st.sampled_from((math.nan, math.inf, -math.inf)), label="value"),
           data.draw(st.booleans(), label="other row zero"))
    oracle = data.draw(st.booleans(), label="oracle")
    claims.non_finite_input_fails_reached_tiles(problem, rule, config, device, bad, regime=regime, oracle=oracle)
    observe(0)
