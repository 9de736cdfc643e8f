"""Which layers go GIFT's route: the ones whose gradients hit an FP8 format's range limits
most during a warm-up window (the paper: the layers that hit FP8's limits most over the
first 100 steps), chosen identically on every rank.

A *range hit* is an element of a gradient that plain per-tensor current scaling (scale =
format max / the tensor's own amax, in fp32) pushes out of the format's normal range:
nonzero with |fl(x · scale)| below the smallest normal value (it lands on a subnormal
code or on zero, losing relative precision or all of it). Nothing leaves the range at the
top: current scaling maps the amax onto the largest value, up to the scale's rounding
(|fl(x · scale)| ≤ max (1 + u)², which still encodes as max: proofs/gift.md, section 1),
so the count is the underflow count, and it grows with the dynamic range of the tensor
(measured for E4M3: a Gaussian 1000 × 1000 tensor has 1.3e-4 of its elements out of
range, one whose columns' scales span 8 decades 0.55).

Each rank counts its own gradients (no collective per step). When the window closes,
the counts are SUM-all-reduced once, so every rank ranks the same numbers; candidates are
ranked by hits per element counted (a layer's size does not buy it a place), ties by
their order in ``candidates``, and the first ``count`` are selected and frozen.
"""

from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from .._collectives import wire_device
from . import e4m3, e5m2

#: the formats whose range a selection can count (NVFP4's block scales have no single range)
COUNTED_FORMATS = {"e4m3": e4m3.FORMAT, "e5m2": e5m2.FORMAT}


def range_hits(x: torch.Tensor, fmt: str) -> int:
    """Elements of ``x`` below ``fmt``'s normal range under ``x``'s own current scale (none
    can be above it: the module docstring)."""
    form = COUNTED_FORMATS[fmt]
    scale = form.scale_for(form.tensor_amax(x))
    scaled = (x.detach().to(torch.float32) * scale).abs()
    return int(((scaled < torch.finfo(form.dtype).smallest_normal) & (x != 0)).sum())


class RangeHitSelection:
    """Pass as ``GiftState(..., layers=RangeHitSelection(candidates, count, warmup_steps))``.

    ``candidates``: the ``nn.Linear`` modules to choose from (for example every MLP output
    layer); ``count``: how many to select; ``warmup_steps``: the window, in optimizer
    steps, before the selection freezes (the selected layers join GIFT's route at step
    ``warmup_steps`` and take their first transform then); ``fmt``: the FP8 format whose
    range is counted (None: the state's wire format, which must then be E4M3 or E5M2).
    During the window every candidate travels the state's unselected route."""

    def __init__(self, candidates, count: int, warmup_steps: int = 100, fmt: str | None = None):
        self.candidates = list(candidates)
        for layer in self.candidates:
            if not isinstance(layer, nn.Linear):
                raise TypeError(f"GIFT candidates must be nn.Linear, got {type(layer).__name__}")
        if len({id(layer) for layer in self.candidates}) != len(self.candidates):
            raise ValueError("a candidate is listed twice")
        for name, value, low in (("count", count, 1), ("warmup_steps", warmup_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if count > len(self.candidates):
            raise ValueError(f"count {count} exceeds the {len(self.candidates)} candidates")
        if fmt is not None and fmt not in COUNTED_FORMATS:
            raise ValueError(f"range hits are counted for {sorted(COUNTED_FORMATS)}, got {fmt!r}")
        self.count, self.warmup_steps, self.fmt = count, warmup_steps, fmt
        self._index_of_weight = {id(layer.weight): i for i, layer in enumerate(self.candidates)}
        #: this rank's counts so far: hits and elements counted, per candidate
        self.local_hits = [0] * len(self.candidates)
        self.local_elements = [0] * len(self.candidates)
        #: after freezing: the all-reduced counts and the selected candidates' indices
        self.total_hits = None
        self.selected = None

    def bind(self, wire_format: str) -> None:
        """Called by ``GiftState``: settle the counted format."""
        if self.fmt is None:
            if wire_format not in COUNTED_FORMATS:
                raise ValueError(f"the wire format {wire_format!r} has no FP8 range to count: pass "
                                 f"RangeHitSelection(..., fmt='e4m3' or 'e5m2')")
            self.fmt = wire_format

    @property
    def frozen(self) -> bool:
        return self.selected is not None

    def candidate_index(self, parameter):
        return self._index_of_weight.get(id(parameter))

    def observe(self, parameter, grad: torch.Tensor) -> None:
        """Count ``grad``'s range hits if ``parameter`` is a candidate's weight (before freezing)."""
        index = self.candidate_index(parameter)
        if index is None or self.frozen or not bool(torch.isfinite(grad).all()):
            return  # a non-finite gradient is refused by the exchange, on every rank together
        self.local_hits[index] += range_hits(grad, self.fmt)
        self.local_elements[index] += grad.numel()

    def freeze(self, group=None) -> list:
        """All-reduce the counts (SUM over ``group``), select, and return the selected layers."""
        device = wire_device(group) if dist.is_initialized() else torch.device("cpu")
        counts = torch.tensor([self.local_hits, self.local_elements], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        hits, elements = counts.tolist()
        self.total_hits = hits
        rate = [Fraction(h, e) if e else Fraction(0) for h, e in zip(hits, elements)]
        order = sorted(range(len(self.candidates)), key=lambda i: (-rate[i], i))
        self.selected = sorted(order[:self.count])
        return [self.candidates[i] for i in self.selected]

    def state_dict(self) -> dict:
        return {"local_hits": list(self.local_hits), "local_elements": list(self.local_elements),
                "total_hits": None if self.total_hits is None else list(self.total_hits),
                "selected": None if self.selected is None else list(self.selected)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["local_hits"]) != len(self.candidates):
            raise ValueError(f"the state holds {len(state['local_hits'])} candidates, this selection "
                             f"{len(self.candidates)}")
        self.local_hits, self.local_elements = list(state["local_hits"]), list(state["local_elements"])
        self.total_hits = None if state["total_hits"] is None else list(state["total_hits"])
        self.selected = None if state["selected"] is None else list(state["selected"])
