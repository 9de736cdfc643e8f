"""Element-wise optimizer rules. Adding one is one small file: see README, "Adding a rule"."""

from .adagrad import Adagrad
from .adamw import Adam, AdamW
from .base import Rule, bias_corrections
from .lion import Lion
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["Rule", "AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad", "bias_corrections"]
