"""Negative controls: steps whose tokens are split across ranks (data parallelism,
context parallelism) or micro-batches (gradient accumulation). Rank jobs that
measure how far a naive fused step per part lands from the true step (one fused
step over every token), and how far the two alternatives of
``forge_kernels.token_split`` land."""

import torch
import torch.distributed as dist

import forge_kernels as fk
from forge_kernels.token_split import linear_split_step, materialized_split_step

from ..numerics.bits import assert_bitwise_equal, ulp_distance
from .sharding import chunk, device

SPLITS = ("data", "context", "accumulation")
MICRO_BATCHES = 4


def problem(seed=0, dyadic=False, steps=1, batch=2, seq=32, n=24, k=32):
    """(weight, [(x, dy) per step]) with x (batch, seq, k) and dy (batch, seq, n).
    ``dyadic``: small integers, so every sum and every SGD step with power-of-two
    scalars on them is exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    if dyadic:
        draw = lambda *shape: torch.randint(-2, 3, shape, generator=gen).float().to(device())  # noqa: E731
    else:
        draw = lambda *shape: torch.randn(*shape, generator=gen).to(device())  # noqa: E731
    return draw(n, k), [(draw(batch, seq, k), draw(batch, seq, n)) for _ in range(steps)]


def parts_of(split, x, dy):
    """This rank's (x, dy) parts, tokens flattened, and the group that holds the rest."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = _flat
    if split == "data":  # whole sequences per rank
        rows = chunk(x.shape[0] * x.shape[1], world, rank)
        return [(flat(x)[rows], flat(dy)[rows])], dist.group.WORLD
    if split == "context":  # every sequence split along its positions
        positions = chunk(x.shape[1], world, rank)
        return [(flat(x[:, positions]), flat(dy[:, positions]))], dist.group.WORLD
    if split == "accumulation":  # micro-batches on this rank, no group
        tokens = flat(x).shape[0]
        return [(flat(x)[chunk(tokens, MICRO_BATCHES, m)], flat(dy)[chunk(tokens, MICRO_BATCHES, m)])
                for m in range(MICRO_BATCHES)], None
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _flat(t):
    return t.reshape(-1, t.shape[-1])


def _trajectory(weight, batches, rule, take_step):
    """Apply ``take_step(x, dy, w, state, step)`` once per batch from (weight, fresh state)."""
    w, state = weight.clone(), rule.init_state(weight)
    for step, (x, dy) in enumerate(batches, start=1):
        take_step(x, dy, w, state, step)
    return w


def _naive(split, rule):
    """What fusing each part gives: a fused step per part, on this rank's parts only
    (with accumulation, one optimizer step per micro-batch)."""
    counter = iter(range(1, 10**6))

    def take(x, dy, w, state, step):
        for px, pdy in parts_of(split, x, dy)[0]:
            fk.fused_weight_update(px, pdy, w, state, rule, next(counter))
    return take


def _alternative(split, rule, method):
    def take(x, dy, w, state, step):
        parts, group = parts_of(split, x, dy)
        if method == "linear":
            linear_split_step(parts, w, state, rule, step, group=group)
        else:
            materialized_split_step(parts, w, state, rule, step, group=group)
    return take


def _measure(w, true, w0):
    return {"max_ulp": int(ulp_distance(w.cpu(), true.cpu()).max()),
            "relative": float((w - true).norm() / (true - w0).norm())}


def split_step_deviation(split, rule, steps=3, seed=0, dyadic=False):
    """Job: {method: {"max_ulp", "relative"}} for this rank after ``steps`` steps, against
    the true trajectory (one fused step over every token per step): ``naive`` (a fused
    step per part), ``materialized`` and, for linear rules, ``linear``. ``relative`` is
    the norm of the difference over the norm of the true change of the weight."""
    weight, batches = problem(seed, dyadic, steps)
    true = _trajectory(weight, batches, rule,
                       lambda x, dy, w, state, step: fk.fused_weight_update(_flat(x), _flat(dy), w, state, rule, step))
    methods = {"naive": _naive(split, rule), "materialized": _alternative(split, rule, "materialized")}
    if rule.linear:
        methods["linear"] = _alternative(split, rule, "linear")
    return {name: _measure(_trajectory(weight, batches, rule, take), true, weight) for name, take in methods.items()}


def bucketed_equals_standard_pipeline(split, rule, bucket_rows, regime):
    """Job: materialized_split_step with ``bucket_rows`` gives the bits of the standard
    pipeline (whole gradient per part, summed, all-reduced, then apply_rule)."""
    weight, ((x, dy),) = problem(seed=3)
    weight = weight.to(regime.weight)
    parts, group = parts_of(split, x, dy)
    w_a, s_a = weight.clone(), rule.init_state(weight, state_format=regime.state_format)
    materialized_split_step(parts, w_a, s_a, rule, 1, group=group, bucket_rows=bucket_rows,
                            rounding=regime.rounding, seed=regime.seed)
    w_b, s_b = weight.clone(), rule.init_state(weight, state_format=regime.state_format)
    grad = sum((fk.weight_gradient(px, pdy) for px, pdy in parts[1:]), fk.weight_gradient(*parts[0]))
    if group is not None:
        dist.all_reduce(grad, group=group)
    fk.apply_rule(grad, w_b, s_b, rule, 1, rounding=regime.rounding, seed=regime.seed)
    assert_bitwise_equal(w_a, w_b, f"rank {dist.get_rank()}, {split}, bucket_rows={bucket_rows}: weight")
    for key in s_a:
        assert_bitwise_equal(s_a[key], s_b[key], f"rank {dist.get_rank()}, {split}: state {key}")


def one_rank_refused(method, fault):
    """Job: a data-parallel step in which only rank 1's call is bad (``fault``: "nan" in
    dy, "shape", an x of the wrong width, or, for the materialized step, "seed", a seed out
    of range, which the rule's epilogue checks); returns (this rank's error, whether its
    weight or state changed). Every rank must refuse, none may wait in the reduction for a
    rank that refused alone, and nothing may be written anywhere."""
    rule = fk.SGD(lr=0.1, momentum=0.9)
    weight, [(x, dy)] = problem(seed=3)
    parts, group = parts_of("data", x, dy)
    if dist.get_rank() == 1:
        x0, dy0 = parts[0]
        if fault == "nan":
            dy0 = dy0.clone()
            dy0[1, 2] = float("nan")
        elif fault == "shape":
            x0 = x0[:, :-1]
        parts = [(x0, dy0)]
    # Two buckets: a rank that refused only at the first bucket's rule would leave the
    # other waiting in the second bucket's reduction, its first rows written.
    options = {"seed": -1 if fault == "seed" and dist.get_rank() == 1 else 0, "bucket_rows": 12} \
        if method == "materialized" else {}
    state = rule.init_state(weight)
    state["momentum_buffer"].fill_(0.25)  # so that a write of any step would show
    before = [t.clone() for t in (weight, *state.values())]
    step = linear_split_step if method == "linear" else materialized_split_step
    try:
        step(parts, weight, state, rule, 1, group=group, **options)
        error = None
    except (TypeError, ValueError, FloatingPointError) as caught:
        error = f"{type(caught).__name__}: {caught}"
    changed = any(not torch.equal(a, b) for a, b in zip(before, (weight, *state.values())))
    return error, changed
