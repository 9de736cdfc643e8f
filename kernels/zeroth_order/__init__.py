"""Zeroth-order fine-tuning: GRZO (per-example Flipout perturbations through forward
hooks, weights never touched by the forwards) and its baseline MeZO (one shared Gaussian
direction, in place). Draws are counter-based (``draws``): a pure function of
(seed, call, parameter name, global element index), so a tensor-parallel shard
(``Shard``) draws the slice of the whole's and a data-parallel rank the draws of its
global examples."""

from .grzo import GRZO, ZerothOrderStep
from .mezo import MeZO
from .targets import Shard

__all__ = ["GRZO", "MeZO", "Shard", "ZerothOrderStep"]
