"""One optimizer step whose tokens are split: across ranks (data or context
parallelism) or across micro-batches (gradient accumulation).

The fused kernel applies the rule to the gradient summed over every token it is
given; a fused step per part would apply it to partial sums, which is not the step
(``tensor_parallel`` refuses such layouts). Two ways to take the true step instead:

* ``linear_split_step``, for rules that are linear in (weight, state, gradient)
  together (``rule.linear``: SGD with or without momentum): a step on a sum of
  gradients is the sum of steps, so the first part steps (a copy of) (weight, state)
  and every other part steps a zero copy, and the results are added (and all-reduced
  across ranks), then written back. No gradient is materialized; the sum and the later
  parts' steps cost a copy of the weight and its state each, and the all-reduce moves
  weight and state. Exact in real arithmetic;
  in fp32 it differs from the one-kernel step only by the rounding of the
  reassociated sums. fp32 weight and state only (a bf16 sum would round again).
* ``materialized_split_step``, for any rule: the fp32 gradient of one bucket of rows
  at a time, summed over the parts (and all-reduced), then the rule on that bucket
  (``apply_rule``, same epilogue and rounding streams). Memory: one fp32 bucket,
  ``bucket_rows x in_features x 4`` bytes. The same bits as the standard pipeline
  (whole gradient per part, summed, all-reduced, then the rule) for any bucket size.
  The sum over ranks is a seam (``reduce=``): compressed communication such as GIFT's
  (``forge_kernels.gift.GiftSplitReducer``) replaces the fp32 all-reduce there.
"""

import torch
import torch.distributed as dist

from ._collectives import refused_together
from .errors import NonFiniteInputError, reword
from .ops.fused_weight_update import apply_rule, check_epilogue_arguments, check_fused_parts, fused_weight_update
from .ops.validation import check_update_inputs
from .ops.weight_gradient import weight_gradient
from .weight_slice import WeightSlice


def _check_parts(parts):
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError("parts must be a non-empty list of (x, dy) pairs: this rank's micro-batches")


# group=None means this process alone (micro-batches only): pass dist.group.WORLD for
# the default group explicitly, so accumulation inside a process group never reduces.
def _world(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


def linear_split_step(parts, weight, state, rule, step, *, group=None, config=None):
    """One step of a linear rule on the gradient summed over every part on every rank of
    ``group`` (``None``: this process's parts alone); ``weight`` and ``state`` are
    updated in place and equal on every rank afterwards.

    The steps are taken into copies and written back only once every part on every rank
    has stepped: a refusal anywhere (bad arguments, NaN or infinity in a part, a tile
    whose step overflows) raises on every rank of ``group`` with ``weight`` and ``state``
    unchanged on all of them. Memory: one copy of the weight and its state for the sum,
    and, for a rank with more than one part, one more for the later parts' steps."""
    # No autograd history: the weight may be a Parameter that requires grad, which the
    # kernels write in place as the optimizer's step does.
    with torch.no_grad():
        with refused_together(group, "linear_split_step"):
            total_weight, total_state = _summed_steps(parts, weight, state, rule, step, config, _rank(group) == 0)
        weight.copy_(total_weight)
        for key, tensor in state.items():
            tensor.copy_(total_state[key])
        if _world(group) > 1:
            for tensor in (weight, *state.values()):
                dist.all_reduce(tensor, group=group)


def _summed_steps(parts, weight, state, rule, step, config, first: bool):
    """(weight, state) this rank adds to the sum: with ``first``, the step of its first
    part on (weight, state) plus the steps of the others on zeros; otherwise the steps of
    all its parts on zeros. Computed in new tensors; nothing of the caller's is written."""
    _check_parts(parts)
    if not rule.linear:
        raise ValueError(f"{rule!r} is not linear in (weight, state, gradient): a sum of steps is not the step. "
                         "Use materialized_split_step (any rule; one fp32 bucket of the gradient in memory)")
    if weight.dtype != torch.float32 or any(t.dtype != torch.float32 for t in state.values()):
        raise TypeError("linear_split_step adds steps in the storage format: it needs fp32 weight and state "
                        "(a bf16 or q8 sum would round once more per part)")
    check_fused_parts(parts, weight, state, rule, config)  # before the first launch
    if first:
        total_weight, total_state = weight.clone(), {key: tensor.clone() for key, tensor in state.items()}
    else:
        total_weight, total_state = torch.zeros_like(weight), {key: torch.zeros_like(t) for key, t in state.items()}
    # The first part steps the total itself: on zeros that is the step on zeros added to
    # zero, bit for bit (a step on zeros is never -0.0, and 0 + v is v).
    (x, dy), *contributions = parts
    fused_weight_update(x, dy, total_weight, total_state, rule, step, config=config)
    if contributions:
        zero_weight = torch.empty_like(weight)
        zero_state = {key: torch.empty_like(tensor) for key, tensor in state.items()}
    for x, dy in contributions:
        zero_weight.zero_()
        for tensor in zero_state.values():
            tensor.zero_()
        fused_weight_update(x, dy, zero_weight, zero_state, rule, step, config=config)
        total_weight.add_(zero_weight)
        for key, tensor in total_state.items():
            tensor.add_(zero_state[key])
    return total_weight, total_state


def _all_reduce_sum(grad, group, rows):
    dist.all_reduce(grad, group=group)
    return grad


def materialized_split_step(parts, weight, state, rule, step, *, group=None, bucket_rows=None, config=None,
                            rounding=None, seed=0, weight_slice=None, reduce=None):
    """One step of any rule on the gradient summed over every part on every rank of
    ``group``, materialized ``bucket_rows`` rows at a time (default: all rows).
    ``weight_slice`` places a tensor-parallel shard, as in ``fused_weight_update``.
    ``reduce(grad, group, rows)`` (default: an fp32 all-reduce) returns the sum over the
    ranks of this rank's gradient ``grad`` of weight rows ``rows`` (a slice), in its shape
    and dtype; called once per bucket, in row order, on every rank of a group of more than
    one.

    Every part is checked before the first bucket is written (shapes, dtypes, devices,
    and the inputs for NaN and infinities: one synchronization), and the ranks of
    ``group`` agree on the verdict, so a refusal of any rank's input raises on every rank
    and changes nothing on any. What only a bucket's own sum can show (an overflow) stops
    the step at that bucket on every rank (they hold the same sum): the rows before it
    have stepped, and the error says which."""
    with refused_together(group, "materialized_split_step"):
        _check_parts(parts)
        for x, dy in parts:
            check_update_inputs(x, dy, weight, state, rule)
        # Checked here, not first by bucket 0's apply_rule, after the ranks' first reduction.
        check_epilogue_arguments(weight, state, rule, step, config=config, rounding=rounding, seed=seed,
                                 weight_slice=weight_slice)
        rows = weight.shape[0]
        bucket_rows = rows if bucket_rows is None else bucket_rows
        if isinstance(bucket_rows, bool) or not isinstance(bucket_rows, int) or bucket_rows < 1:
            raise ValueError(f"bucket_rows must be a positive integer, got {bucket_rows!r}")
        finite = torch.stack([torch.isfinite(x).all() & torch.isfinite(dy).all() for x, dy in parts]).tolist()
        bad = [index for index, ok in enumerate(finite) if not ok]
        if bad:
            raise NonFiniteInputError(f"parts {bad} hold NaN or infinite values in x or dy; nothing was updated")
    place = weight_slice or WeightSlice.whole(weight.shape)
    for start in range(0, rows, bucket_rows):
        stop = min(rows, start + bucket_rows)
        grad = None
        for x, dy in parts:
            part = weight_gradient(x, dy[:, start:stop], config=config)
            grad = part if grad is None else grad.add_(part)
        if _world(group) > 1:
            reduced = (reduce or _all_reduce_sum)(grad, group, slice(start, stop))
            if reduced.shape != grad.shape or reduced.dtype != grad.dtype:
                raise ValueError(f"reduce returned {tuple(reduced.shape)} {reduced.dtype} for a "
                                 f"{tuple(grad.shape)} {grad.dtype} gradient bucket")
            grad = reduced
        try:
            apply_rule(grad, weight[start:stop], {key: tensor[start:stop] for key, tensor in state.items()}, rule,
                       step, config=config, rounding=rounding, seed=seed,
                       weight_slice=WeightSlice(place.row_start + start, place.col_start, place.global_shape))
        except FloatingPointError as error:
            if start:
                reword(error, "", f" (in the bucket of rows {start}..{stop - 1}; rows 0..{start - 1} had stepped "
                                  "already: the weight and state are part-way through the step)")
            raise
