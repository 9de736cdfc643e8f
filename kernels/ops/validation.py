"""Checks the launchers run before touching memory: every bad input gets an error
that names what was wrong."""

import numpy as np
import torch
from triton.runtime.interpreter import InterpretedFunction

from .._backend import interpreting, kernel_device
from ..rules.base import check_real

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
STORAGE_DTYPES = (torch.float32, torch.bfloat16)
# Kernel offsets are 32-bit element indices.
MAX_ELEMENTS = 2**31 - 1


def _span(t: torch.Tensor):
    """(storage pointer, first byte, one past last byte) that ``t`` can touch."""
    if t.numel() == 0:
        return None
    start = t.storage_offset()
    stop = start + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    size = t.element_size()
    return t.untyped_storage().data_ptr(), start * size, stop * size


def _spans_overlap(sa, sb) -> bool:
    """True when two ``_span``s may share memory (same storage, intersecting byte ranges)."""
    if sa is None or sb is None or sa[0] != sb[0]:
        return False
    return sa[1] < sb[2] and sb[1] < sa[2]


def _check_tensor(name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    if t.numel() > MAX_ELEMENTS or reach > MAX_ELEMENTS:
        raise ValueError(f"{name} has {t.numel()} elements and its strides reach {reach} elements past its "
                         f"start; the kernel indexes with 32-bit offsets and reaches at most {MAX_ELEMENTS}")


def _check_device(name, t):
    expected = kernel_device()
    if t.device.type != expected.type:
        where = "the Triton interpreter (CPU)" if interpreting() else "the GPU"
        raise ValueError(f"{name} is on {t.device}, but kernels run on {where}: inputs must be on {expected.type}")


def check_activations(x, dy):
    """x (T, K) and dy (T, N): 2-D, same dtype (float32 or bfloat16), same tokens, same device."""
    _check_tensor("x", x, 2)
    _check_tensor("dy", dy, 2)
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x is {x.dtype}; activations must be float32 or bfloat16")
    if dy.dtype != x.dtype:
        raise TypeError(f"dy is {dy.dtype} but x is {x.dtype}; they must match")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens (rows) but dy has {dy.shape[0]}")
    _check_device("x", x)
    _check_device("dy", dy)
    if x.device != dy.device:
        raise ValueError(f"x is on {x.device} but dy on {dy.device}")


def check_weight_and_state(weight, state, rule, read=(), square_sums=None, grad_scale=None):
    """The written tensors: a contiguous float32/bfloat16 weight on the kernels' device, this
    rule's state for it, and no memory shared between a written tensor (the weight, the
    state, a ``square_sums`` buffer) and any other tensor of the call (the ``read``
    tensors, a device ``grad_scale``). Only these tensors' memory is checked here; what
    else is wrong with ``square_sums`` or ``grad_scale`` is their own checks' to say."""
    _check_tensor("weight", weight, 2)
    if weight.dtype not in STORAGE_DTYPES:
        raise TypeError(f"weight is {weight.dtype}; weights must be float32 or bfloat16")
    _check_device("weight", weight)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (it is updated in place)")
    if not hasattr(rule, "slot_layout") or getattr(rule, "update", None) is None:
        raise TypeError(f"rule must be a forge_kernels Rule, got {type(rule).__name__}")
    if isinstance(rule.update, InterpretedFunction) != interpreting():
        raise RuntimeError(
            f"{type(rule).__name__}.update was decorated with @triton.jit before forge_kernels chose the "
            f"{'interpreter' if interpreting() else 'compiler'}: import forge_kernels before defining kernels "
            "(or set TRITON_INTERPRET yourself before importing triton)")
    rule.check_state(state, weight)
    written = [("weight", weight)] + [(f"state[{k!r}]", state[k]) for k in sorted(state)] + \
        _plain_tensors([("square_sums", square_sums)])
    read = list(read) + _plain_tensors([("grad_scale", grad_scale)])
    # Each span once: this runs on every step, over up to eleven tensors.
    spans = [(name, _span(t)) for name, t in written + read]
    for i, (name_a, a) in enumerate(spans[:len(written)]):
        for name_b, b in spans[i + 1:]:
            if _spans_overlap(a, b):
                raise ValueError(f"{name_a} and {name_b} share memory; the update writes "
                                 f"{name_a} in place, so they must not overlap")


def _plain_tensors(named) -> list:
    """The (name, tensor) pairs of ``named`` whose value is a tensor with memory of its own
    (a plain tensor or a Parameter); None, numbers and other types are left to the checks
    of their arguments."""
    return [(name, t) for name, t in named if type(t) in (torch.Tensor, torch.nn.Parameter)]


def check_update_inputs(x, dy, weight, state, rule, square_sums=None, grad_scale=None):
    """Validate the arguments of ``fused_weight_update``; raise on the first problem."""
    check_activations(x, dy)
    _check_tensor("weight", weight, 2)
    K = x.shape[1]
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight is {tuple(weight.shape)} (out, in) but x has {K} input features")
    if dy.shape[1] != N:
        raise ValueError(f"weight is {tuple(weight.shape)} (out, in) but dy has {dy.shape[1]} output features")
    check_weight_and_state(weight, state, rule, read=[("x", x), ("dy", dy)], square_sums=square_sums,
                           grad_scale=grad_scale)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x on {x.device}")


def check_gradient(grad, weight):
    """A materialized gradient: float32, contiguous, the weight's shape and device."""
    _check_tensor("grad", grad, 2)
    if grad.dtype != torch.float32:
        raise TypeError(f"grad is {grad.dtype}; the rule takes a float32 gradient")
    if not isinstance(weight, torch.Tensor) or grad.shape != weight.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}, the weight "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight!r}")
    if not grad.is_contiguous():
        raise ValueError("grad must be contiguous")
    _check_device("grad", grad)
    if grad.device != weight.device:
        raise ValueError(f"grad is on {grad.device} but weight on {weight.device}")


def check_grad_scale(grad_scale, weight):
    """A gradient scale: a number that is finite, >= 0 and a float32 value (the kernel
    multiplies in float32; a value that rounded on the way in would not be the multiply
    the caller meant), or a one-element float32 tensor on the weight's device, which the
    kernel reads there (its value is not looked at here: that would synchronize)."""
    if isinstance(grad_scale, torch.Tensor):
        if type(grad_scale) is not torch.Tensor:  # a DTensor, say: the kernel reads a plain tensor's memory
            raise TypeError(f"a grad_scale tensor must be a plain torch.Tensor, got {type(grad_scale).__name__}")
        if grad_scale.dtype != torch.float32 or grad_scale.numel() != 1:
            raise ValueError(f"a grad_scale tensor must hold one float32 value, got {grad_scale.dtype} of shape "
                             f"{tuple(grad_scale.shape)}")
        if grad_scale.device != weight.device:
            raise ValueError(f"grad_scale is on {grad_scale.device}, the weight on {weight.device}")
        return grad_scale
    grad_scale = check_real("grad_scale", grad_scale, low=0.0)
    if float(np.float32(grad_scale)) != grad_scale:
        raise ValueError(f"grad_scale={grad_scale!r} is not a float32 value; round it to float32 first "
                         "(e.g. float(torch.tensor(scale, dtype=torch.float32)))")
    return grad_scale
