"""Counter-based draws for zeroth-order fine-tuning, in torch on any device.

Every random number is Philox4x32-10 (Triton's ``tl.randint4x``, the generator behind
``forge_kernels.stochastic_round``) with a 64-bit key that names the stream and a 32-bit
counter that is the global index of the element drawn. A stream is one
(seed, call, parameter name, kind) and its key is SplitMix64 of those, so

* the draws of a call depend on nothing else: not on tiles, blocks, launch order, the
  batch size or the device;
* the draws of a slice (a tensor-parallel shard, a row block) are the slice of the
  whole's draws, given the slice's global offsets.

Kinds: ``BASE`` the standard normal base U (counter: row-major flat index), ``ROW`` and
``COL`` the per-example Rademacher signs (counter: example · size + index).

Philox is computed on int64 tensors holding uint32 values; 32×32-bit products are split
into 32×16-bit halves so that nothing overflows int64. The normal is Box–Muller in
float64 on two 32-bit words, with ``sqrt``, ``log`` and ``cos`` evaluated from basic
operations alone (``portable_math``), then rounded to the working dtype: every draw, signs and
normals, is the same on every machine and device.

The functions here are the reference (the oracle). ``CallDraws`` draws the same bits
with one Triton kernel per block (``draw_kernel``) where ``kernels_for`` says so: on a
CUDA device by default; ``use_kernels(True)`` runs the kernel on the CPU interpreter too
(the tests compare the two paths bit for bit), ``use_kernels(False)`` nowhere.
"""

import contextlib
import functools
import hashlib

import torch

from .._backend import kernel_device
from ..ops.stochastic_round import MAX_COUNTER, _splitmix64, check_seed
from . import draw_kernel, portable_math

BASE, ROW, COL = 0, 1, 2
_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


@functools.lru_cache(maxsize=4096)
def name_hash(name: str) -> int:
    """A stable 64-bit hash of a parameter name (Python's ``hash`` varies per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def stream_key(seed: int, call: int, name: str, kind: int) -> int:
    """The Philox key (below 2**63) of one stream: SplitMix64 of seed, call, name, kind."""
    check_seed(seed)
    if isinstance(call, bool) or not isinstance(call, int) or not 0 <= call < 2**62:
        raise ValueError(f"call must be an integer in [0, 2**62), got {call!r}")
    z = _splitmix64(_splitmix64(seed) ^ call)
    z = _splitmix64(z ^ name_hash(name))
    return _splitmix64(z ^ kind) >> 1


def _mulhilo(constant: int, x: torch.Tensor):
    """(high, low) 32-bit words of constant · x, for x holding uint32 values in int64."""
    low16 = x * (constant & 0xFFFF)
    high16 = x * (constant >> 16)
    t = low16 + ((high16 & 0xFFFF) << 16)
    return (high16 >> 16) + (t >> 32), t & _M32


def philox4x32(key, counter: torch.Tensor, rounds: int = 10):
    """The four output words (int64 tensors with values in [0, 2**32)) of Philox4x32 with
    key (key lo, key hi) and counter (c, 0, 0, 0): ``tl.randint4x(key, counter)``.
    ``key`` is an int below 2**63 or an int64 tensor of such keys broadcasting against
    ``counter`` (many streams at once)."""
    if isinstance(key, int) and not 0 <= key < 2**63:
        raise ValueError("keys are below 2**63")
    c0 = counter.to(torch.int64)
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = key & _M32, (key >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def _check_counters(counter: torch.Tensor):
    if counter.numel() and (int(counter.min()) < 0 or int(counter.max()) >= MAX_COUNTER):
        raise ValueError("a stream has 2**32 counters; this draw needs more (a tensor or "
                         "batch too large for one stream)")


def standard_normal(key: int, counter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 1) at each counter: Box–Muller (cosine branch) in float64 on words 0 and 1,
    u1 = (w0 + 1/2) / 2**32 in (0, 1) so the logarithm is finite, then rounded to ``dtype``."""
    _check_counters(counter)
    w0, w1, _, _ = philox4x32(key, counter)
    u1 = (w0.to(torch.float64) + 0.5) * 2.0**-32
    u2 = w1.to(torch.float64) * 2.0**-32
    return (portable_math.sqrt(-2.0 * portable_math.log(u1)) * portable_math.cos_two_pi(u2)).to(dtype)


def rademacher(key: int, counter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """±1 at each counter: the top bit of word 0 (1 gives -1)."""
    _check_counters(counter)
    w0 = philox4x32(key, counter)[0]
    return (1 - 2 * (w0 >> 31)).to(dtype)


def base_rows(key: int, rows: torch.Tensor, cols: int, dtype, *, row_offset: int = 0,
              col_offset: int = 0, full_cols: int = None) -> torch.Tensor:
    """Rows ``rows`` (local indices) of the standard normal base of a (rows × cols) block
    at (row_offset, col_offset) of a matrix with ``full_cols`` columns: element (j, k)
    draws counter (row_offset + j) · full_cols + col_offset + k."""
    full_cols = cols if full_cols is None else full_cols
    local = torch.arange(cols, device=rows.device, dtype=torch.int64)
    counter = (rows.to(torch.int64)[:, None] + row_offset) * full_cols + col_offset + local[None, :]
    return standard_normal(key, counter, dtype)


def example_signs(key: int, batch: int, size: int, dtype, device, *, offset: int = 0,
                  full_size: int = None, first: int = 0) -> torch.Tensor:
    """(batch × size) Rademacher signs: local example i (global example first + i), local
    index j (global offset + j) draws counter (first + i) · full_size + offset + j."""
    full_size = size if full_size is None else full_size
    examples = torch.arange(first, first + batch, device=device, dtype=torch.int64)
    local = torch.arange(size, device=device, dtype=torch.int64)
    counter = examples.to(torch.int64)[:, None] * full_size + offset + local[None, :]
    return rademacher(key, counter, dtype)


_kernel_choice = None


def kernels_for(device: torch.device) -> bool:
    """Whether the zeroth-order draws and updates of tensors on ``device`` run as Triton
    kernels: on CUDA unless ``use_kernels(False)``; on the CPU (the interpreter) only
    inside ``use_kernels(True)``."""
    if _kernel_choice is False:
        return False
    if _kernel_choice is True:
        return torch.device(device).type == kernel_device().type
    return torch.device(device).type == "cuda"


@contextlib.contextmanager
def use_kernels(enabled: bool | None):
    """Inside the block, ``kernels_for`` answers True (kernels wherever kernels run),
    False (the torch reference everywhere) or, for None, the default (CUDA only)."""
    global _kernel_choice
    if enabled not in (True, False, None):
        raise ValueError(f"use_kernels takes True, False or None, got {enabled!r}")
    was, _kernel_choice = _kernel_choice, enabled
    try:
        yield
    finally:
        _kernel_choice = was


def fits_one_stream(last_counter: int) -> bool:
    """Whether every counter up to ``last_counter`` is one of a stream's 2**32."""
    return last_counter < MAX_COUNTER


def last_counter(cols: int, rows: int = 1, row_offset: int = 0, col_offset: int = 0, full_cols: int = 1) -> int:
    """The last counter a (rows × cols) block at (row_offset, col_offset) of a row-major
    whole of ``full_cols`` columns draws at: its last element's index in the whole (a
    vector is one row: ``cols`` elements from ``col_offset``)."""
    return (row_offset + rows - 1) * full_cols + col_offset + cols - 1


def check_fits_one_stream(method: str, name: str, drawn: str, last: int) -> None:
    """Refuse parameter ``name``, whose ``drawn`` (U, z) reaches counter ``last``, when
    that is past a stream's 2**32 counters."""
    if not fits_one_stream(last):
        raise ValueError(f"{method}: parameter '{name}' draws {drawn} at counters up to {last} (its place in the "
                         f"whole, shards), past a stream's 2**32 counters")


class CallDraws:
    """The draws of one call (seed, call) for any target: U regenerated on request, row
    by row (never stored), and each example's signs (small, cached for the call). A
    target that is a shard of a larger parameter (``target.row_offset`` etc.) draws at
    its global indices, so it gets the slice of the whole's draws.

    Where ``kernels_for`` the parameter's device, draws run as ``draw_kernel`` launches,
    the same bits: a target whose every counter fits one stream (checked from its
    shape, no device read) is drawn by the kernel; one that does not takes the torch
    path, which raises where a block's counters overflow, as before."""

    def __init__(self, seed: int, call: int):
        self.seed, self.call = seed, call
        self._signs = {}

    def key(self, target, kind: int) -> int:
        return stream_key(self.seed, self.call, target.name, kind)

    @staticmethod
    def kernel_base(target) -> bool:
        """Whether the target's U is drawn by the kernel: on a device ``kernels_for``
        and with every counter of the target (row-major in the whole) in one stream."""
        return kernels_for(target.param.device) and fits_one_stream(target.last_base_counter)

    def base(self, target, rows) -> torch.Tensor:
        """U at ``rows`` (a row-index tensor) of a matrix target, or the whole of a vector
        target's u when ``rows`` is None."""
        key = self.key(target, BASE)
        if self.kernel_base(target):
            if rows is None:
                return draw_kernel.draw(True, key, target.rows, target.work_dtype, target.param.device,
                                        cols=target.rows, col_offset=target.row_offset)
            return draw_kernel.draw(True, key, len(rows) * target.cols, target.work_dtype,
                                    target.param.device, rows=rows, cols=target.cols,
                                    row_offset=target.row_offset, full_cols=target.full_cols,
                                    col_offset=target.col_offset).view(len(rows), target.cols)
        if rows is None:
            counter = target.row_offset + torch.arange(target.rows, device=target.param.device)
            return standard_normal(key, counter, target.work_dtype)
        return base_rows(key, rows, target.cols, target.work_dtype, row_offset=target.row_offset,
                         col_offset=target.col_offset, full_cols=target.full_cols)

    def signs(self, target, kind: int, batch: int, first: int = 0) -> torch.Tensor:
        """(batch × size) signs of ``kind`` (ROW: rows or a vector's elements, COL: columns)
        of global examples first, ..., first + batch - 1."""
        cache_key = (target.name, kind, batch, first)
        cached = self._signs.get(cache_key)
        if cached is None:
            if kind == ROW:
                size, offset, full = target.rows, target.row_offset, target.full_rows
            else:
                size, offset, full = target.cols, target.col_offset, target.full_cols
            key, device = self.key(target, kind), target.param.device
            if kernels_for(device) and fits_one_stream((first + batch - 1) * full + offset + size - 1):
                cached = draw_kernel.draw(False, key, batch * size, target.work_dtype, device, cols=size,
                                          row_offset=first, full_cols=full, col_offset=offset).view(batch, size)
            else:
                cached = example_signs(key, batch, size, target.work_dtype, device,
                                       offset=offset, full_size=full, first=first)
            self._signs[cache_key] = cached
        return cached
