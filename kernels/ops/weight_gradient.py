"""The weight gradient dW = dyᵀ x, tile by tile: the loop the fused kernel runs, and
the materialized gradient that the oracle path (and ``weight_gradient``) stores."""

import torch
import triton
import triton.language as tl

from .._backend import INTERPRETED, on_device, quiet_non_finite
from ..config import PINNED, TileConfig
from .validation import check_activations


@triton.jit
def _weight_grad_tile(x_ptr, dy_ptr, T, stride_xt, stride_xk, stride_dyt, stride_dyn,
                      offs_n, offs_k, mask_n, mask_k,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                      x_desc=None, dy_desc=None, n0=0, k0=0,
                      TMA: tl.constexpr = False):
    """One (BLOCK_N, BLOCK_K) tile of dYᵀX, reduced over all T tokens in BLOCK_T chunks.

    The token loop runs in one fixed order, so each element's reduction order depends
    on BLOCK_T and the backend, never on which path (fused or oracle) runs it.
    Compiled, the accumulator is threaded through ``tl.dot`` (never ``acc += dot``).
    Interpreted, ``tl.dot`` would be a numpy matmul, whose BLAS rounds an element's sum
    differently by its place in the block and by CPU; instead each block is summed here,
    sum over t of dy[t, n] * x[t, k]: each product rounded to fp32 (exact for bf16
    operands), added left to right in token order from the first, every addition
    rounded once. Element (n, k) then reads only column n of dy and column k of x: no
    BLAS, no dependence on its place in the tile, BLOCK_N, BLOCK_K, the CPU or the thread
    count (proofs/interpreter_reduction.md). The running sums are a cumulative sum along
    the token axis (numpy's add.accumulate: each prefix is the previous one plus the next
    term); the last prefix is picked by a sum in which every other term is +0, exact in
    any order. Written inline: every interpreted call of a jitted helper costs about a
    millisecond.

    With ``TMA`` the blocks are read through the tensor descriptors ``x_desc`` and
    ``dy_desc`` (the tile's first row ``n0`` and column ``k0``), which fill zeros past
    the edges where the masked loads do: the same blocks, hence the same bits
    (``TileConfig.operand_loads``).
    """
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    last = (tl.arange(0, BLOCK_T) == BLOCK_T - 1)[:, None, None]
    for t0 in range(0, T, BLOCK_T):
        if not TMA:  # the descriptors bound their reads themselves
            offs_t = t0 + tl.arange(0, BLOCK_T)
            mask_t = offs_t < T
        if INTERPRETED:
            if TMA:
                dy_rows = dy_desc.load([t0, n0]).to(tl.float32)
                x_rows = x_desc.load([t0, k0]).to(tl.float32)
            else:
                dy_rows = tl.load(dy_ptr + offs_t[:, None] * stride_dyt + offs_n[None, :] * stride_dyn,
                                  mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
                x_rows = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                                 mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            # tl.cumsum and tl.sum, called through their builtins: the jitted wrappers cost
            # the interpreter ~1 ms each per call; the sum combine is the interpreter's
            # numpy cumsum / sum.
            prefixes = tl.associative_scan(dy_rows[:, :, None] * x_rows[:, None, :], 0, tl.standard._sum_combine)
            acc = acc + tl.reduce(tl.where(last, prefixes, 0.0), 0, tl.standard._sum_combine)
        elif TMA:
            dy_block = dy_desc.load([t0, n0])
            x_block = x_desc.load([t0, k0])
            acc = tl.dot(dy_block.T, x_block, acc, input_precision="ieee")
        else:
            dy_tile = tl.load(dy_ptr + offs_n[:, None] * stride_dyn + offs_t[None, :] * stride_dyt,
                              mask=mask_n[:, None] & mask_t[None, :], other=0.0)
            x_tile = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                             mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            # "ieee": full fp32 products on GPU rather than TF32 (ignored for bf16 operands).
            acc = tl.dot(dy_tile, x_tile, acc, input_precision="ieee")
    return acc


@triton.jit
def _weight_grad_kernel(x_ptr, dy_ptr, grad_ptr, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Oracle, first half: the same tile loop, its fp32 result stored as dW."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    g = _weight_grad_tile(x_ptr, dy_ptr, T, stride_xt, stride_xk, stride_dyt, stride_dyn,
                          offs_n, offs_k, mask_n, mask_k, BLOCK_N, BLOCK_K, BLOCK_T)
    tl.store(grad_ptr + offs_n[:, None] * K + offs_k[None, :], g, mask=mask_n[:, None] & mask_k[None, :])


def launch_weight_gradient(x, dy, config: TileConfig) -> torch.Tensor:
    """Launch ``_weight_grad_kernel`` on validated inputs; returns the fp32 (N, K) gradient."""
    T, K = x.shape
    N = dy.shape[1]
    grad = torch.empty((N, K), dtype=torch.float32, device=x.device)
    if N == 0 or K == 0:
        return grad
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(K, config.block_k))
    _weight_grad_kernel[grid](x, dy, grad, T, N, K, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                              BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_T=config.block_t,
                              **config.launch_options())
    return grad


def weight_gradient(x, dy, *, config=None):
    """dW = dyᵀ x as an fp32 (N, K) tensor: bitwise the gradient tile that
    ``fused_weight_update`` hands its rule for the same ``config``."""
    config = PINNED if config is None else config
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a forge_kernels.TileConfig, got {type(config).__name__}")
    check_activations(x, dy)
    with on_device(x.device), quiet_non_finite():
        return launch_weight_gradient(x, dy, config)
