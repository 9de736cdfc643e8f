"""Where a collective's tensors must live: NCCL reduces CUDA tensors on the current device
only, gloo host tensors (and CUDA ones for some collectives, which the code here does not
rely on). Every small bookkeeping tensor that goes into a collective (counts, flags,
ranks, scales) is made there. ``place_weighted_bits`` is what ranks compare of their
weights; ``refused_together`` makes a refusal on one rank a refusal on every rank."""

import contextlib

import torch
import torch.distributed as dist


def serving_backend(device_type: str, group=None) -> str | None:
    """The backend by which ``group`` reduces ``device_type`` tensors (None: none). Not
    ``dist.get_backend``: that names one backend only for a group made with one name, and
    a group made without (``init_process_group()``) reports "undefined" though it has its
    machine's backends (gloo for CPU tensors without an accelerator; on a CUDA machine,
    torch 2.11, NCCL alone)."""
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl"; a name alone, as "gloo", is expanded
    return dict(pair.split(":", 1) for pair in config.split(",")).get(device_type)


def wire_device(group=None) -> torch.device:
    """The CPU where a backend of ``group`` reduces CPU tensors (gloo), else the current GPU
    (NCCL alone) (``group`` None: the default group)."""
    return torch.device("cpu") if serving_backend("cpu", group) else torch.device("cuda", torch.cuda.current_device())


_INTEGERS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def place_weighted_bits(tensor: torch.Tensor, block_elements: int = 1 << 22) -> int:
    """Σ_k bits_k · (2k + 1) over the tensor's row-major index k, modulo 2**64 (so the
    order of the sum does not matter): equal bits in equal places give equal sums, and a
    permutation of unequal elements changes it. Taken in blocks of about
    ``block_elements`` along dim 0 (no tensor-sized temporary, nothing copied to the host
    but the sum): for ranks to compare their weights."""
    data = tensor.detach()
    data = data.reshape(-1) if data.dim() < 2 else data
    row = data.numel() // max(1, data.shape[0])
    per_block = max(1, block_elements // max(1, row))
    total = 0
    for start in range(0, data.shape[0], per_block):
        bits = data[start:start + per_block].reshape(-1).view(_INTEGERS[data.element_size()]).to(torch.int64)
        place = torch.arange(start * row, start * row + bits.numel(), device=bits.device, dtype=torch.int64)
        total += int((bits * (2 * place + 1)).sum())
    return total & (2**64 - 1)



def gathered(value, group) -> list:
    """Every rank's picklable ``value``, in rank order."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


@contextlib.contextmanager
def refused_together(group, what: str):
    """Run a rank's local work (checks, or steps into scratch copies) so that a refusal on
    any rank is one on every rank: each rank tells the others whether its block passed
    before any goes on (a rank that raised alone would leave the others waiting in the next
    collective until it times out). The rank that failed raises its own error; the others
    a ValueError naming ``what``, the ranks and the first error. Nothing is gathered
    without a group."""
    if group is None:
        yield
        return
    failure = None
    try:
        yield
    except Exception as error:  # whatever stopped this rank must stop the others too
        failure = error
    # One small all-reduce when every rank passed (the common case, once per call); the
    # messages are gathered (pickled) only when some rank failed.
    failed_anywhere = torch.tensor([failure is not None], dtype=torch.int32, device=wire_device(group))
    dist.all_reduce(failed_anywhere, op=dist.ReduceOp.MAX, group=group)
    if not failed_anywhere.item():
        return
    verdicts = gathered(None if failure is None else f"{type(failure).__name__}: {failure}", group)
    if failure is not None:
        raise failure
    failed = [rank for rank, verdict in enumerate(verdicts) if verdict is not None]
    if failed:
        raise ValueError(f"{what} was refused on ranks {failed} of the process group ({verdicts[failed[0]]}); "
                         "refused here too")
