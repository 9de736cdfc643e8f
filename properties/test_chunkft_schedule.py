"""ChunkFT's schedule: chunk (t // switch_every) mod chunks at step t (a permutation per
cycle with order="random"), each chunk's visits and its slices' step counts, and a
checkpoint taken at any step, mid-cycle included, resumes bit for bit."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forge_verify.checks import chunkft
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe

pytestmark = pytest.mark.exactness


@given(data=st.data())
def test_schedule_step_counts_and_resume_mid_cycle(data):
    regime = data.draw(fst.regimes(), label="regime")
    wide = regime.state_format == "q8"
    problem = data.draw(st.builds(chunkft.ChunkProblem, vocab=st.integers(3, 8),
                                  width=st.just(40) if wide else st.integers(2, 8),
                                  hidden=st.just(36) if wide else st.integers(2, 8),
                                  batch=st.just(1), length=st.integers(1, 3),
                                  seed=st.integers(0, 2**31 - 1)), label="problem")
    rule = data.draw(fst.RULES[data.draw(st.sampled_from(sorted(fst.RULES)), label="family")], label="rule")
    chunks = data.draw(st.integers(1, 3), label="chunks")
    switch_every = data.draw(st.integers(1, 2), label="switch_every")
    steps = data.draw(st.integers(1, 6), label="steps")
    resume_at = data.draw(st.integers(0, steps), label="resume_at")
    chunkft.schedule_and_resume(problem, rule, regime, chunks, switch_every,
                                data.draw(st.sampled_from(("rows", "cols")), label="split"), steps, resume_at,
                                order=data.draw(st.sampled_from(("cyclic", "random")), label="order"))
    observe(0)
