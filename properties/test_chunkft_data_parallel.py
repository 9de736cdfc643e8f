"""ChunkFT under data parallelism (2 gloo ranks): the active slices' gradients are
averaged over the ranks (forge_verify/distributed/chunkft_jobs.py says why each claim
is exact, proofs/chunkft.md §5 derives it)."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.catalog import CATALOG
from forge_verify.checks.chunkft import ChunkProblem
from forge_verify.checks.problems import Regime
from forge_verify.distributed import chunkft_jobs as jobs

pytestmark = [pytest.mark.exactness, pytest.mark.distributed]

WORLD_SIZE = 2
FP32, BF16, Q8 = Regime(), Regime(weight=torch.bfloat16, state_format="bf16", seed=3), Regime(state_format="q8", seed=5)


# The default tier keeps two cases (about 5 s); the other two are slow only for time.
@pytest.mark.parametrize("regime, split", [
    pytest.param(FP32, "rows", id="fp32-rows", marks=pytest.mark.slow), pytest.param(FP32, "cols", id="fp32-cols"),
    pytest.param(BF16, "rows", id="bf16-stochastic-rows"),
    pytest.param(Q8, "cols", id="q8-cols", marks=pytest.mark.slow)])
def test_equal_data_on_every_rank_is_the_single_process_step_bitwise(regime, split, rank_pool):
    wide = regime.state_format == "q8"  # q8 column cuts fall on 32-column blocks
    problem = ChunkProblem(vocab=5, width=40 if wide else 6, hidden=36 if wide else 7, batch=1, length=3, seed=11)
    # The bf16 case runs DP on the host store with prefetch: the options compose.
    dp_options = dict(state_store="host", prefetch=True) if regime is BF16 else None
    for rank, wire in enumerate(rank_pool(WORLD_SIZE).run(jobs.equal_data_is_the_single_process_step, problem,
                                                         fk.AdamW(lr=1e-2, weight_decay=0.1), regime, 3, split, 4,
                                                         dp_options)):
        # Only the active chunk's local slices cross the wire, as fp32.
        for sent, announced, elements in wire:
            assert sent == announced == 4 * elements, (rank, wire)


@pytest.mark.slow  # one rule family per case, about 1 s each
@pytest.mark.parametrize("family", [entry.name for entry in CATALOG])
def test_equal_data_is_the_single_process_step_for_every_rule_family(family, rank_pool):
    rule = next(entry.sharding for entry in CATALOG if entry.name == family)
    problem = ChunkProblem(vocab=5, width=6, hidden=7, batch=1, length=3, seed=12)
    rank_pool(WORLD_SIZE).run(jobs.equal_data_is_the_single_process_step, problem, rule, BF16, 3, "cols", 4,
                              dict(state_store="host", prefetch=True))


@pytest.mark.parametrize("split", ["rows", "cols"])
def test_split_dyadic_batches_are_the_concatenated_step_bitwise(split, rank_pool):
    for rank, result in enumerate(rank_pool(WORLD_SIZE).run(jobs.dyadic_split_is_the_concatenated_step, 3, split, 4)):
        assert result["dp_vs_concatenated"] == 0, (rank, result)
        assert result["alone_vs_concatenated"] > 0, (rank, result)  # the reduction is what makes it so


def test_split_generic_batches_leave_every_rank_with_the_same_bits(rank_pool):
    problem = ChunkProblem(vocab=6, width=5, hidden=7, batch=WORLD_SIZE, length=4, seed=21)
    results = rank_pool(WORLD_SIZE).run(jobs.split_batch_deviation, problem, fk.AdamW(lr=1e-2), 3, "rows", 6)
    assert all(r["digest"] == results[0]["digest"] for r in results)
    # Measured, not bounded: the DP sum (each rank's tokens, then the ranks) is another
    # order than the whole batch's (README's ChunkFT section records the figures).
    print(f"DP vs one process on the whole batch: {results[0]['max_ulp']} ulp max, "
          f"relative {results[0]['relative']:.2e}")


def test_ranks_configured_differently_or_with_other_weights_are_refused_on_every_rank(rank_pool):
    """Each refusal names what differs, on every rank; a rank that refuses its own model
    makes the others refuse too, naming it, instead of leaving them in a collective."""
    differently = "configured differently on ranks [1] than on rank 0 of the process group: "
    for rank, errors in enumerate(rank_pool(WORLD_SIZE).run(jobs.differing_setups_are_refused)):
        expected = {"chunks": differently + "['chunks', 'plan'] differ",
                    "lr": differently + "['lr'] differ",
                    "weight_decay": differently + "['rule'] differ",
                    "rounding": differently + "['rounding'] differ",
                    "weights": "needs the same weights on every rank; ['embed.weight',",
                    "permuted": "needs the same weights on every rank; ['embed.weight'] differ",
                    "local": ("ChunkFT cannot train these parameters: 'rms.weight' (torch.float64" if rank == 1 else
                              "ChunkFT was refused on ranks [1] of the process group (ValueError: ChunkFT cannot "
                              "train these parameters: 'rms.weight'")}
        for case, text in expected.items():
            assert errors[case] is not None and text in errors[case], (rank, case, errors[case])
