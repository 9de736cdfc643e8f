"""Step-dependent scalars held in device memory, so that a fused step can be captured in
a CUDA graph and replayed at later steps: ``StepScalars``.

An uncaptured call passes the rule's scalars for its step (``Rule.scalars``: bias
corrections, step size, ...) and the step's Philox key (``stream_seed(seed, step)``) to
the kernel as arguments, so a graph captured from it would replay that one step's
values forever. Given a ``StepScalars`` as its ``step``, the kernels read the same
values from a small device buffer instead (8 float32 scalars and one int64 key), and
``set(step)`` rewrites the buffer before each step or replay. The values are computed by
the same host functions as an uncaptured call's, so a captured step is bitwise the
uncaptured one at the same step (checked by ``tests/test_step_scalars.py`` and by
``benchmarks/bench_update.py`` for every config it times). Like ``torch.optim``'s
``capturable=True``, the step is a device value; unlike it, the scalars are not computed
on the device (a float64 ``pow`` there need not round as the host's does), but copied
there: one asynchronous 40-byte host-to-device copy per ``set``, no synchronization.
"""

import numpy as np
import torch

from ..rules.base import NUM_SCALARS
from .stochastic_round import check_seed, stream_seed, stream_seeds

_WORDS = NUM_SCALARS + 2  # int32 words: the float32 scalars, then the int64 key


class StepScalars:
    """The scalars of ``rule`` and the Philox key of the stream ``seed`` for one step, on
    ``device``. Pass it as ``fused_weight_update``'s (or ``apply_rule``'s) ``step``, with
    the same ``rule`` and ``seed``; call ``set(step)`` before each step (before each
    replay of a graph that captured one). One buffer serves every update that shares the
    rule and the seed. Changing the rule's hyperparameters (a learning-rate schedule)
    takes effect at the next ``set``."""

    def __init__(self, rule, *, seed=0, device, words=None):
        from ..rules.base import Rule
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a forge_kernels rule, got {type(rule).__name__}")
        self.rule = rule
        self.seed = check_seed(seed)
        self.device = torch.device(device)
        # ``words``: this buffer's slice of a StepScalarsGroup's (set there, all at once).
        words = torch.zeros(_WORDS, dtype=torch.int32, device=self.device) if words is None else words
        self.words = words
        self.values = words[:NUM_SCALARS].view(torch.float32)
        self.key = words[NUM_SCALARS:].view(torch.int64)
        self.step = None

    def set(self, step) -> "StepScalars":
        """Write step ``step``'s scalars and key into the device buffer (asynchronously on
        a GPU, in stream order: kernels queued before it still read the previous step's)."""
        scalars = self.rule.scalars(step)  # validates step and the hyperparameters
        host = np.zeros(_WORDS, dtype=np.int32)
        host[:NUM_SCALARS] = np.asarray(scalars, dtype=np.float32).view(np.int32)
        host[NUM_SCALARS:] = np.asarray([stream_seed(self.seed, int(step))], dtype=np.int64).view(np.int32)
        staged = torch.from_numpy(host)
        if self.device.type == "cuda":
            self.words.copy_(staged.pin_memory(), non_blocking=True)
        else:
            self.words.copy_(staged)
        self.step = int(step)
        return self

    def check_for(self, rule, seed, device) -> None:
        """Refuse a use with another rule, seed or device than the buffer was made for, or
        before any ``set``."""
        if rule is not self.rule:
            raise ValueError("this StepScalars was made for another rule object: its scalars would be that rule's")
        if check_seed(seed) != self.seed:
            raise ValueError(f"seed={seed} differs from the StepScalars' seed {self.seed}: pass the same seed")
        if torch.device(device) != self.device and not (self.device.type == torch.device(device).type == "cuda"
                                                        and self.device.index is None):
            raise ValueError(f"StepScalars on {self.device}, the weight on {device}")
        if self.step is None:
            raise ValueError("StepScalars.set(step) was never called: there is no step to take")

    def __repr__(self) -> str:
        return f"StepScalars({self.rule!r}, seed={self.seed}, step={self.step}, device={self.device})"


class StepScalarsGroup:
    """The ``StepScalars`` of many updates that share ``rule`` (each with its own seed:
    the layers of one ``fuse``), in one device buffer: ``set(step)`` computes the rule's
    scalars once and every member's Philox key in one vectorized pass, and writes them
    with one copy, so a captured model step costs the host the same whatever its number
    of layers. ``members[i]`` is the ``StepScalars`` of ``seeds[i]``."""

    def __init__(self, rule, seeds, *, device):
        seeds = [check_seed(seed) for seed in seeds]
        self.rule, self.device = rule, torch.device(device)
        self.words = torch.zeros(len(seeds) * _WORDS, dtype=torch.int32, device=self.device)
        self.members = [StepScalars(rule, seed=seed, device=device, words=self.words[i * _WORDS:(i + 1) * _WORDS])
                        for i, seed in enumerate(seeds)]
        self._seeds = np.asarray(seeds, dtype=np.uint64)
        self.step = None

    def set(self, step) -> "StepScalarsGroup":
        """Every member's ``set(step)``, in one asynchronous copy."""
        scalars = self.rule.scalars(step)
        host = np.zeros((len(self.members), _WORDS), dtype=np.int32)
        host[:, :NUM_SCALARS] = np.asarray(scalars, dtype=np.float32).view(np.int32)
        keys = stream_seeds(self._seeds, int(step))
        host[:, NUM_SCALARS:] = keys.astype(np.int64).reshape(-1, 1).view(np.int32)
        staged = torch.from_numpy(host.reshape(-1))
        if self.device.type == "cuda":
            self.words.copy_(staged.pin_memory(), non_blocking=True)
        else:
            self.words.copy_(staged)
        self.step = int(step)
        for member in self.members:
            member.step = self.step
        return self
