"""forge_kernels: fused weight-gradient + optimizer-step kernels (FORGE).

Kernels run compiled on a CUDA GPU, or on the CPU through the Triton interpreter
when no GPU is present (decided once, in ``_backend``, before any kernel is defined).
"""

from . import _backend  # noqa: F401  (must run before any @triton.jit below)
from . import q8
from . import communication as gift
from ._backend import interpreting, kernel_device
from .capture import CapturedStep
from .chunkft import ChunkFT
from .config import PINNED, TileConfig
from .errors import NoStepWarning, NonFiniteInputError, NonFiniteLossError, NonFiniteUpdateError
from .linear import ForgeLinear, ForgeLinearFunction, check_updates, fuse
from .ops.fused_weight_update import apply_rule, fused_weight_update
from .ops.update_report import UpdateReport
from .ops.step_scalars import StepScalars
from .ops.stochastic_round import stochastic_round
from .ops.gradient_norm import empty_square_sums, norm_from_square_sums, weight_gradient_norm
from .ops.weight_gradient import weight_gradient
from .weight_slice import WeightSlice
from .rules import SGD, Adagrad, Adam, AdamW, Lion, RMSprop, Rule, bias_corrections
from .training import Trainer, fused_layers, unfused_parameters
from .zeroth_order import GRZO, MeZO, ZerothOrderStep

__all__ = [
    "AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad", "Rule", "bias_corrections",
    "TileConfig", "PINNED", "fused_weight_update", "apply_rule", "weight_gradient", "weight_gradient_norm",
    "empty_square_sums", "norm_from_square_sums",
    "stochastic_round", "StepScalars",
    "ForgeLinear", "ForgeLinearFunction", "fuse", "check_updates", "Trainer", "fused_layers", "unfused_parameters",
    "WeightSlice", "UpdateReport", "ChunkFT", "CapturedStep",
    "NonFiniteInputError", "NonFiniteUpdateError", "interpreting", "kernel_device", "q8", "gift",
    "GRZO", "MeZO", "ZerothOrderStep", "NonFiniteLossError", "NoStepWarning",
]
