"""Zeroth-order fine-tuning: GRZO (per-example Flipout perturbations through forward
hooks, weights never touched by the forwards) and its baseline MeZO (one shared Gaussian
direction, in place). Draws are counter-based (``draws``): a pure function of
(seed, call, parameter name, global element index)."""

from .grzo import GRZO, ZerothOrderStep
from .mezo import MeZO

__all__ = ["GRZO", "MeZO", "ZerothOrderStep"]
