"""What the Hopper kernel (``TileConfig(kernel="hopper")``, ``hopper_update``) and the
portable kernel's TMA operand loads (``TileConfig(operand_loads="tma")``) need, checked
before anything is launched: every refusal says what was wrong and what runs instead.

Kept apart from ``hopper_update`` so that it imports without Gluon: on the CPU the first
refusal (no Hopper GPU) is what the interpreter gets; the others are checked on the GPU.
"""

import torch

from .._backend import interpreting

# TMA copies rows of whole 16-byte units from 16-byte aligned addresses.
TMA_ALIGNMENT = 16


def check_tma_rows(name, t, reader="the hopper kernel", instead="use the portable kernel"):
    """Refuse a 2-D tensor that TMA cannot copy rows of: ``reader`` reads it by TMA."""
    row_bytes = t.stride(0) * t.element_size()
    if t.stride(1) != 1 or row_bytes % TMA_ALIGNMENT or t.data_ptr() % TMA_ALIGNMENT:
        raise ValueError(f"{reader} reads {name} by TMA, which needs unit column stride, rows a multiple of "
                         f"{TMA_ALIGNMENT} bytes apart and a {TMA_ALIGNMENT}-byte aligned start; {name} has strides "
                         f"{tuple(t.stride())} ({t.element_size()}-byte elements) and starts at byte "
                         f"{t.data_ptr() % TMA_ALIGNMENT} of 16 (make it contiguous with a suitable width, or "
                         f"{instead})")


def tma_available(device=None) -> bool:
    """Whether the portable kernel can read its operands by TMA on ``device`` (the current
    CUDA device by default): in the interpreter always, compiled on sm_90 and later."""
    return interpreting() or (torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9)


def check_tma_operands(x, dy):
    """Refuse a portable launch with ``operand_loads="tma"`` that cannot read x and dy by
    TMA: compiled, it needs sm_90 or later; everywhere, TMA-copyable rows."""
    if not tma_available(x.device):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise RuntimeError(f"TileConfig(operand_loads='tma') reads x and dy by TMA, which GPUs of compute "
                           f"capability 9.0 and later have; {x.device} is {major}.{minor}: use "
                           "operand_loads='pointers'")
    for name, t in (("x", x), ("dy", dy)):
        if t.numel():
            check_tma_rows(name, t, "TileConfig(operand_loads='tma')", "use operand_loads='pointers'")


def check_hopper_launch(x, dy, weight, slot_tensors, state_format):
    """Refuse a hopper-config launch the kernel cannot run as asked."""
    if interpreting() or weight.device.type != "cuda":
        raise RuntimeError("TileConfig(kernel='hopper') runs on an NVIDIA Hopper GPU (compute capability 9.x); "
                           "the Triton interpreter runs the portable kernel only: use kernel='portable' here")
    major, minor = torch.cuda.get_device_capability(weight.device)
    if major != 9:
        raise RuntimeError(f"TileConfig(kernel='hopper') needs compute capability 9.x (Hopper); {weight.device} is "
                           f"{major}.{minor}: use kernel='portable'")
    try:
        # The kernel module itself: it needs the Gluon names it was written against (triton 3.6), not just Gluon.
        from . import hopper_update  # noqa: F401
    except (ImportError, AttributeError) as error:
        raise RuntimeError(f"TileConfig(kernel='hopper') is written in Triton's Gluon, and this Triton lacks what "
                           f"it uses ({error}); use kernel='portable'") from error
    if state_format == "q8":
        raise ValueError("the hopper kernel keeps fp32 or bf16 state; q8 state runs on the portable kernel")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the hopper kernel multiplies bf16 activations on wgmma; x and dy are {x.dtype} "
                        "(float32 activations run on the portable kernel, with full-precision products)")
    for name, t in (("x", x), ("dy", dy), ("weight", weight)):
        if t.numel():
            check_tma_rows(name, t)
        elif t.shape[1] * t.element_size() % TMA_ALIGNMENT:
            # With no rows the kernel still describes a one-row stand-in of this width to TMA.
            raise ValueError(f"the hopper kernel reads {name} by TMA, whose rows must be a multiple of "
                             f"{TMA_ALIGNMENT} bytes; {name} has {t.shape[1]} columns of {t.element_size()} bytes "
                             "(use the portable kernel)")
    for i, t in enumerate(slot_tensors):
        if t is not weight:
            check_tma_rows(f"state slot {i}", t)
