"""The one tolerance table: unit roundoffs by dtype and arithmetic unit, and the
summation bound keyed by reduction length. Every bound in the harness is built
from these numbers; proofs/reference_enclosure.md derives how.
"""

import torch

#: unit roundoff u of round-to-nearest storage/arithmetic in each dtype
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
}

#: absolute error allowed per fp32 operation near zero: the smallest normal fp32,
#: which covers gradual underflow (2^-150) and flush-to-zero alike
FP32_UNDERFLOW = 2.0**-126

#: spacing of bf16 subnormals: the largest absolute error of a bf16 store near zero
BF16_SUBNORMAL_SPACING = 2.0**-133

#: spacing of fp32 subnormals: the largest error of rounding a value into them once more
#: (a decoded q8 value in a block below 2^-126, whose exponent is clamped)
FP32_SUBNORMAL_SPACING = 2.0**-149

#: relative error per addition when fp32 tiles are accumulated, by (backend, operand dtype).
#: Round-to-nearest fp32 (FMA or separate multiply-add) everywhere except the GPU's bf16
#: tensor cores, whose accumulation aligns and truncates: one ulp, 2^-23, per addition
#: (Fasi, Higham, Mikaitis, Pranesh 2021); we allow twice that (proofs/reference_enclosure.md).
ACCUMULATION_UNIT = {
    ("interpreter", torch.float32): 2.0**-24,
    ("interpreter", torch.bfloat16): 2.0**-24,
    ("gpu", torch.float32): 2.0**-24,
    ("gpu", torch.bfloat16): 2.0**-22,
}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of n rounded operations."""
    if n * u >= 1:
        raise ValueError(f"gamma({n}, {u}) is undefined: n*u >= 1")
    return n * u / (1 - n * u)


def accumulation_rtol(backend: str, operand_dtype: torch.dtype, length: int) -> float:
    """Bound on |computed - exact| / sum|terms| of a dot product of ``length`` terms,
    in any summation order, on ``backend`` ("interpreter" or "gpu")."""
    return gamma(max(length, 1), ACCUMULATION_UNIT[(backend, operand_dtype)])


def tile_square_sum_factor(m: int) -> float:
    """1 + the relative bound on a tile's fp32 sum of ``m`` squares of exact fp32 inputs
    against its real value (proofs/gradient_norm.md): each square rounded once, the m
    squares summed in fp32 in any order (γ_{m-1}); gradual underflow aside."""
    u32 = UNIT_ROUNDOFF[torch.float32]
    return (1 + u32) * (1 + gamma(max(m - 1, 0), u32))


def gradient_norm_bound(exact_norm: float, rows: int, cols: int, block_n: int, block_k: int) -> float:
    """Bound on |weight_gradient_norm - ‖G‖₂| for the fp32 gradient G (rows x cols, its
    elements exact inputs) summed in block_n x block_k tiles, any order inside a tile and
    over the tiles (proofs/gradient_norm.md): each square rounded once in fp32, a tile's m
    squares summed in fp32 (γ_{m-1}), the tiles' sums in float64 (γ_{t-1}), the square
    root in float64 and the cast to fp32 (one rounding each); plus every square's
    gradual underflow. It assumes no tile's sum overflows fp32 (the norm is then infinite)."""
    m = min(block_n, rows) * min(block_k, cols)
    tiles = -(-rows // block_n) * -(-cols // block_k)
    u32, u64 = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[torch.float64]
    factor = tile_square_sum_factor(m) * (1 + gamma(max(tiles - 1, 0), u64))
    squares_error = exact_norm ** 2 * (factor - 1) + rows * cols * FP32_SUBNORMAL_SPACING * factor
    # |√S − N| = |S − N²| / (√S + N), and √S ≥ √(N² − D): about D / 2N; never more than √D.
    root_error = squares_error ** 0.5
    if exact_norm > 0:
        lowest_root = max(exact_norm ** 2 - squares_error, 0.0) ** 0.5
        root_error = min(squares_error / (exact_norm + lowest_root), root_error)
    return root_error * (1 + u64) * (1 + u32) + exact_norm * ((1 + u64) * (1 + u32) - 1)
