"""DDP training of the tiny GPT on 2 gloo ranks, 400 AdamW steps, every gradient on the
wire as E4M3 through ``fk.gift.gift_hook`` (error feedback on): with the MLP output
layers (fc2) whitened, and plain, on the default (reduce-scatter) exchange, against DDP's
fp32 all-reduce. The statistic is the mean training loss over the last 100 steps.

No bound on that difference is derived (proofs/gift.md, section 9: none exists for 400
steps of a nonconvex model), so the test does not claim one. What it checks, by rules
fixed before their numbers were seen:

* *It learned*: every run's tail is below the corpus's character bigram conditional
  entropy (computed here from the corpus, 1.98 nats), the least expected loss of any
  predictor that sees one character of context (Gibbs' inequality); the tail's sampling
  noise is about 0.012.
* *The format costs no more than a reseed*: GIFT's and plain E4M3's tails differ from
  the fp32 run's (seed 0) by no more than the farthest of three reseeded fp32 runs
  (seeds 4, 5, 6; a seed sets the initial weights and the batches) differs from it.

This is a comparison on fixed seeds, not a calibrated statistical test: it fails when
the format moves the tail further than a reseed does, which a bias of that size would.
History: a tolerance of 0.01 was first chosen after seeing seed 0's tails (fp32 1.2124,
GIFT 1.2055, plain 1.2086; all-gather 1.2084, 1.2093); it had no derivation and is
replaced by the rule above. fp32 tails of seeds 1-3 were known then too (1.2313, 1.2204,
1.1796, README), so the reseeds are 4-6, first run after the rule was fixed (their tails:
proofs/gift.md, section 9). On this model plain FP8 does *not* drift measurably, so this
shows GIFT costs nothing here, not that it repairs anything."""

import math
from collections import Counter

import pytest

from forge_verify.distributed import gift_jobs
from forge_verify.models import corpus

pytestmark = [pytest.mark.distributed, pytest.mark.stats]

STEPS = 400
RESEEDS = (4, 5, 6)


def _tail(losses):
    return sum(losses[-100:]) / 100


def _bigram_entropy(text: str) -> float:
    """H(next character | current one) of ``text``, in nats."""
    pairs, firsts, n = Counter(zip(text, text[1:])), Counter(text[:-1]), len(text) - 1
    return -sum(count / n * math.log(count / firsts[a]) for (a, _), count in pairs.items())


def test_gift_and_plain_e4m3_track_fp32_communication(rank_pool):
    pool = rank_pool(2)

    def tail(seed, fmt, selection):
        return _tail(pool.run(gift_jobs.tiny_gpt_losses, seed, fmt, selection, STEPS, timeout_s=300)[0])

    run = {"fp32": tail(0, "fp32-allreduce", "none"), "gift": tail(0, "e4m3", "fc2"),
           "plain": tail(0, "e4m3", "none")}
    reseeded = [tail(seed, "fp32-allreduce", "none") for seed in RESEEDS]
    bigram = _bigram_entropy(corpus.load())
    assert all(value < bigram for value in [*run.values(), *reseeded]), (run, reseeded, bigram)
    spread = max(abs(value - run["fp32"]) for value in reseeded)
    assert abs(run["gift"] - run["fp32"]) <= spread, (run, reseeded)
    assert abs(run["plain"] - run["fp32"]) <= spread, (run, reseeded)
