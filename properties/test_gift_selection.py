"""GIFT's layer selection by range hits (``fk.gift.RangeHitSelection``, jobs in
``forge_verify/distributed/gift_selection_jobs.py``) on 2 gloo ranks through DDP.

Four branches; each rank's inputs span ``SPANS[rank]`` decades of column scale, and so
do the branches' gradients (targetᵀ x). Derived in advance from selection.py's
definition: under current scaling an E4M3 element underflows when its magnitude is
below amax/28672, amax ≈ 4.5 × the largest column's deviation, so the columns below
10^-3.8 of the largest underflow nearly whole: a span of D decades gives a hit rate of
about (D − 3.8)/D. Branch 0: 0.53 on rank 0, 0.24 on rank 1; branch 1: 0.16, 0.42;
branches 2 and 3 (one decade): near 0 (measured afterwards: 0.521, 0.230; 0.168, 0.416;
at most 1 element of 3072; 0.417 and 2 before 551938e, which stopped counting an amax
that lands a rounding above max). Summed, branch 0 leads (0.77 against 0.58) though
rank 1 alone ranks branch 1 first: a selection from rank-local counts would differ
between the ranks, so equal selections show that the counts were all-reduced."""

import pytest
from torch import nn

import forge_kernels as fk
from forge_verify.distributed import gift_selection_jobs

pytestmark = [pytest.mark.distributed]


@pytest.mark.parametrize("count, expected", [(1, [0]), (2, [0, 1])])
def test_the_heavy_tailed_layers_are_selected_alike_on_every_rank(count, expected, rank_pool):
    results = rank_pool(2).run(gift_selection_jobs.range_hit_selection, 13, count)
    (hits_0, elements_0, *_), (hits_1, elements_1, *_) = results
    rate = lambda hits, elements, i: hits[i] / elements[i]  # noqa: E731
    assert rate(hits_0, elements_0, 0) > rate(hits_0, elements_0, 1)  # rank 0 alone: branch 0 first
    assert rate(hits_1, elements_1, 1) > rate(hits_1, elements_1, 0)  # rank 1 alone: branch 1 first
    for rank, (hits, elements, total, selected, on_route, digests, saved) in enumerate(results):
        assert total == [a + b for a, b in zip(hits_0, hits_1)], f"rank {rank}: the counts were not summed"
        assert selected == expected and on_route == expected, (rank, total, selected, on_route)
        assert elements == [3 * 16 * 64] * 4  # three warm-up steps of 16 × 64 gradients, then frozen
        assert sorted((step, index) for step, index, _ in digests) == [(3, i) for i in range(count)]  # joined at 3
    assert results[0][5] == results[1][5]  # the selected layers' factors are equal on both ranks
    assert results[0][6]["selected"] == expected


def test_a_resumed_selection_stands_and_bad_arguments_are_refused():
    layers = [nn.Linear(8, 4) for _ in range(3)]
    saved = {"local_hits": [1, 5, 2], "local_elements": [32] * 3, "total_hits": [1, 5, 2], "selected": [1]}
    selection = fk.gift.RangeHitSelection(layers, 1, 10)
    selection.load_state_dict(saved)
    state = fk.gift.GiftState(None, "e4m3", 4, 5, layers=selection, transform="identity")
    assert state.layers == [layers[1]] and state.route(layers[1].weight) == "gift"
    assert state.route(layers[0].weight) == "plain"
    for arguments, error in (((layers, 0), ValueError), ((layers, 4), ValueError), ((layers, 1, 0), ValueError),
                             ((layers + layers[:1], 1), ValueError), (([nn.Conv1d(2, 2, 1)], 1), TypeError)):
        with pytest.raises(error):
            fk.gift.RangeHitSelection(*arguments)
    with pytest.raises(ValueError, match="fmt='e4m3' or 'e5m2'"):
        fk.gift.GiftState(None, "nvfp4", layers=fk.gift.RangeHitSelection(layers, 1))
    with pytest.raises(ValueError):
        fk.gift.RangeHitSelection(layers, 1, fmt="nvfp4")
