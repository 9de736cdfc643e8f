"""Jobs for GIFT on FORGE's materialized data-parallel path
(``fk.gift.GiftSplitReducer`` as ``reduce=`` of ``materialized_split_step``), compared in
``properties/test_gift_split_step.py``."""

import torch
import torch.distributed as dist

import forge_kernels as fk
from forge_kernels.token_split import materialized_split_step

from ..numerics.bits import assert_bitwise_equal
from ..numerics.gift_bounds import e4m3_sum_bound
from . import token_split_controls as tc

BUCKET_ROWS = 8


def identity_codec_equals_all_reduce(transform: str, exchange: str):
    """AdamW through ``materialized_split_step`` (3 buckets of rows) on small-integer data,
    the bucket sums through GiftSplitReducer("fp32") on the plain route or the GIFT route
    with T = I, against the default fp32 all-reduce: weight and state bit for bit."""
    weight, ((x, dy),) = tc.problem(seed=5, dyadic=True)
    parts, group = tc.parts_of("data", x, dy)
    rule = fk.AdamW(lr=1e-2)
    whitening = fk.gift.Whitening.identity(weight.shape[1]) if transform == "identity" else None
    reducer = fk.gift.GiftSplitReducer("fp32", group, whitening=whitening, exchange=exchange)
    results = []
    for reduce in (reducer, None):
        w, state = weight.clone(), rule.init_state(weight)
        materialized_split_step(parts, w, state, rule, 1, group=group, bucket_rows=BUCKET_ROWS, reduce=reduce)
        results.append((w, state))
    (w_a, s_a), (w_b, s_b) = results
    assert_bitwise_equal(w_a, w_b, f"rank {dist.get_rank()}: weight")
    for key in s_a:
        assert_bitwise_equal(s_a[key], s_b[key], f"rank {dist.get_rank()}: state {key}")
    return dict(reducer.wire_bytes), dict(reducer.received_bytes)


def e4m3_sums_within_the_bound(route: str, exchange: str, rank: int = 8):
    """The bucket sums through GiftSplitReducer("e4m3", no error feedback) on Gaussian
    data, the transform from the step's inputs (``refresh``) or none: per bucket,
    (‖out − Σ_r G_r‖_F, the bound of ``e4m3_sum_bound``, ‖Σ_r G_r‖_F); and the bytes
    this rank passed into GIFT's collectives, by kind."""
    weight, ((x, dy),) = tc.problem(seed=6)
    parts, group = tc.parts_of("data", x, dy)
    reducer = fk.gift.GiftSplitReducer("e4m3", group, rank=rank, error_feedback=False, exchange=exchange)
    if route == "gift":
        reducer.refresh(parts)
    world = dist.get_world_size()
    measured = []

    def recording(grad, group, rows):
        given = grad.clone()
        out = reducer(grad, group, rows)
        y = reducer.whitening.apply(given) if reducer.whitening is not None else given
        amax = y.abs().amax().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        norms = torch.tensor([[float(y.norm()), float(given.norm())]], dtype=torch.float64)
        everyone = [torch.empty_like(norms) for _ in range(world)]
        dist.all_gather(everyone, norms, group=group)
        exact = given.double()
        dist.all_reduce(exact, group=group)
        norms = torch.cat(everyone)
        bound = e4m3_sum_bound(reducer.whitening, norms[:, 0].tolist(), norms[:, 1].tolist(),
                               float(fk.gift.e4m3.scale_for(amax[0])), given.numel(), exchange)
        measured.append((float((out.double() - exact).norm()), bound, float(exact.norm())))
        return out

    rule = fk.SGD(lr=1e-2)
    materialized_split_step(parts, weight.clone(), rule.init_state(weight), rule, 1, group=group,
                            bucket_rows=BUCKET_ROWS, reduce=recording)
    return measured, dict(reducer.wire_bytes), dict(reducer.received_bytes)


def resumed_reducer_continues(steps: int = 4, saved_after: int = 2):
    """AdamW through ``materialized_split_step`` with GiftSplitReducer("e4m3", error
    feedback, the transform refreshed from every step's inputs), ``steps`` steps on
    Gaussian data in one go, against a run whose reducer is saved after ``saved_after``
    steps and loaded into a fresh one: the final weights (both runs')."""
    weight, batches = tc.problem(seed=8, steps=steps)
    rule = fk.AdamW(lr=1e-2)

    def run(reducer_for_step):
        w, state = weight.clone(), rule.init_state(weight)
        for step, (x, dy) in enumerate(batches, start=1):
            parts, group = tc.parts_of("data", x, dy)
            reducer = reducer_for_step(step, group)
            reducer.refresh(parts)
            materialized_split_step(parts, w, state, rule, step, group=group, bucket_rows=BUCKET_ROWS,
                                    reduce=reducer)
        return w

    whole = {}
    w_whole = run(lambda step, group: whole.setdefault("r", fk.gift.GiftSplitReducer("e4m3", group, rank=8)))
    held = {}

    def resumed(step, group):
        if step == saved_after + 1:  # a fresh reducer from the saved state
            saved = held["r"].state_dict()
            held["r"] = fk.gift.GiftSplitReducer("e4m3", group, rank=8)
            held["r"].load_state_dict(saved)
        return held.setdefault("r", fk.gift.GiftSplitReducer("e4m3", group, rank=8))

    return w_whole, run(resumed)
