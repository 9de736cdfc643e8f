"""The norm of a linear layer's weight gradient without the gradient: ``weight_gradient_norm``.

Global-norm clipping needs every layer's ‖dW‖ before any layer steps. Taking it from a
materialized gradient (``weight_gradient`` then ``vector_norm``) costs the layer's fp32
gradient in memory, the memory the fused step exists to save. Here each program runs
the fused kernel's own tile loop (``_weight_grad_tile``: the same dW elements, bit for
bit) and keeps only its tile's sum of squares; a second launch adds the tiles' sums in
float64 in one fixed order. Extra memory: one float32 per tile and one float64.

The result is deterministic (a function of x, dy and the config) but is not
``torch.linalg.vector_norm`` of the gradient bit for bit: the squares are summed in
another order. Its distance from the exact norm of the same dW is bounded in
``proofs/gradient_norm.md`` (``forge_verify.numerics.tolerances.gradient_norm_bound``).
Under the interpreter every sum is a running sum in one order, so its bits do not depend
on the CPU (``proofs/interpreter_reduction.md``), and each tile's sum is bitwise
``square_sums`` of the materialized gradient (``tests/test_gradient_norm.py``). Compiled,
Triton sums a tile as a tree whose shape follows the tile's register layout (the
matrix instructions' for the tile loop, a load's for ``square_sums``), so there the two
agree within the bound, not necessarily in every bit.

Where a layer steps before its norm is needed (previous-norm clipping), the fused step
itself can keep the sums: ``fused_weight_update(..., square_sums=)`` fills a buffer from
``empty_square_sums`` with each tile's Σ dW² of its own gradient tile (one tile loop for
the step and the norm), and ``norm_from_square_sums`` takes the norm.
"""

import torch
import triton
import triton.language as tl

from .._backend import INTERPRETED, on_device, quiet_non_finite
from ..config import PINNED, TileConfig
from .validation import check_activations
from .weight_gradient import _weight_grad_tile

# Tiles' sums added per loop turn of the float64 total.
_SUM_BLOCK = 1024


@triton.jit
def _square_sum(g, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ g² over a (BLOCK_N, BLOCK_K) fp32 tile, each square rounded to fp32 (no FMA: the
    launch turns contraction off). Interpreted: along each row left to right, then the
    rows' sums top to bottom, as running sums whose last prefix is picked by a sum of
    zeros and itself (exact in any order), as the tile loop does; compiled: Triton's sum."""
    squares = g * g
    if INTERPRETED:
        last_k = (tl.arange(0, BLOCK_K) == BLOCK_K - 1)[None, :]
        rows = tl.reduce(tl.where(last_k, tl.associative_scan(squares, 1, tl.standard._sum_combine), 0.0), 1,
                         tl.standard._sum_combine)
        last_n = tl.arange(0, BLOCK_N) == BLOCK_N - 1
        total = tl.reduce(tl.where(last_n, tl.associative_scan(rows, 0, tl.standard._sum_combine), 0.0), 0,
                          tl.standard._sum_combine)
    else:
        total = tl.sum(tl.sum(squares, axis=1), axis=0)
    return total


@triton.jit
def _square_sums_kernel(x_ptr, dy_ptr, grad_ptr, sums_ptr, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                        FROM_GRAD: tl.constexpr):
    """One tile's Σ dW², dW from the tile loop or (``FROM_GRAD``, the reference) read
    from a materialized fp32 (N, K) gradient; stored at the tile's row-major index."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    if FROM_GRAD:
        g = tl.load(grad_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    else:
        # Rows and columns past the weight load +0 operands: their dW elements are +0.
        g = _weight_grad_tile(x_ptr, dy_ptr, T, stride_xt, stride_xk, stride_dyt, stride_dyn,
                              offs_n, offs_k, mask_n, mask_k, BLOCK_N, BLOCK_K, BLOCK_T)
    tl.store(sums_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
             _square_sum(g, BLOCK_N, BLOCK_K))


@triton.jit
def _norm_kernel(sums_ptr, norm_ptr, count, BLOCK: tl.constexpr):
    """√Σ of ``count`` fp32 values in float64: each block as running sums (its last prefix
    picked exactly; in index order under the interpreter, a tree when compiled), the
    blocks' sums added one after another. The root is taken here, where it is correctly
    rounded on every backend (numpy's under the interpreter, ``sqrt.rn.f64`` compiled);
    torch's float64 ``sqrt`` on the CPU is not (``forge_verify.numerics.interval.sqrt_rn``)."""
    offs = tl.arange(0, BLOCK)
    last = offs == BLOCK - 1
    total = tl.full((), 0.0, tl.float64)
    for start in range(0, count, BLOCK):
        block = tl.load(sums_ptr + start + offs, mask=start + offs < count, other=0.0).to(tl.float64)
        total += tl.reduce(tl.where(last, tl.associative_scan(block, 0, tl.standard._sum_combine), 0.0), 0,
                           tl.standard._sum_combine)
    tl.store(norm_ptr, tl.sqrt(total))


def _grid(N, K, config):
    return triton.cdiv(N, config.block_n), triton.cdiv(K, config.block_k)


def launch_square_sums(N, K, config, *, x=None, dy=None, grad=None, out=None) -> torch.Tensor:
    """Each tile's Σ dW² as an fp32 (tiles down, tiles across) tensor (``out``, if given,
    checked by the caller): through the tile loop from validated ``x`` and ``dy``, or
    from a contiguous fp32 ``grad``."""
    grid = _grid(N, K, config)
    from_grad = grad is not None
    a, b = (grad, grad) if from_grad else (x, dy)  # the unused operand pointers of the other source
    sums = torch.zeros(grid, dtype=torch.float32, device=a.device) if out is None else out  # every tile is written
    if N == 0 or K == 0:
        return sums
    T = 0 if from_grad else x.shape[0]
    _square_sums_kernel[grid](a, b, a, sums, T, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                              BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_T=config.block_t,
                              FROM_GRAD=from_grad, **config.launch_options())
    return sums


def check_square_sums(sums, shape, config, device) -> None:
    """A buffer ``fused_weight_update`` can fill with the tiles' sums of an (N, K) weight's
    gradient: contiguous float32, one element per ``config`` tile, on the weight's device."""
    grid = _grid(*shape, config)
    if not isinstance(sums, torch.Tensor):
        raise TypeError(f"square_sums must be a torch.Tensor (from empty_square_sums), got {type(sums).__name__}")
    if sums.dtype != torch.float32 or tuple(sums.shape) != grid or not sums.is_contiguous():
        raise ValueError(f"square_sums must be a contiguous float32 tensor of one element per tile, shape {grid} "
                         f"for a {tuple(shape)} weight and tiles of {config.block_n} x {config.block_k}; got "
                         f"{sums.dtype}, shape {tuple(sums.shape)}{'' if sums.is_contiguous() else ', not contiguous'}")
    if sums.device != device:
        raise ValueError(f"square_sums is on {sums.device}, the weight on {device}")


def empty_square_sums(shape, config=None, device=None) -> torch.Tensor:
    """A buffer for ``fused_weight_update(..., square_sums=)``: one float32 per ``config``
    tile of an (N, K) weight (``shape``), tiles down by tiles across."""
    config = _config(config)
    return torch.empty(_grid(*shape, config), dtype=torch.float32, device=device)


def norm_from_square_sums(sums: torch.Tensor) -> torch.Tensor:
    """The gradient norm whose tiles' sums of squares ``sums`` holds (as a fused step with
    ``square_sums=`` or ``weight_gradient_square_sums`` left them): √Σ, summed in float64
    as ``weight_gradient_norm`` sums, as a float32 scalar tensor. No synchronization."""
    if not isinstance(sums, torch.Tensor) or sums.dtype != torch.float32 or not sums.is_contiguous():
        raise TypeError("sums must be a contiguous float32 tensor of tile sums")
    with on_device(sums.device):
        return launch_norm(sums)


def launch_norm(sums: torch.Tensor) -> torch.Tensor:
    """√(Σ sums), the sum and its root in float64 (``_norm_kernel``), returned as a float32
    scalar tensor."""
    norm = torch.zeros((), dtype=torch.float64, device=sums.device)
    if sums.numel():
        _norm_kernel[(1,)](sums, norm, sums.numel(), BLOCK=_SUM_BLOCK, enable_fp_fusion=False)
    return norm.float()


def _config(config) -> TileConfig:
    config = PINNED if config is None else config
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a forge_kernels.TileConfig, got {type(config).__name__}")
    return config


def weight_gradient_square_sums(x, dy, *, config=None) -> torch.Tensor:
    """Each ``config`` tile's Σ dW² (fp32, tiles down by tiles across) of dW = dyᵀ x,
    from the tile loop: the gradient is never stored."""
    config = _config(config)
    check_activations(x, dy)
    with on_device(x.device), quiet_non_finite():
        return launch_square_sums(dy.shape[1], x.shape[1], config, x=x, dy=dy)


def weight_gradient_norm(x, dy, *, config=None) -> torch.Tensor:
    """‖dyᵀ x‖₂ (Frobenius) as a float32 scalar tensor on x's device, without storing the
    gradient: the fp32 dW elements ``weight_gradient`` (and the fused step) would give for
    ``config``, squared in fp32, summed per tile in fp32 and over tiles in float64. No
    synchronization. Non-finite operands give a non-finite norm."""
    return norm_from_square_sums(weight_gradient_square_sums(x, dy, config=config))


def square_sums(grad, *, config=None) -> torch.Tensor:
    """The reference for ``weight_gradient_square_sums``: each ``config`` tile's Σ g² of a
    materialized fp32 (N, K) gradient, summed by the same code."""
    config = _config(config)
    if not isinstance(grad, torch.Tensor) or grad.dim() != 2 or grad.dtype != torch.float32:
        raise TypeError(f"grad must be a 2-D float32 tensor, got {getattr(grad, 'dtype', type(grad).__name__)}")
    grad = grad.contiguous()
    with on_device(grad.device), quiet_non_finite():
        return launch_square_sums(grad.shape[0], grad.shape[1], config, grad=grad)
