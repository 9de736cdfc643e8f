"""Chunk planning: every trainable tensor, in ``named_parameters()`` order, is laid end
to end in one byte stream (its own bytes plus its optimizer state's), and the stream is
cut into ``chunks`` equal budgets. A cut falls inside a tensor, on a whole row (dim 0)
or column (dim 1); 1-D tensors and embeddings are always cut along dim 0.

Bytes are counted in 1/32 of a byte, so that q8 state (one code per element and one
exponent per 32 elements of a row, per slot) costs a whole number of units and the
budget arithmetic is exact integer arithmetic.
"""

from dataclasses import dataclass

from .. import q8

SPLITS = ("rows", "cols")
#: the unit of the byte stream: 1/32 byte
UNITS_PER_BYTE = 32
_STATE_UNITS = {"fp32": 4 * UNITS_PER_BYTE, "bf16": 2 * UNITS_PER_BYTE, "q8": UNITS_PER_BYTE + 1}


@dataclass(frozen=True)
class Slice:
    """Elements ``start:stop`` along ``dim`` of the parameter ``name`` (all of the other dim)."""

    name: str
    dim: int
    start: int
    stop: int

    def as_tuple(self) -> tuple:
        return (self.name, self.dim, self.start, self.stop)


@dataclass(frozen=True)
class TensorCost:
    """One trainable tensor in the stream: its name, shape, the dim it is cut along, the
    granule of a cut along that dim (32 columns for q8 column cuts, else 1), and the cost
    in stream units of one index along that dim (a row or a column)."""

    name: str
    shape: tuple
    dim: int
    granule: int
    units_per_index: int

    @property
    def length(self) -> int:
        return self.shape[self.dim] if self.shape else 1

    @property
    def units(self) -> int:
        return self.length * self.units_per_index


def state_units_per_element(rule, state_format: str) -> int:
    """Stream units of optimizer state per element: the rule's slots in ``state_format``."""
    if state_format not in _STATE_UNITS:
        raise ValueError(f"state_format must be one of {tuple(_STATE_UNITS)}, got {state_format!r}")
    return len(rule.slots) * _STATE_UNITS[state_format]


def tensor_costs(named_tensors, rule, state_format: str, split: str, along_rows=()):
    """The stream's entries for ``named_tensors`` ((name, tensor) in order). ``along_rows``
    names 2-D tensors always cut along dim 0 (embeddings)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    state = state_units_per_element(rule, state_format)
    costs = []
    for name, tensor in named_tensors:
        shape = tuple(int(s) for s in tensor.shape)
        if tensor.numel() == 0:
            continue  # nothing to train, nothing in the stream
        if len(shape) not in (1, 2):
            raise ValueError(f"parameter {name!r} has shape {shape}: ChunkFT cuts 1-D and 2-D tensors only")
        element = tensor.element_size() * UNITS_PER_BYTE + state
        dim = 1 if len(shape) == 2 and split == "cols" and name not in along_rows else 0
        across = shape[1 - dim] if len(shape) == 2 else 1
        # q8 blocks run along a row's columns; a 1-D tensor is stepped as one row.
        cuts_columns = dim == 1 or len(shape) == 1
        granule = q8.BLOCK if state_format == "q8" and cuts_columns else 1
        costs.append(TensorCost(name, shape, dim, granule, element * across))
    return costs


def plan_chunks(costs, chunks: int) -> list:
    """Cut the stream of ``costs`` into ``chunks`` budgets: a list, per chunk, of Slices.

    Boundary i (of chunks − 1) is the stream position ``i * total / chunks`` rounded to
    the nearest whole cut inside the tensor it falls in, so each chunk's bytes are within
    half a cut granule of each of its two ends' budget positions. A chunk left empty (the
    stream has fewer cuttable granules than chunks) is refused."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if not costs:
        raise ValueError("there are no trainable parameters to cut into chunks")
    total = sum(c.units for c in costs)
    # Exact budget positions: boundary i sits at i * total / chunks; compare scaled by chunks.
    boundaries = []  # (tensor index, index along its dim) of each inner boundary
    starts = []
    offset = 0
    for c in costs:
        starts.append(offset)
        offset += c.units
    for i in range(1, chunks):
        target_scaled = i * total  # = position * chunks
        t = 0
        while t + 1 < len(costs) and starts[t + 1] * chunks <= target_scaled:
            t += 1
        cost = costs[t]
        inside_scaled = target_scaled - starts[t] * chunks
        step = cost.units_per_index * cost.granule * chunks
        index = min(((inside_scaled * 2 + step) // (2 * step)) * cost.granule, cost.length)
        boundaries.append((t, index))
    plan = []
    position = (0, 0)
    for end in boundaries + [(len(costs) - 1, costs[-1].length)]:
        plan.append(_slices_between(costs, position, end))
        position = end
    for i, slices in enumerate(plan):
        if not slices:
            raise ValueError(f"chunks={chunks} leaves chunk {i} empty: the trainable tensors have too few "
                             "rows/columns of their byte budget; use fewer chunks")
    return plan


def _slices_between(costs, begin, end) -> list:
    """The Slices from stream point ``begin`` to ``end``, each a (tensor, index) pair."""
    (t0, i0), (t1, i1) = begin, end
    if i0 == costs[t0].length and t0 < t1:
        t0, i0 = t0 + 1, 0
    slices = []
    for t in range(t0, t1 + 1):
        cost = costs[t]
        start = i0 if t == t0 else 0
        stop = i1 if t == t1 else cost.length
        if stop > start:
            slices.append(Slice(cost.name, cost.dim, start, stop))
    return slices


def slice_units(cost: TensorCost, piece: Slice) -> int:
    return (piece.stop - piece.start) * cost.units_per_index


def view_index(piece: Slice, shape: tuple):
    """The indexing tuple of ``piece`` in a tensor of ``shape``."""
    if len(shape) == 1:
        return (slice(piece.start, piece.stop),)
    if piece.dim == 0:
        return (slice(piece.start, piece.stop), slice(None))
    return (slice(None), slice(piece.start, piece.stop))

