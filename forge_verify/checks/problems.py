"""Seeded problems for the properties: a weight and one (x, dy) pair per step, and
running a rule over them through the fused or the oracle path."""

from dataclasses import dataclass

import torch

import forge_kernels as fk


@dataclass(frozen=True)
class Problem:
    tokens: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    steps: int
    seed: int
    scale: float = 1.0
    #: zero every third input feature of x and every fifth output of dy, as ReLU or
    #: padding do: whole rows and columns of dW are then exactly 0
    sparse: bool = False

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return (f"T={self.tokens} N={self.out_features} K={self.in_features} {dtype} "
                f"steps={self.steps} seed={self.seed} scale={self.scale:g}{' sparse' if self.sparse else ''}")


@dataclass(frozen=True)
class Regime:
    """How weight and state are stored: the rule always computes in fp32."""

    weight: torch.dtype = torch.float32
    state_format: str = "fp32"
    rounding: str = "stochastic"
    seed: int = 0

    @property
    def rounds(self) -> bool:
        """Whether any store rounds (bf16 weight or state, q8 state): fp32 stores are exact."""
        return self.weight == torch.bfloat16 or self.state_format != "fp32"

    def describe(self) -> str:
        weight = str(self.weight).replace("torch.", "")
        rounding = f" {self.rounding} seed={self.seed}" if self.rounds else ""
        return f"weight {weight}, state {self.state_format}{rounding}"


FP32 = Regime()

#: the storage regimes every study and gate case is run in, by name
REGIMES = {
    "fp32 weight, fp32 state": Regime(),
    "fp32 weight, bf16 state, nearest": Regime(state_format="bf16", rounding="nearest"),
    "fp32 weight, bf16 state, stochastic": Regime(state_format="bf16", rounding="stochastic", seed=1),
    "bf16 weight, fp32 state, nearest": Regime(weight=torch.bfloat16, rounding="nearest"),
    "bf16 weight, fp32 state, stochastic": Regime(weight=torch.bfloat16, rounding="stochastic", seed=1),
    "bf16 weight, bf16 state, nearest": Regime(weight=torch.bfloat16, state_format="bf16", rounding="nearest"),
    "bf16 weight, bf16 state, stochastic": Regime(weight=torch.bfloat16, state_format="bf16",
                                                  rounding="stochastic", seed=1),
    "fp32 weight, q8 state, nearest": Regime(state_format="q8", rounding="nearest"),
    "fp32 weight, q8 state, stochastic": Regime(state_format="q8", rounding="stochastic", seed=1),
    "bf16 weight, q8 state, stochastic": Regime(weight=torch.bfloat16, state_format="q8", rounding="stochastic",
                                                seed=1),
}


@dataclass
class Inputs:
    weight: torch.Tensor
    batches: list  # one (x, dy) pair per step


def _normal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 N(0, 1) draws that are the same on every CPU: float64 draws rounded once.
    torch's float32 randn takes, for 16 elements or more, a vectorized Box-Muller with an
    approximate log on AVX2 and AVX-512 CPUs and the scalar one elsewhere, so its bits
    depend on the instruction set; its float64 draws do not (tests/test_problem_inputs.py)."""
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64).float()


def make_inputs(problem: Problem, device, regime: Regime = FP32) -> Inputs:
    """Draw the problem's tensors from its seed (on the CPU, so every backend sees the same values)."""
    gen = torch.Generator().manual_seed(problem.seed)
    T, N, K = problem.tokens, problem.out_features, problem.in_features
    weight = _normal(N, K, gen)
    batches = []
    for _ in range(problem.steps):
        x = (_normal(T, K, gen) * problem.scale).to(problem.dtype)
        dy = _normal(T, N, gen).to(problem.dtype)
        if problem.sparse:
            x[:, ::3] = 0
            dy[:, ::5] = 0
        batches.append((x.to(device), dy.to(device)))
    return Inputs(weight.to(device, regime.weight), batches)


def run_rule(inputs: Inputs, rule, *, oracle=False, config=None, regime: Regime = FP32, first_step=1,
             weight_slice=None):
    """Apply ``rule`` once per batch to a copy of the weight (at ``weight_slice`` inside a
    larger one, if given); returns (weight, state)."""
    weight = inputs.weight.clone()
    state = rule.init_state(weight, state_format=regime.state_format)
    for i, (x, dy) in enumerate(inputs.batches):
        fk.fused_weight_update(x, dy, weight, state, rule, first_step + i, oracle=oracle, config=config,
                               rounding=regime.rounding, seed=regime.seed, weight_slice=weight_slice)
    return weight, state
