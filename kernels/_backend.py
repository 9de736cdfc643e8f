"""Where kernels run: compiled on a CUDA GPU when one is present, otherwise on the
CPU through the Triton interpreter.

This module must be imported before any ``@triton.jit`` decoration in the package:
Triton reads ``TRITON_INTERPRET`` when a function is decorated, not when it runs.
A user who sets ``TRITON_INTERPRET`` themselves keeps their choice.
"""

import contextlib
import os

import numpy as np
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device:
    """The device on which kernel inputs must live."""
    return torch.device("cpu") if interpreting() else torch.device("cuda")


def on_device(device: torch.device):
    """Make ``device`` current for a launch: Triton launches on the current CUDA device,
    so tensors on another GPU would otherwise fail deep inside Triton."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def quiet_non_finite():
    """Silence numpy's floating-point warnings for a launch under the interpreter, which
    runs kernels as numpy. The kernels take NaN and infinity in their stride (inputs are
    counted on the device, bad tiles are not stored, and the caller gets an error), as
    compiled kernels do without a word; the warnings would only be noise, or errors
    under ``-W error``."""
    if interpreting():
        return np.errstate(over="ignore", invalid="ignore", divide="ignore")
    return contextlib.nullcontext()
