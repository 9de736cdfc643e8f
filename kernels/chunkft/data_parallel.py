"""Data parallelism: the active slice's gradient averaged over the ranks of a group.

The fused kernel steps a slice from its token sum inside one kernel; with the batch
split across ranks each rank holds only its tokens' partial sum, and a fused step per
rank would be another step on every rank (FORGE's token_split says the same). So under
data parallelism ChunkFT materializes the active slice's fp32 gradient (the same tile
loop as the fused kernel, ``weight_gradient``), all-reduces it, divides by the world
size (DDP's average) and applies the same epilogue (``apply_rule``): the oracle path,
whose bits equal the fused step's on the same gradient. Only the active chunk's slices
cross the wire: 4 bytes per element of them per step.

This is ``token_split.materialized_split_step``'s path with two differences: it averages
(DDP's convention, so each rank's loss stays a mean over its own batch) where token_split
sums, and it reduces the Embedding, norm and bias slices' gradients too.
"""

import torch
import torch.distributed as dist

from .._collectives import gathered, place_weighted_bits


def check_group(group):
    """The group's world size; refuses anything that is not a live process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (dist.group.WORLD for the "
                        f"default group), got {type(group).__name__}")
    return dist.get_world_size(group)


def check_same_on_every_rank(description: dict, group) -> None:
    """Refuse, on every rank, a configuration that differs between the ranks, naming what
    differs (a different plan would make ranks all-reduce different slices: wrong sums, or
    a hang; other rule settings, rounding or tile config would step other bits)."""
    everyone = gathered(description, group)
    ranks = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if ranks:
        keys = sorted({key for theirs in everyone for key in set(theirs) | set(everyone[0])
                       if theirs.get(key) != everyone[0].get(key)})
        raise ValueError(f"ChunkFT is configured differently on ranks {ranks} than on rank 0 of the "
                         f"process group: {keys} differ; refused")


def _digest(tensor) -> str:
    """The tensor's dtype, shape and place-weighted bit sum: equal for the same bits in
    the same places (a plain sum of bit patterns would pass a permutation), read without
    copying the tensor to the host."""
    return f"{tensor.dtype}{tuple(tensor.shape)}:{place_weighted_bits(tensor)}"


def check_same_weights(named_params: dict, group) -> None:
    """Refuse, on every rank, weights that differ between the ranks (DDP broadcasts rank
    0's; ChunkFT does not change the model behind the caller's back, it names them)."""
    ours = [_digest(p) for p in named_params.values()]
    everyone = gathered(ours, group)
    differing = sorted({name for theirs in everyone for name, a, b in zip(named_params, theirs, everyone[0])
                        if a != b})
    if differing:
        raise ValueError(f"ChunkFT under data parallelism needs the same weights on every rank; {differing} "
                         "differ from rank 0's (seed the model alike, or load one checkpoint on every rank)")


def average_over_ranks(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad`` (fp32, contiguous) replaced in place by its mean over the group's ranks."""
    dist.all_reduce(grad, group=group)
    return grad.div_(dist.get_world_size(group))
