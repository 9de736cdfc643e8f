"""Position invariance: an element's bits do not depend on where it sits in its tile.

A block of the weight that starts anywhere (inside a tile, at any row and column),
updated on its own with its rows of dy and its columns of x, gets exactly the bits of
the same block of the whole weight's update, under any BLOCK_N and BLOCK_K (and any
BLOCK_T where the backend's finding says the token block does not matter): the weight
gradient and the fused step, in every storage regime. This is the property tensor- and
sequence-parallel sharding rests on (proofs/sharding.md, proofs/interpreter_reduction.md),
checked here without processes, at offsets no sharding layout produces.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe
from forge_verify.numerics import findings

pytestmark = pytest.mark.exactness


@st.composite
def _span(draw, size, unit=1):
    """[start, stop) inside ``size``, non-empty; with ``unit`` > 1 the start is a multiple
    of it and the stop one too or the end (q8 state keeps blocks of 32 columns)."""
    starts = range(0, size, unit)
    start = draw(st.sampled_from(starts))
    stops = sorted({stop for stop in range(start + unit, size, unit)} | {size})
    return start, draw(st.sampled_from(stops))


@given(data=st.data())
def test_block_anywhere_gets_the_bits_of_the_whole(data, device, backend):
    problem = data.draw(fst.problems(max_steps=2, allow_no_tokens=False), label="problem")
    family = data.draw(st.sampled_from(sorted(fst.RULES)), label="family")
    rule = data.draw(fst.RULES[family], label="rule")
    regime = data.draw(fst.regimes(), label="regime")
    config_whole = fst.fit_config(data.draw(fst.tile_configs(), label="config_whole"), regime)
    block_t = config_whole.block_t if findings.BLOCK_T_CHANGES_BITS[(backend, problem.dtype)] else None
    config_slice = fst.fit_config(data.draw(fst.tile_configs(block_t=block_t), label="config_slice"), regime)
    rows = data.draw(_span(problem.out_features), label="rows")
    cols = data.draw(_span(problem.in_features, fk.q8.BLOCK if regime.state_format == "q8" else 1), label="cols")
    claims.slice_invariant(problem, rule, config_whole, config_slice, rows, cols, device, regime=regime)
    observe(0)
