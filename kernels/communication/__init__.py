"""GIFT: low-precision gradient communication in whitened coordinates (issue 16),
exposed as ``forge_kernels.gift``.

Wire formats, one file each: ``e4m3`` and ``e5m2`` (per-tensor FP8, current scaling)
and ``nvfp4`` (Transformer Engine's recipe). The transform: ``whitening.Whitening``
(from a layer's input covariance) and ``whitening.CovarianceTracker`` (forward hooks).
The DDP communication hook: ``hook.GiftState`` and ``hook.gift_hook`` (wire codecs in
``codecs.py``); layer selection by range hits: ``selection.RangeHitSelection``; FORGE's
materialized data-parallel bucket path reducing through GIFT: ``split_step.GiftSplitReducer``.
"""

import torch

from . import e4m3, e5m2, nvfp4
from .hook import GiftState, gift_hook
from .selection import RangeHitSelection, range_hits
from .split_step import GiftSplitReducer
from .whitening import CovarianceTracker, Whitening, agreed_whitening

#: wire formats by name
FORMATS = {"e4m3": e4m3, "e5m2": e5m2, "nvfp4": nvfp4}


def format_module(fmt: str):
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown wire format {fmt!r}; one of {sorted(FORMATS)}") from None


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` quantized to ``fmt`` with its own scale(s) and dequantized, as fp32."""
    return format_module(fmt).round_trip(x)


__all__ = ["e4m3", "e5m2", "nvfp4", "FORMATS", "format_module", "round_trip", "Whitening", "CovarianceTracker",
           "agreed_whitening", "GiftState", "gift_hook", "RangeHitSelection", "range_hits", "GiftSplitReducer"]
