"""The rule catalog: every element-wise rule ``forge_kernels`` exports, once.

Adding a rule is its file in ``kernels/rules/`` plus one ``Entry`` here. Everything that
iterates over rules reads this list: the references (``reference_step``), the hypothesis
strategies (``forge_verify.checks.strategies.RULES``), the kernel-change gate's cases,
the deviation study, the torch.optim comparisons and the sharding families.
``tests/test_catalog.py`` fails when an exported rule has no entry, or when any of those
consumers leaves a catalogued rule out.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from hypothesis import strategies as st

import forge_kernels as fk

from ..numerics import reference as ref
from ..numerics.reference import POINT


# Hyperparameters are drawn as fp32 values without subnormals: the kernel receives fp32
# scalars, and one that is not representable is refused (tests/test_bad_input.py).
def _floats(low, high):
    return st.floats(float(np.float32(low)), float(np.float32(high)), width=32, allow_subnormal=False)


_lr = _floats(1e-5, 0.1)
_beta = _floats(0.0, 0.99)
_beta2 = _floats(0.5, 0.9999)
_eps = st.sampled_from((1e-10, 1e-8, 1e-6, 1e-3))
_decay = st.one_of(st.just(0.0), _floats(1e-4, 0.1))


@st.composite
def _sgd(draw):
    momentum = draw(st.one_of(st.just(0.0), _floats(0.1, 0.99)))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov or momentum == 0 else draw(st.one_of(st.just(0.0), _floats(0.0, 0.9)))
    return fk.SGD(lr=draw(_lr), momentum=momentum, dampening=dampening,
                  weight_decay=draw(_decay), nesterov=nesterov)


@dataclass(frozen=True)
class Entry:
    """One rule family and what each consumer runs it with."""

    name: str
    rule: type
    #: the rule's mathematics over an arithmetic (forge_verify.numerics.reference)
    reference: Callable
    #: hypothesis strategy drawing the family's hyperparameters (every property)
    strategy: st.SearchStrategy
    #: the gate's canonical instance, with every feature that gives it state switched on
    gate: fk.Rule
    #: the distributed properties' and sharding reports' instance
    sharding: fk.Rule
    #: ``forge-verify deviation --rule`` and the deviation report
    deviation: fk.Rule
    #: torch.optim's counterpart over one parameter (single-tensor path), if it has one
    torch_optim: Optional[Callable] = None
    #: the instance measured against torch.optim (``forge-verify check``), if it has one
    closeness: Optional[fk.Rule] = None


CATALOG = (
    Entry("adamw", fk.AdamW, ref.adamw,
          st.builds(fk.AdamW, lr=_lr, betas=st.tuples(_beta, _beta2), eps=_eps, weight_decay=_decay),
          gate=fk.AdamW(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01),
          sharding=fk.AdamW(lr=1e-2, weight_decay=0.1),
          deviation=fk.AdamW(lr=1e-3, weight_decay=0.01),
          torch_optim=lambda p, r: torch.optim.AdamW([p], lr=r.lr, betas=r.betas, eps=r.eps,
                                                     weight_decay=r.weight_decay, foreach=False),
          closeness=fk.AdamW(lr=1e-3, weight_decay=0.01)),
    Entry("adam", fk.Adam, ref.adamw,
          st.builds(fk.Adam, lr=_lr, betas=st.tuples(_beta, _beta2), eps=_eps),
          gate=fk.Adam(lr=1e-2, betas=(0.9, 0.99), eps=1e-8),
          sharding=fk.Adam(lr=1e-2),
          deviation=fk.Adam(lr=1e-3),
          torch_optim=lambda p, r: torch.optim.Adam([p], lr=r.lr, betas=r.betas, eps=r.eps, foreach=False),
          closeness=fk.Adam(lr=1e-3)),
    Entry("sgd", fk.SGD, ref.sgd, _sgd(),
          gate=fk.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
          sharding=fk.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
          deviation=fk.SGD(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
          torch_optim=lambda p, r: torch.optim.SGD([p], lr=r.lr, momentum=r.momentum, dampening=r.dampening,
                                                   weight_decay=r.weight_decay, nesterov=r.nesterov, foreach=False),
          closeness=fk.SGD(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    Entry("lion", fk.Lion, ref.lion,
          st.builds(fk.Lion, lr=_lr, betas=st.tuples(_beta, _beta2), weight_decay=_decay),
          gate=fk.Lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01),
          sharding=fk.Lion(lr=1e-3, weight_decay=0.1),
          deviation=fk.Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)),
    Entry("rmsprop", fk.RMSprop, ref.rmsprop,
          st.builds(fk.RMSprop, lr=_lr, alpha=_beta2, eps=_eps, weight_decay=_decay,
                    momentum=st.one_of(st.just(0.0), _floats(0.1, 0.95)), centered=st.booleans()),
          gate=fk.RMSprop(lr=1e-2, alpha=0.99, eps=1e-8, momentum=0.5, centered=True),
          sharding=fk.RMSprop(centered=True, momentum=0.5),
          deviation=fk.RMSprop(lr=1e-3, momentum=0.9, centered=True),
          torch_optim=lambda p, r: torch.optim.RMSprop([p], lr=r.lr, alpha=r.alpha, eps=r.eps,
                                                       weight_decay=r.weight_decay, momentum=r.momentum,
                                                       centered=r.centered, foreach=False),
          closeness=fk.RMSprop(lr=1e-3, momentum=0.9, centered=True)),
    Entry("adagrad", fk.Adagrad, ref.adagrad,
          st.builds(fk.Adagrad, lr=_lr, lr_decay=st.one_of(st.just(0.0), _floats(0.0, 0.1)),
                    weight_decay=_decay, initial_accumulator_value=st.sampled_from((0.0, 0.1)), eps=_eps),
          gate=fk.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
          sharding=fk.Adagrad(lr=0.1),
          deviation=fk.Adagrad(lr=1e-2),
          torch_optim=lambda p, r: torch.optim.Adagrad([p], lr=r.lr, lr_decay=r.lr_decay,
                                                       weight_decay=r.weight_decay,
                                                       initial_accumulator_value=r.initial_accumulator_value,
                                                       eps=r.eps, foreach=False),
          closeness=fk.Adagrad(lr=1e-2, lr_decay=1e-3)),
)

BY_NAME = {entry.name: entry for entry in CATALOG}


def entry_for(rule) -> Entry:
    """The catalog entry of ``rule``'s class, or of the nearest catalogued ancestor: a
    subclass (a planted mistake, a user's variant) is held to its parent's mathematics."""
    for cls in type(rule).__mro__:
        for entry in CATALOG:
            if entry.rule is cls:
                return entry
    raise TypeError(f"rule {type(rule).__name__} is not in forge_verify.checks.catalog.CATALOG")


def reference_step(rule, w, g, state, step, arithmetic=POINT):
    """One step of ``rule`` in ``arithmetic``; returns (new weight, new state dict)."""
    return entry_for(rule).reference(arithmetic, w, g, state, rule, step)
