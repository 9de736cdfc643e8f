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

from .. import q8

NUM_SLOTS = 3
NUM_SCALARS = 8
STATE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Adam's bias corrections ``1 - beta1**step`` and ``sqrt(1 - beta2**step)``, in float64.

    The one place bias corrections are computed; every Adam-type rule calls it.
    """
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def check_real(name: str, value, *, low: float = -math.inf, high: float = math.inf,
               low_open: bool = False, high_open: bool = False, why: str = "") -> float:
    """Return ``value`` as a float or raise a ValueError naming the bad hyperparameter
    (and ``why`` the range is what it is, when given)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} is outside {lo}{low}, {high}{hi}" + (f": {why}" if why else ""))
    return value


def check_eps(value) -> float:
    """A denominator's ``eps``, which must be > 0: with 0, one gradient element that is 0
    where its state is 0 divides 0 by 0 (the step then stops with a non-finite update)."""
    return check_real("eps", value, low=0.0, low_open=True,
                      why="eps must be > 0 (it keeps the update's denominator from 0 where a gradient "
                          "element and its state are 0)")


def recorded_hyperparameters(rule) -> dict:
    """``rule``'s hyperparameters as a checkpoint records them (as JSON reads them back:
    numbers as floats, pairs as lists), all but ``lr``, which schedulers own: a resumed
    run's scheduler or ``fk.Trainer``'s optimizer sets it. Fused layers' and ChunkFT's
    checkpoints both compare rules by these, so momentum=0 and momentum=0.0 are one rule."""
    return {name: _plain(value) for name, value in rule.hyperparameters().items() if name != "lr"}


def _plain(value):
    """A hyperparameter as JSON keeps it: bools and strings as they are, other numbers as
    floats (momentum=0 is momentum=0.0), sequences as lists, anything else by its repr."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return repr(value)


def shown_hyperparameters(hyperparameters: dict, names=None) -> str:
    """``name=value, ...`` for ``names`` (default: all), lists shown as the tuples they were."""
    names = list(hyperparameters) if names is None else names
    return ", ".join(f"{name}={_as_given(hyperparameters[name])!r}" if name in hyperparameters else f"no {name}"
                     for name in names)


def _as_given(value):
    return tuple(_as_given(item) for item in value) if isinstance(value, list) else value


class Rule:
    """Base class of element-wise optimizer rules; subclasses live one per file."""

    #: the rule's ``@triton.jit`` update function (see the module docstring)
    update = None

    #: slots that only ever hold values >= 0 (q8 stores them with the unsigned map)
    nonnegative = ()

    #: True when one step is a linear map of (weight, state, gradient) together, so a
    #: step on a gradient sum is the sum of steps (forge_kernels.token_split)
    linear = False

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
        stored as ``state_format``: "fp32", "bf16", or "q8" (uint8 codes plus an int8
        exponent per block, ``forge_kernels.q8``; the slot's exponents are the entry
        ``<slot>_exponent``). The rule computes in fp32 in every format."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"init_state expects the weight tensor, got {type(weight).__name__}")
        if state_format not in (*STATE_FORMATS, "q8"):
            raise ValueError(f"state_format must be one of {(*STATE_FORMATS, 'q8')}, got {state_format!r}")
        if state_format != "q8":
            return {name: torch.full_like(weight, self.initial_value(name), dtype=STATE_FORMATS[state_format],
                                          memory_format=torch.contiguous_format)
                    for name in self.slots}
        if weight.dim() != 2:
            raise ValueError(f"q8 state is laid out for 2-D weights, got shape {tuple(weight.shape)}")
        state = {}
        for name in self.slots:
            # Every element starts at the same value, so every block encodes alike: encode one
            # block on the host and fill (the whole weight through numpy took seconds per layer).
            block = torch.full((1, q8.BLOCK), self.initial_value(name), dtype=torch.float32)
            codes, exponents = q8.encode(block, signed=name not in self.nonnegative)
            state[name] = torch.full(weight.shape, int(codes[0, 0]), dtype=torch.uint8, device=weight.device)
            state[name + q8.EXPONENT_SUFFIX] = torch.full(q8.exponent_shape(weight.shape), int(exponents[0, 0]),
                                                          dtype=torch.int8, device=weight.device)
        return state

    def state_format(self, state: dict) -> str:
        """"fp32", "bf16" or "q8": the format of a state made by ``init_state``."""
        if not self.slots:
            return "fp32"
        dtype = state[self.slots[0]].dtype
        return "q8" if dtype == torch.uint8 else {v: k for k, v in STATE_FORMATS.items()}.get(dtype, str(dtype))

    def initial_value(self, slot: str) -> float:
        """The value a fresh state slot starts from (0 unless a rule says otherwise)."""
        return 0.0

    def check_state(self, state, weight: torch.Tensor) -> None:
        """Raise a clear error unless ``state`` is this rule's state for ``weight``."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of tensors (from {type(self).__name__}.init_state), "
                            f"got {type(state).__name__}")
        q8_state = bool(self.slots) and isinstance(state.get(self.slots[0]), torch.Tensor) and \
            state[self.slots[0]].dtype == torch.uint8
        expected = set(self.slots) | ({name + q8.EXPONENT_SUFFIX for name in self.slots} if q8_state else set())
        got = set(state)
        if expected != got:
            raise ValueError(f"state has slots {sorted(got)} but {self!r} keeps {sorted(expected)}; "
                             "was it made by another rule or another configuration of this one?")
        for name in sorted(expected):
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"state[{name!r}] is {type(tensor).__name__}, not a tensor")
            if tensor.device != weight.device:
                raise ValueError(f"state[{name!r}] is on {tensor.device}, the weight on {weight.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"state[{name!r}] must be contiguous (it is written in place)")
        for name in self.slots:
            tensor = state[name]
            if q8_state:
                if tensor.dtype != torch.uint8:
                    raise TypeError(f"state[{name!r}] is {tensor.dtype}; q8 codes are uint8")
                exponents = state[name + q8.EXPONENT_SUFFIX]
                if exponents.dtype != torch.int8 or tuple(exponents.shape) != q8.exponent_shape(weight.shape):
                    raise ValueError(f"state[{name + q8.EXPONENT_SUFFIX!r}] must be int8 of shape "
                                     f"{q8.exponent_shape(weight.shape)}, got {exponents.dtype} "
                                     f"{tuple(exponents.shape)}")
            elif tensor.dtype not in STATE_FORMATS.values():
                raise TypeError(f"state[{name!r}] is {tensor.dtype}; state is stored as float32 or bfloat16")
            if tensor.dtype != state[self.slots[0]].dtype:
                raise TypeError(f"state slots mix dtypes ({state[self.slots[0]].dtype} and {tensor.dtype}); "
                                "all slots share one format")
            if tensor.shape != weight.shape:
                raise ValueError(f"state[{name!r}] has shape {tuple(tensor.shape)}, "
                                 f"the weight {tuple(weight.shape)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"
