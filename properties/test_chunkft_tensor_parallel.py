"""ChunkFT under tensor parallelism: every rank plans the chunks on the global shapes and
steps their intersection with its shard (column-parallel rows and bias rows,
row-parallel columns), keyed on global indices: each rank's weights are the unsharded
ChunkFT run's slice, bitwise, after every step (ranks simulated in one process, each
given the operands the tensor-parallel layers deliver), and on 2 gloo ranks with the
collectives in the graph."""

import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.checks import chunkft_shards
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe
from forge_verify.checks.problems import Regime
from forge_verify.distributed import chunkft_jobs

pytestmark = pytest.mark.exactness

# Each example steps world + 1 models over two cycles (about 2 s interpreted): a tenth of
# the profile's examples, at least one (the other sharding properties take a quarter);
# the nightly profile runs 30.
EXAMPLES = max(1, settings.default.max_examples // 10)


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_sharded_chunk_steps_are_the_slices_of_the_unsharded_steps(data):
    regime = data.draw(fst.regimes(), label="regime")
    world = data.draw(st.integers(2, 3), label="world")
    # q8 keeps 32-column blocks: the row-parallel shards are then whole blocks.
    hidden = 32 * world if regime.state_format == "q8" else data.draw(st.integers(world, 9), label="hidden")
    family = data.draw(st.sampled_from(sorted(fst.RULES)), label="family")
    try:
        chunkft_shards.sharded_steps_are_slices_of_unsharded(
            data.draw(fst.RULES[family], label="rule"), regime,
            data.draw(st.sampled_from(("rows", "cols")), label="split"), world,
            data.draw(st.integers(2, 3), label="chunks"), data.draw(st.integers(1, 6), label="inputs"), hidden,
            data.draw(st.integers(1, 6), label="outputs"), data.draw(st.integers(1, 4), label="tokens"),
            data.draw(st.integers(0, 2**31 - 1), label="seed"))
    except ValueError as error:
        # Only a plan with an empty chunk (q8 blocks coarser than the budget) may be refused.
        assert "empty" in str(error), error
        reject()
    observe(0)


@pytest.mark.distributed
# The default tier keeps the case whose bits depend on both the offsets and the rounding
# keys; the fp32 ones are slow only for time.
@pytest.mark.parametrize("regime, split", [
    pytest.param(Regime(), "rows", id="fp32-rows", marks=pytest.mark.slow),
    pytest.param(Regime(), "cols", id="fp32-cols", marks=pytest.mark.slow),
    pytest.param(Regime(weight=torch.bfloat16, state_format="bf16", seed=6), "cols", id="bf16-stochastic-cols")])
def test_tensor_parallel_ranks_with_their_collectives_step_the_unsharded_slices(regime, split, rank_pool):
    """The same claim on 2 gloo ranks, with the collectives in the autograd graph."""
    rank_pool(2).run(chunkft_jobs.tp_layers_are_slices_of_unsharded, fk.AdamW(lr=1e-2, weight_decay=0.1), regime,
                     split, 3)
