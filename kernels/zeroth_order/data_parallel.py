"""What zeroth-order data parallelism exchanges, and nothing else.

Every rank of the data-parallel group holds the whole model, the same seed and the same
call counter, and its own b examples of the batch (B = world · b). The draws are keyed
on the global example index, so rank r perturbs its examples as the single process
perturbs examples r·b, ..., r·b + b - 1; then

* GRZO all-gathers the per-example losses at +σ and -σ (2B float64 numbers per step, as
  the GRZO code all-gathers its losses), and every rank runs the same update from all
  B of them: each rank's step is the single-process step with B;
* MeZO all-reduces its two scalar losses (the mean over ranks of the ranks' mean
  losses: 2 float64 numbers per rank per step).

Before the losses, each rank sends one row of int64s: its local batch, whether its
forwards succeeded, its seed, its call counter, its hyperparameters (each float's bits;
a string's hash) and, at the first step after construction or ``load_state_dict``, a
digest of its weights (``weights_digest``; -1 at other steps), so that a refusal on one
rank is a refusal on every rank (no rank waits in a collective the others skipped, and
nothing is written anywhere) and ranks that would silently step apart (another seed,
counter, lr, σ or ε, eps, weight decay, normalization, or other weights) are refused,
naming what differs. The weights are digested once, not at every step: with the rest
equal every rank takes the same step, and a digest reads every weight (block by block).
"""

import struct

import torch
import torch.distributed as dist

from .._collectives import place_weighted_bits, wire_device
from ..ops.stochastic_round import _splitmix64
from .draws import name_hash

class RankRefusedError(RuntimeError):
    """Another rank of the data-parallel group refused the step; nothing was written."""


def group_rank(group) -> tuple:
    """(rank, world size) of this process in ``group`` (None: a single process)."""
    if group is None:
        return 0, 1
    if not dist.is_initialized():
        raise RuntimeError("a data-parallel group was given but torch.distributed is not initialized")
    return dist.get_rank(group), dist.get_world_size(group)


def _as_int64(value) -> int:
    """A setting as one int64: a float's bits, a string's hash (equal exactly when equal)."""
    if isinstance(value, str):
        return name_hash(value) >> 1
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def weights_digest(params, block_elements: int) -> int:
    """A digest (below 2**63) of the parameters' bits in which each element's place
    counts, so permuted weights differ: each parameter's ``place_weighted_bits`` (in
    blocks of about ``block_elements``), chained through SplitMix64 in order."""
    digest = 0
    for param in params:
        digest = _splitmix64(digest ^ place_weighted_bits(param, block_elements))
    return digest >> 1


def agree(group, method: str, batch: int, ok: bool, seed: int, call: int, settings: dict, digest: int = -1) -> None:
    """Exchange (batch, ok, seed, call, ``settings``' values, ``digest``) and raise on
    every rank unless every rank succeeded with equal local batches, seeds, counters,
    settings and digests. ``settings``: {name: float or str}, the same names on every
    rank (a failed rank's values are not read); ``digest``: ``weights_digest`` or -1
    (not digested at this step). A rank whose own forwards failed re-raises its own
    error after this (the caller's job)."""
    _, world = group_rank(group)
    values = [_as_int64(v) for v in settings.values()] if ok else [0] * len(settings)
    mine = torch.tensor([batch, int(ok), seed, call, digest, *values], dtype=torch.int64, device=wire_device(group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    if not bool(table[:, 1].all()):
        if not ok:
            return
        failed = [r for r in range(world) if not table[r, 1]]
        raise RankRefusedError(f"{method}: rank(s) {failed} of the data-parallel group refused the step; "
                               f"no step was taken on any rank")
    for column, what in ((2, "seed"), (3, "call counter")):
        if not bool((table[:, column] == table[0, column]).all()):
            raise ValueError(f"{method}: the data-parallel ranks disagree on the {what} "
                             f"({table[:, column].tolist()}); their draws would differ, so no step was taken")
    for column, (name, value) in enumerate(settings.items(), start=5):
        differing = [r for r in range(world) if table[r, column] != table[0, column]]
        if differing:
            raise ValueError(f"{method}: the data-parallel ranks disagree on {name} (rank(s) {differing} differ "
                             f"from rank 0; this rank has {value!r}); their steps would differ, so no step was taken")
    if not bool((table[:, 4] == table[0, 4]).all()):
        raise ValueError(f"{method}: the data-parallel ranks hold different weights (digests "
                         f"{table[:, 4].tolist()}; -1: a rank that did not digest them, having neither been built "
                         f"nor loaded a state since its last step); load the same weights on every rank; "
                         f"no step was taken")
    if not bool((table[:, 0] == table[0, 0]).all()):
        raise ValueError(f"{method}: the data-parallel ranks hold unequal local batches "
                         f"({table[:, 0].tolist()}); equal ones are needed (rank r holds global "
                         f"examples r·b, ..., r·b + b - 1); no step was taken")


def agreed(opt, local, batch_of):
    """``local()`` (this rank's forwards) run inside the refusal every rank of
    ``opt.group`` shares: the agreement on its batch (``batch_of`` its result), seed,
    counter and ``opt.HYPERPARAMETERS`` from ``opt.param_groups[0]`` and, where
    ``opt.digest_weights``, on the weights (digested before ``local`` moves any)."""
    # .get: a missing key is local()'s refusal to make, shared with every rank (a KeyError
    # here would leave the other ranks waiting in the agreement); a refusal sends no values.
    settings = {name: opt.param_groups[0].get(name) for name in opt.HYPERPARAMETERS}
    try:
        params = opt.param_groups[0]["params"]
        digest = weights_digest(params, opt.block_elements) if opt.digest_weights else -1
        result = local()
    except Exception:
        agree(opt.group, opt.method, 0, False, opt.seed, opt.call, settings)
        raise
    agree(opt.group, opt.method, batch_of(result), True, opt.seed, opt.call, settings, digest)
    opt.digest_weights = False
    return result


def gather_losses(group, plus: torch.Tensor, minus: torch.Tensor) -> tuple:
    """The B losses at +σ and -σ of the whole group, in global example order (float64)."""
    _, world = group_rank(group)
    mine = torch.stack([plus.to(torch.float64), minus.to(torch.float64)]).to(wire_device(group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    both = torch.cat(everyone, dim=1).to(plus.device)
    return both[0], both[1]


def average_losses(group, losses: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of each rank's (float64) losses: summed by one all-reduce,
    then divided by the world size."""
    _, world = group_rank(group)
    total = losses.to(device=wire_device(group), dtype=torch.float64, copy=True)
    dist.all_reduce(total, group=group)
    return (total / world).to(losses.device)
