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


def check_group(group):
    """The group's world size; refuses anything that is not a live process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (dist.group.WORLD for the "
                        f"default group), got {type(group).__name__}")
    return dist.get_world_size(group)


def check_same_on_every_rank(description: str, group) -> None:
    """Refuse, on every rank, a configuration that differs between the ranks (a different
    plan would make ranks all-reduce different slices: wrong sums, or a hang)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, description, group=group)
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differing:
        raise ValueError(f"ChunkFT is configured differently on ranks {differing} than on rank 0 of the "
                         "process group (model, rule, chunks, schedule, seed or format): refused")


def _checksum(tensor) -> int:
    """The sum of the tensor's bit patterns as integers: equal bits give equal sums."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype]
    return int(tensor.detach().contiguous().view(bits).sum(dtype=torch.int64))


def check_same_weights(named_params: dict, group) -> None:
    """Refuse, on every rank, weights that differ between the ranks (DDP broadcasts rank
    0's; ChunkFT does not change the model behind the caller's back, it names them)."""
    ours = [_checksum(p) for p in named_params.values()]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, ours, group=group)
    differing = sorted({name for theirs in everyone for name, a, b in zip(named_params, theirs, everyone[0])
                        if a != b})
    if differing:
        raise ValueError(f"ChunkFT under data parallelism needs the same weights on every rank; {differing} "
                         "differ from rank 0's (seed the model alike, or load one checkpoint on every rank)")


def average_over_ranks(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad`` (fp32, contiguous) replaced in place by its mean over the group's ranks."""
    dist.all_reduce(grad, group=group)
    return grad.div_(dist.get_world_size(group))
