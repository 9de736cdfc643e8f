"""Where a collective's tensors must live: NCCL reduces CUDA tensors on the current device
only, gloo host tensors (and CUDA ones for some collectives, which the code here does not
rely on). Every small bookkeeping tensor that goes into a collective (counts, flags,
ranks, scales) is made there."""

import torch
import torch.distributed as dist


def wire_device(group=None) -> torch.device:
    """The GPU for NCCL, the CPU for gloo (``group`` None: the default group)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
