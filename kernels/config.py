"""Tile configurations of the fused weight-update kernel, as data.

Exactness needs every element of dW to be reduced over the tokens in the same
order on both paths being compared. The token block ``block_t`` is part of that
order (see proofs/fp32_exactness.md), so the library never chooses a config from
the problem's shape: callers pass one explicitly or get ``PINNED``.
"""

from dataclasses import dataclass
from typing import Optional

_TILE_SIZES = (16, 32, 64, 128, 256)
KERNELS = ("portable", "hopper")
EPILOGUE_AXES = ("columns", "rows")
EPILOGUE_STAGES = (1, 2, 3, 4)
DEFAULT_EPILOGUE_STAGES = 2
OPERAND_LOADS = ("pointers", "tma")
# The True-or-False fields only the split Hopper kernel takes, and what it does with each.
_SPLIT_KERNEL_FLAGS = {"wgmma_in_flight": "runs its token loop on wgmma with a block in flight; leave it False here",
                       "in_kernel_check": "checks its inputs itself; leave it False here (the separate check runs)"}


@dataclass(frozen=True)
class TileConfig:
    """One (BLOCK_N x BLOCK_K) tile of dW per program, tokens consumed BLOCK_T at a time;
    the rule's epilogue runs on ``epilogue_split`` slices of the tile in turn (the unit in
    which a non-finite result is skipped and reported), column slices or, with
    ``epilogue_axis="rows"``, row slices (``part_shape``). Slicing changes no bit of a
    finite step; it sets what one skip covers.

    ``kernel`` picks the fused kernel: ``"portable"``, the Triton kernel that runs on any
    GPU and in the interpreter (the reference), or ``"hopper"``, the persistent
    warp-specialized kernel for sm_90 GPUs (``ops/hopper_update.py``), which computes
    the portable kernel's function bit for bit at the same (block_n, block_k, block_t).
    A hopper config has tiles of 32, 64 or 128 columns, ``num_stages`` 2-8 buffers of its
    token loop and no register cap; ``num_warps`` picks its structure: 4, two consumer
    warpgroups in ping-pong on 64-row tiles, whose epilogue runs on column parts of 32 or
    64, or 8, a matrix warpgroup per 64 rows of a 64- or 128-row tile feeding eight
    epilogue warps, on column parts of 32 or 64 (16 on 128-row tiles) or on row parts of
    at least 16 rows and 1,024 elements (whole rows of the tile, which its TMA copies and
    stores read and write in runs of the tile's width: measured faster on an H200), or
    16, the same split structure with sixteen epilogue warps, on tiles of 32 or 64
    columns and row parts of at least 2,048 elements (a 128-column tile's wgmma needs
    more registers than a thread gets beside sixteen epilogue warps; compiled offline
    for sm_90, benchmarks/results/tuning/ptxas-split-16-warps-3.9.txt). Its
    oracle (``oracle=True``) and ``apply_rule`` run the portable kernels with the same
    tile and slices.

    ``epilogue_stages`` is how many parts' weight and state the split kernel's TMA warp
    stages ahead in shared memory (part p of a program in slot p % epilogue_stages, each
    refilled once the epilogue warps have read it); None is its default, 2. Only the split
    kernel takes it; it moves no bit (the staging order and the arithmetic are the same).

    ``operand_loads`` is how the portable kernel reads its dy and x blocks: ``"pointers"``
    (masked loads, any strides) or ``"tma"`` (tensor descriptors: on a GPU, copies by
    the Tensor Memory Accelerator of sm_90 and later, with zero fill past the edges, where
    the masked loads fill zeros too; in the interpreter, the descriptors' reads). The
    blocks, their order and the ``tl.dot`` over them are the same, so it moves no bit; it
    needs unit column strides, rows a multiple of 16 bytes apart and 16-byte aligned
    starts, and is refused otherwise (compiled, also below sm_90). Only the fused launch
    reads this way: the oracle (``oracle=True``), ``weight_gradient``, its norms and sums
    and ``materialized_split_step`` read by pointers whatever the config says (the same
    bits), so they take operands and GPUs the TMA loads refuse. Measured on an H200 with
    128 x 256 tiles of 16 warps at 16,384 tokens: 1.01-1.12x faster than the same tiles
    with pointer loads (benchmarks/results/tuning/h200-tma-operand-loads.log, call 5). The
    Hopper kernel always reads its operands by TMA.

    ``wgmma_in_flight`` makes the split kernel's matrix warpgroups leave each token block's
    wgmma running while they wait for the next block and issue it, and release a ring
    stage one block later (so the ring wants a stage more); without it they wait for each
    block's wgmma before the next. The same wgmma in the same order on the same
    accumulator: it moves no bit. Measured on an H100 with a four-stage ring, kernel alone
    against the three-stage tile without it (the log:
    benchmarks/results/tuning/h100-wgmma-in-flight-four-stages-3db4b79.log): with fp32
    state 1.04-1.10x faster at 2,048 tokens and 1.08-1.17x at 4,096-12,288, with bf16
    state rounded to nearest 1.02-1.15x at 4,096; mostly slower at 1,024 (and with bf16
    state at 2,048); with three stages slower at 4,096 (0.93-0.97x: the stage held a
    block longer leaves the TMA warp one stage to fill ahead). Only the split kernel
    takes it.

    ``in_kernel_check`` folds the non-finite input check into the split kernel: instead of
    a kernel of its own launched before the update (a second read of x and dy), the
    epilogue warps, idle while the matrix warpgroups run the first tiles' token loops,
    count NaN and infinite elements in their program's share of x and dy, and no epilogue
    stores anything before every program has counted (a grid barrier; the kernel is then
    a cooperative launch, which the driver refuses rather than deadlocks when its programs
    cannot all be resident). The rule and the counts are the separate check's (each
    element counted once), and it moves no bit of a finite step. Only the split kernel
    takes it; ``oracle=True`` still launches the separate check. With it off the split
    kernel's SASS is unchanged (benchmarks/results/tuning/sass-in-kernel-check-3.9.txt).
    Measured on an H100, the captured step with it runs at 0.98-1.03x the speed of the
    step with the separate check in fp32 and 0.94-0.99x in bf16-SR: the folded read
    costs about what the check kernel cost, and more in bf16-SR
    (benchmarks/results/tuning/h100-in-kernel-check-3e7e768.log), so no tuned entry
    sets it."""

    block_n: int = 64
    block_k: int = 64
    block_t: int = 32
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: Optional[int] = None
    epilogue_split: int = 1
    kernel: str = "portable"
    epilogue_axis: str = "columns"
    epilogue_stages: Optional[int] = None
    operand_loads: str = "pointers"
    wgmma_in_flight: bool = False
    in_kernel_check: bool = False

    def __post_init__(self):
        # A float or bool equal to an allowed value passes the membership checks below and
        # fails later, inside an allocation or the launch.
        for name in ("block_n", "block_k", "block_t", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"TileConfig.{name}={value!r}: must be an int, not {type(value).__name__}")
        for name in ("block_n", "block_k", "block_t"):
            value = getattr(self, name)
            if value not in _TILE_SIZES:
                raise ValueError(f"TileConfig.{name}={value!r}: must be one of {_TILE_SIZES} "
                                 "(a power of two of at least 16, the smallest tl.dot tile)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps={self.num_warps!r}: must be 1, 2, 4, 8 or 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"TileConfig.num_stages={self.num_stages!r}: must be in 1..8")
        if self.maxnreg is not None and (type(self.maxnreg) is not int or self.maxnreg not in range(32, 256, 8)):
            raise ValueError(f"TileConfig.maxnreg={self.maxnreg!r}: must be None (the compiler's choice) or a "
                             "multiple of 8 in 32..248 (registers per thread, ptxas -maxrregcount)")
        if self.epilogue_axis not in EPILOGUE_AXES:
            raise ValueError(f"TileConfig.epilogue_axis={self.epilogue_axis!r}: must be one of {EPILOGUE_AXES}")
        sliced = self.block_n if self.epilogue_axis == "rows" else self.block_k
        if type(self.epilogue_split) is not int or self.epilogue_split not in (1, 2, 4, 8) or \
                sliced // self.epilogue_split < _TILE_SIZES[0]:
            raise ValueError(f"TileConfig.epilogue_split={self.epilogue_split!r}: must be 1, 2, 4 or 8, leaving "
                             f"{self.epilogue_axis[:-1]} slices of at least {_TILE_SIZES[0]} "
                             f"({'block_n' if self.epilogue_axis == 'rows' else 'block_k'}={sliced})")
        if self.kernel not in KERNELS:
            raise ValueError(f"TileConfig.kernel={self.kernel!r}: must be one of {KERNELS}")
        if self.epilogue_stages is not None and (type(self.epilogue_stages) is not int
                                                 or self.epilogue_stages not in EPILOGUE_STAGES):
            raise ValueError(f"TileConfig.epilogue_stages={self.epilogue_stages!r}: must be None (the split "
                             f"kernel's default, {DEFAULT_EPILOGUE_STAGES}) or one of {EPILOGUE_STAGES}")
        if self.operand_loads not in OPERAND_LOADS:
            raise ValueError(f"TileConfig.operand_loads={self.operand_loads!r}: must be one of {OPERAND_LOADS}")
        for name, what in _SPLIT_KERNEL_FLAGS.items():
            value = getattr(self, name)
            if type(value) is not bool:
                raise TypeError(f"TileConfig.{name}={value!r}: must be True or False")
            if value and not (self.kernel == "hopper" and self.num_warps in (8, 16)):
                raise ValueError(f"TileConfig.{name}=True: only the split Hopper kernel (kernel='hopper', "
                                 f"num_warps=8 or 16) {what}")
        if self.kernel == "hopper":
            self._check_hopper()
        elif self.epilogue_stages is not None:
            raise ValueError(f"TileConfig.epilogue_stages={self.epilogue_stages!r}: only the split Hopper kernel "
                             "(kernel='hopper', num_warps=8 or 16) stages parts ahead; leave it None for the portable "
                             "kernel")

    @property
    def staging_slots(self) -> int:
        """How many parts the split Hopper kernel stages ahead (``epilogue_stages``, or its default)."""
        return DEFAULT_EPILOGUE_STAGES if self.epilogue_stages is None else self.epilogue_stages

    @property
    def part_shape(self) -> tuple:
        """(rows, columns) of one epilogue slice of a tile."""
        if self.epilogue_axis == "rows":
            return self.block_n // self.epilogue_split, self.block_k
        return self.block_n, self.block_k // self.epilogue_split

    def _check_hopper(self):
        """The shapes the Hopper kernel is built for: 64 rows of wgmma per matrix
        warpgroup (one per ping-pong consumer; one or two in the split kernel), its weight
        and state staged in shared memory one part at a time (column parts of 16-64; row
        parts in the split kernel, of at least four elements per epilogue thread, so that
        its layout covers the part without repeating), and 4 warps (ping-pong consumers)
        or 8 or 16 (split epilogue warps; with 16, at most 64 columns: ptxas gives each
        thread 72-80 registers there, and an m64n128 wgmma needs 90)."""
        part_rows, part = self.part_shape
        if self.epilogue_axis == "rows" and self.epilogue_split > 1:  # one slice is the whole tile either way
            parts_ok = self.num_warps in (8, 16) and part_rows * part >= 4 * 32 * self.num_warps
            parts_rule = (f"such that a row part (block_n / epilogue_split x block_k) has at least four elements "
                          f"per epilogue thread (1,024 with num_warps=8, 2,048 with 16), with num_warps=8 or 16, "
                          f"not {part_rows} x {part}")
        else:
            parts_ok = part in (32, 64) or (part == 16 and self.block_n == 128)
            parts_rule = (f"such that block_k / epilogue_split is 32 or 64 (or 16 with block_n=128), "
                          f"not {part}")
        wrong = [f"{name}={getattr(self, name)!r} (must be {allowed})" for name, allowed, ok in (
            ("block_n", "64, or 128 with num_warps=8 or 16",
             self.block_n == 64 or (self.block_n == 128 and self.num_warps in (8, 16))),
            ("block_k", "32, 64 or 128 (32 or 64 with num_warps=16)",
             self.block_k in (32, 64) or (self.block_k == 128 and self.num_warps != 16)),
            ("block_t", "32, 64 or 128", self.block_t in (32, 64, 128)),
            ("num_warps", "4, 8 or 16", self.num_warps in (4, 8, 16)),
            ("num_stages", "2-8", 2 <= self.num_stages <= 8),
            ("maxnreg", "None", self.maxnreg is None),
            ("epilogue_split", parts_rule, parts_ok),
            ("epilogue_stages", "None with num_warps=4 (the ping-pong kernel stages one part per consumer)",
             self.epilogue_stages is None or self.num_warps in (8, 16)),
            ("operand_loads", "left at 'pointers': the Hopper kernel reads its operands by TMA whatever it says",
             self.operand_loads == "pointers")) if not ok]
        if wrong:
            raise ValueError("TileConfig(kernel='hopper'): " + "; ".join(wrong))

    def launch_options(self) -> dict:
        """Keyword options for launching a kernel with this config.

        Floating-point contraction is always off. With it on, the compiler fuses a
        multiply and an add into one FMA in some kernels and not in others (seen on an
        H200: the same rule code contracted differently in the fused and the oracle
        kernel, and for different BLOCK_K), which moves bits between paths that must
        agree. With it off every operation rounds once, as written, on every backend.

        ``maxnreg`` caps the registers per thread (more resident programs per SM, at the
        risk of spills); it changes scheduling, never the arithmetic. The interpreter
        ignores it.
        """
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages, enable_fp_fusion=False)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


PINNED = TileConfig()
"""The config used when none is given, and the one the exactness tier pins."""
