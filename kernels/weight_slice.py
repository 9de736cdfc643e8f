"""Where a weight sits inside a larger one: a shard's place in the global weight.

Stochastic rounding is keyed on an element's index. A tensor-parallel shard that
passes its ``WeightSlice`` has each element keyed on its index in the *global*
weight, so the sharded update rounds exactly as the unsharded one would.
"""

from dataclasses import dataclass

from . import q8
from .ops.stochastic_round import MAX_COUNTER


def chunk_bounds(size: int, parts: int, index: int) -> tuple:
    """[start, stop) of part ``index`` of ``size`` split into ``parts`` as torch.chunk
    (and DTensor's Shard) splits it: the one place the fused layers take a shard's
    offset from, so every engine keys its rounding streams alike."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class WeightSlice:
    """The local weight is ``global[row_start:row_start + N, col_start:col_start + K]`` of
    a global weight of shape ``global_shape``."""

    row_start: int
    col_start: int
    global_shape: tuple

    def __post_init__(self):
        for name in ("row_start", "col_start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"WeightSlice.{name} must be a non-negative integer, got {value!r}")
        shape = self.global_shape
        if (not isinstance(shape, tuple) or len(shape) != 2
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)):
            raise ValueError(f"WeightSlice.global_shape must be a pair of non-negative integers, got {shape!r}")
        if shape[0] * shape[1] > MAX_COUNTER:
            raise ValueError(f"global weight {shape} has more elements than the 2**32 counters of one "
                             "stochastic-rounding stream")

    def check_fits(self, local_shape, q8_state: bool):
        """Refuse a local weight that does not fit where the slice puts it, and a q8 state
        whose blocks would straddle the global weight's blocks."""
        n, k = local_shape
        rows, cols = self.global_shape
        if self.row_start + n > rows or self.col_start + k > cols:
            raise ValueError(f"a ({n}, {k}) weight at ({self.row_start}, {self.col_start}) does not fit in the "
                             f"global {self.global_shape}")
        ends_inside = self.col_start + k < cols
        if q8_state and (self.col_start % q8.BLOCK or (ends_inside and k % q8.BLOCK)):
            raise ValueError(f"q8 state keeps blocks of {q8.BLOCK} columns: a shard of columns "
                             f"{self.col_start}:{self.col_start + k} of {cols} would split them; shard at "
                             f"multiples of {q8.BLOCK}")

    @classmethod
    def whole(cls, shape) -> "WeightSlice":
        return cls(0, 0, (int(shape[0]), int(shape[1])))
