"""What an element-wise optimizer rule is, for the fused kernel.

A rule is a small Python object holding its hyperparameters plus ONE
``@triton.jit`` function, ``update``, that both the fused path and the oracle
path call on a tile. That single function is what makes "fused == oracle"
a statement about fusion alone.

Kernel contract of ``update``::

    update(w, g, s0, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT: tl.constexpr)
        -> (w, s0, s1, s2)

* ``w``, ``g`` and the state slots are fp32 tiles; ``g`` is the fp32 gradient tile.
* ``s0..s2`` are the rule's state slots at fixed positions (``slot_layout``);
  a position the rule does not use holds zeros and its result is ignored.
* ``h0..h7`` are runtime fp32 scalars produced on the host by ``scalars(step)``.
  They are kernel arguments, not constexpr: changing ``lr`` or the step never
  recompiles.
* ``VARIANT`` is a compile-time feature flag (e.g. Nesterov momentum), the only
  constexpr a rule may use.
"""

import math
from numbers import Real

import numpy as np
import torch

NUM_SLOTS = 3
NUM_SCALARS = 8
STATE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Adam's bias corrections ``1 - beta1**step`` and ``sqrt(1 - beta2**step)``, in float64.

    The one place bias corrections are computed; every Adam-type rule calls it.
    """
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def check_real(name: str, value, *, low: float = -math.inf, high: float = math.inf,
               low_open: bool = False, high_open: bool = False) -> float:
    """Return ``value`` as a float or raise a ValueError naming the bad hyperparameter."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} is outside {lo}{low}, {high}{hi}")
    return value


class Rule:
    """Base class of element-wise optimizer rules; subclasses live one per file."""

    #: the rule's ``@triton.jit`` update function (see the module docstring)
    update = None

    @property
    def slot_layout(self) -> tuple:
        """Slot names at positions s0, s1, s2 (``None`` where unused)."""
        raise NotImplementedError

    @property
    def variant(self) -> int:
        """The compile-time feature flag passed to ``update`` as ``VARIANT``."""
        return 0

    def hyperparameters(self) -> dict:
        raise NotImplementedError

    def _host_scalars(self, step: int) -> tuple:
        """The kernel's scalars ``h0..`` for this step, in float64 (at most NUM_SCALARS)."""
        raise NotImplementedError

    def _validate(self) -> None:
        raise NotImplementedError

    @property
    def slots(self) -> tuple:
        """Names of the state slots this rule keeps, in slot order."""
        return tuple(name for name in self.slot_layout if name is not None)

    def scalars(self, step: int) -> tuple:
        """The runtime scalars for ``step``, each rounded once to fp32 on the host.

        Rounding here (rather than leaving it to the launch) makes the values the
        kernel sees explicit, so references can model them exactly.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"step must be an integer >= 1 (the first step is 1), got {step!r}")
        self._validate()
        values = tuple(self._host_scalars(int(step)))
        if len(values) > NUM_SCALARS:
            raise AssertionError(f"{type(self).__name__} produced {len(values)} scalars, "
                                 f"the kernel takes {NUM_SCALARS}")
        padded = values + (0.0,) * (NUM_SCALARS - len(values))
        with np.errstate(over="ignore"):  # an overflow to inf is reported just below
            rounded = tuple(float(np.float32(v)) for v in padded)
        for value, kernel_value in zip(padded, rounded):
            if not math.isfinite(kernel_value) or (value != 0 and kernel_value == 0):
                raise ValueError(f"{self!r} at step {step}: the kernel scalar {value!r} is not representable "
                                 f"in float32 (it becomes {kernel_value!r})")
        return rounded

    def init_state(self, weight: torch.Tensor, state_format: str = "fp32") -> dict:
        """Fresh optimizer state for ``weight``: one tensor per slot, like torch.optim's,
        stored as ``state_format`` ("fp32" or "bf16"; the rule computes in fp32 either way)."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"init_state expects the weight tensor, got {type(weight).__name__}")
        if state_format not in STATE_FORMATS:
            raise ValueError(f"state_format must be one of {tuple(STATE_FORMATS)}, got {state_format!r}")
        return {name: torch.full_like(weight, self.initial_value(name), dtype=STATE_FORMATS[state_format],
                                      memory_format=torch.contiguous_format)
                for name in self.slots}

    def initial_value(self, slot: str) -> float:
        """The value a fresh state slot starts from (0 unless a rule says otherwise)."""
        return 0.0

    def check_state(self, state, weight: torch.Tensor) -> None:
        """Raise a clear error unless ``state`` is this rule's state for ``weight``."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of tensors (from {type(self).__name__}.init_state), "
                            f"got {type(state).__name__}")
        expected, got = set(self.slots), set(state)
        if expected != got:
            raise ValueError(f"state has slots {sorted(got)} but {self!r} keeps {sorted(expected)}; "
                             "was it made by another rule or another configuration of this one?")
        for name in self.slots:
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"state[{name!r}] must be a tensor, got {type(tensor).__name__}")
            if tensor.dtype not in STATE_FORMATS.values():
                raise TypeError(f"state[{name!r}] is {tensor.dtype}; state is stored as float32 or bfloat16")
            if tensor.dtype != state[self.slots[0]].dtype:
                raise TypeError(f"state slots mix dtypes ({state[self.slots[0]].dtype} and {tensor.dtype}); "
                                "all slots share one format")
            if tensor.shape != weight.shape:
                raise ValueError(f"state[{name!r}] has shape {tuple(tensor.shape)}, "
                                 f"the weight {tuple(weight.shape)}")
            if tensor.device != weight.device:
                raise ValueError(f"state[{name!r}] is on {tensor.device}, the weight on {weight.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"state[{name!r}] must be contiguous (it is written in place)")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"
