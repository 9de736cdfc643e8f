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

Before the losses, each rank sends four integers (its local batch, whether its forwards
succeeded, its seed and its call counter), so that a refusal on one rank is a refusal
on every rank (no rank waits in a collective the others skipped, and nothing is
written anywhere) and ranks that disagree on the seed or the counter, which would
silently step apart, are refused.
"""

import torch
import torch.distributed as dist

from .._collectives import wire_device


class RankRefusedError(RuntimeError):
    """Another rank of the data-parallel group refused the step; nothing was written."""


def group_rank(group) -> tuple:
    """(rank, world size) of this process in ``group`` (None: a single process)."""
    if group is None:
        return 0, 1
    if not dist.is_initialized():
        raise RuntimeError("a data-parallel group was given but torch.distributed is not initialized")
    return dist.get_rank(group), dist.get_world_size(group)


def agree(group, method: str, batch: int, ok: bool, seed: int, call: int) -> None:
    """Exchange (batch, ok, seed, call) and raise on every rank unless every rank
    succeeded with equal local batches, seeds and counters. A rank whose own forwards
    failed re-raises its own error after this (the caller's job)."""
    _, world = group_rank(group)
    mine = torch.tensor([batch, int(ok), seed, call], dtype=torch.int64, device=wire_device(group))
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
    if not bool((table[:, 0] == table[0, 0]).all()):
        raise ValueError(f"{method}: the data-parallel ranks hold unequal local batches "
                         f"({table[:, 0].tolist()}); equal ones are needed (rank r holds global "
                         f"examples r·b, ..., r·b + b - 1); no step was taken")


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
