"""Where kernels run: compiled on a CUDA GPU when one is present, otherwise on the
CPU through the Triton interpreter.

This module must be imported before any ``@triton.jit`` decoration in the package:
Triton reads ``TRITON_INTERPRET`` when a function is decorated, not when it runs.
A user who sets ``TRITON_INTERPRET`` themselves keeps their choice.
"""

import contextlib
import dataclasses
import os
import warnings

import numpy as np
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402  (once TRITON_INTERPRET is settled)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether kernels run in the interpreter, for kernels that take another path there: a
# constexpr global, the only kind a compiled kernel may read, fixed at import as Triton
# fixes interpretation when each function is decorated.
INTERPRETED = tl.constexpr(interpreting())


def kernel_device() -> torch.device:
    """The device on which kernel inputs must live."""
    return torch.device("cpu") if interpreting() else torch.device("cuda")


def on_device(device: torch.device):
    """Make ``device`` current for a launch: Triton launches on the current CUDA device,
    so tensors on another GPU would otherwise fail deep inside Triton."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _interpreter_builder():
    """Triton's interpreter builder (where its options live), or None where this Triton
    has none by that name."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    fields = ("sanitize_overflow", "debug")
    return builder if options is not None and all(hasattr(options, field) for field in fields) else None


def set_overflow_sanitizer(enabled: bool) -> bool:
    """Turn the interpreter's integer-overflow check on or off; returns whether it was on.

    With ``sanitize_overflow`` (its default), Triton's interpreter recomputes every
    integer +, - and * of a kernel in int64 and builds an assertion that the result fits
    its type; but the assertion is dropped unless ``debug`` is on too, which by default
    it is not (triton 3.9: ``semantic.device_assert`` returns when ``options.debug`` is
    false). So by default the work is done and nothing is checked: 30 to 40 % of this
    project's CPU tier (measured on the 2-core AMD EPYC: 12.8 against 7.6 s for one
    fusion property, 43.9 against 31.7 s for ChunkFT's exactness property). Off, nothing
    is lost. On (``enabled=True``, or ``FORGE_INTERPRETER_SANITIZE=1`` for every run),
    both options are set and an overflow raises: ``tests/test_interpreter_overflow.py``
    runs the paths that take large indices that way."""
    builder = _interpreter_builder()
    if builder is None:
        return False
    options = builder.options
    was = bool(options.sanitize_overflow and options.debug)
    builder.options = dataclasses.replace(options, sanitize_overflow=bool(enabled), debug=bool(enabled))
    return was


@contextlib.contextmanager
def overflow_sanitizer(enabled: bool = True):
    """The interpreter's overflow sanitizer set to ``enabled`` inside the block."""
    was = set_overflow_sanitizer(enabled)
    try:
        yield
    finally:
        set_overflow_sanitizer(was)


if interpreting():
    set_overflow_sanitizer(os.environ.get("FORGE_INTERPRETER_SANITIZE", "0") not in ("", "0"))


@contextlib.contextmanager
def _numpy_quiet():
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), warnings.catch_warnings():
        # The interpreter's tl.max and tl.min are numpy's nanmax and nanmin, which warn on
        # a slice of NaN alone (a q8 block of a NaN gradient part, which is not stored).
        warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
        yield


def quiet_non_finite():
    """Silence numpy's floating-point warnings for a launch under the interpreter, which
    runs kernels as numpy. The kernels take NaN and infinity in their stride (inputs are
    counted on the device, bad tiles are not stored, and the caller gets an error), as
    compiled kernels do without a word; the warnings would only be noise, or errors
    under ``-W error``."""
    if interpreting():
        return _numpy_quiet()
    return contextlib.nullcontext()
