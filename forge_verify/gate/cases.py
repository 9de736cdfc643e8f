"""The kernel-change gate's canonical inputs: one seeded problem per (rule, regime),
run through ``fused_weight_update`` for a few steps.

The shape is ragged against the config in every dimension (40 = 16 + 16 + 8 rows,
72 = 32 + 32 + 8 columns, 50 = 3 x 16 + 2 tokens), so tile edges, more than one tile
per dimension and a partial token block are all exercised; the config is fixed here,
never chosen from the shape. Every rule runs in the fp32 regime on fp32 activations
(where a TF32 dot would show); AdamW also runs on bf16 activations and in every
low-precision storage regime, whose drift from the exact trajectory the gate measures.
"""

from dataclasses import dataclass

import torch

import forge_kernels as fk

from ..checks.catalog import CATALOG
from ..checks.problems import FP32, REGIMES, Problem, Regime

CONFIG = fk.TileConfig(block_n=16, block_k=32, block_t=16)
EXACT_STEPS = 3
LOW_PRECISION_STEPS = 8


@dataclass(frozen=True)
class Case:
    rule_name: str
    rule: fk.Rule
    regime_name: str
    regime: Regime
    problem: Problem

    @property
    def key(self) -> str:
        """A stable, readable identifier: rule | regime | shape."""
        p = self.problem
        dtype = str(p.dtype).replace("torch.", "")
        return (f"{self.rule_name} | {self.regime_name} | T={p.tokens} N={p.out_features} K={p.in_features} "
                f"{dtype} x{p.steps} seed={p.seed}")

    def describe(self) -> dict:
        """What the baseline records about the case, so a change to the set is visible in the diff."""
        return {"rule": repr(self.rule), "regime": self.regime.describe(), "problem": self.problem.describe(),
                "config": str(CONFIG), "kernel": "fused_weight_update"}


def _problem(dtype, steps, seed=3):
    return Problem(tokens=50, out_features=40, in_features=72, dtype=dtype, steps=steps, seed=seed)


#: one representative of each rule family, with the features that give it state switched on
RULES = {entry.name: entry.gate for entry in CATALOG}


def canonical_cases() -> list:
    cases = [Case(name, rule, "fp32 weight, fp32 state", FP32, _problem(torch.float32, EXACT_STEPS))
             for name, rule in RULES.items()]
    adamw = RULES["adamw"]
    for regime_name, regime in REGIMES.items():
        steps = EXACT_STEPS if regime == FP32 else LOW_PRECISION_STEPS
        cases.append(Case("adamw", adamw, regime_name, regime, _problem(torch.bfloat16, steps)))
    return cases
