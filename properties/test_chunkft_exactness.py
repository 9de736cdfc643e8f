"""ChunkFT exactness: one step of a chunk gives, on the chunk's slices, the bits of the
dense step (every parameter whole) — weight and state, in every storage regime, for
Linear weights through the fused kernel on a row or column range and for Embedding,
LayerNorm, RMSNorm and bias slices — and leaves everything outside the slices bitwise
untouched."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import chunkft
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe

pytestmark = pytest.mark.exactness


@given(data=st.data())
def test_chunk_step_is_the_dense_step_on_its_slices_and_nothing_else_moves(data):
    regime = data.draw(fst.regimes(), label="regime")
    # q8 column cuts fall on 32-column blocks: wide enough layers to cut inside one.
    wide = regime.state_format == "q8"
    # At least 16 tokens a step: with 1 to 3, torch's sum(0) of a column slice gives the
    # whole sum's bits, so a sliced token sum built on it passed. Even so only a draw whose
    # chunk cuts a bias shows it (few do): tests/test_chunkft.py checks token_sum itself
    # and pins such a cut.
    problem = data.draw(st.builds(chunkft.ChunkProblem, vocab=st.integers(3, 10),
                                  width=st.integers(33, 40) if wide else st.integers(1, 10),
                                  hidden=st.integers(33, 40) if wide else st.integers(1, 10),
                                  batch=st.just(2), length=st.integers(8, 12),
                                  seed=st.integers(0, 2**31 - 1)), label="problem")
    family = data.draw(st.sampled_from(sorted(fst.RULES)), label="family")
    rule = data.draw(fst.RULES[family], label="rule")
    split = data.draw(st.sampled_from(("rows", "cols")), label="split")
    chunks = data.draw(st.integers(2, 3), label="chunks")
    chunkft.chunk_step_matches_dense(problem, rule, regime, chunks, split)
    observe(0)
