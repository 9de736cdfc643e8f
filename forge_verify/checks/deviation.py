"""How far each low-precision regime drifts from the exact trajectory.

For a small seeded problem, up to four ways of taking the same steps are compared with the
exact trajectory (exact gradients, the rule in mpmath at 113 bits, nothing rounded):

* ``forge``: the fused kernel (the gradient never leaves fp32 registers);
* ``standard``: the materialized pipeline at the same storage precision: the kernel's
  gradient stored in the weight's dtype, then the same epilogue (``fk.apply_rule``);
* ``torch.optim``: the rule's torch.optim counterpart (Lion has none) with parameter,
  gradient and state in the weight's dtype, where that matches the regime (state
  stored like the weight, rounded to nearest);
* ``torchao 8-bit``: torchao's ``AdamW8bit`` (block-wise 8-bit states with a dynamic
  map, blocks of 256) for AdamW in the q8 regimes, when torchao is installed and really
  keeps 8-bit state: it keeps fp32 state for tensors under 4,096 elements, and such
  rows are left out rather than reported as 8-bit.

Errors are measured on the weight, in ulps of the weight's dtype at the exact value:
the largest, the median, the bias and the spread, and the RMS error relative to the
exact RMS change of the weight. The bias is signed along the exact trajectory: the mean
of error · sign(exact change), so a weight that lags behind the exact one (an update
lost to rounding) counts negative whichever way it moves; the spread is the standard
deviation of the same quantity.
"""

import dataclasses
from dataclasses import dataclass

import mpmath
import numpy as np
import torch

import forge_kernels as fk

from ..numerics.mpref import MPMATH, PRECISION_BITS, exact_weight_grad, to_float64
from .catalog import CATALOG, reference_step
from .problems import REGIMES, Problem, Regime, make_inputs
from .tables import render_table
from .torch_optim import has_counterpart, torch_optimizer

#: ``forge-verify deviation --rule``: one representative configuration per rule family.
RULES = {entry.name: entry.deviation for entry in CATALOG}


@dataclass
class Deviation:
    regime: str
    method: str
    steps: int
    max_ulp: float
    median_ulp: float
    bias_ulp: float
    spread_ulp: float
    relative_rms: float


def ulp_at(exact: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    # eps is the ulp of 1.0; below the normal range the ulp stays that of the smallest normal.
    finfo = torch.finfo(dtype)
    magnitude = np.maximum(np.abs(exact), finfo.tiny)
    return 2.0 ** np.floor(np.log2(magnitude)) * finfo.eps


def measure_deviation(regime_name, method, steps, weight, exact, w0, dtype) -> Deviation:
    error = weight.detach().cpu().double().numpy() - exact
    ulps = error / ulp_at(exact, dtype)
    along = ulps * np.sign(exact - w0)
    change = np.sqrt(np.mean((exact - w0) ** 2))
    return Deviation(regime_name, method, steps, float(np.abs(ulps).max()), float(np.median(np.abs(ulps))),
                     float(along.mean()), float(along.std()), float(np.sqrt(np.mean(error**2)) / change))


def _torchao_adamw8bit():
    """torchao's AdamW8bit, or None where torchao is not installed."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return None
    return AdamW8bit


def _torch_optim_applies(regime: Regime, rule) -> bool:
    if regime.state_format == "q8" or not has_counterpart(rule):
        return False
    same_dtype = (regime.state_format == "bf16") == (regime.weight == torch.bfloat16)
    return same_dtype and (regime.weight == torch.float32 or regime.rounding == "nearest")


def format_rows(rows) -> str:
    header = ("regime", "method", "steps", "max ulp", "median ulp", "bias ulp", "spread ulp", "rms / change")
    return render_table(header, [(r.regime, r.method, str(r.steps), f"{r.max_ulp:.2f}", f"{r.median_ulp:.2f}",
                                  f"{r.bias_ulp:+.3f}", f"{r.spread_ulp:.3f}", f"{r.relative_rms:.3g}")
                                 for r in rows])


def deviation_table(rule, problem: Problem, checkpoints=(1, 10, 100), regimes=REGIMES,
                    device=None, exact_at=None) -> list:
    """Rows of :class:`Deviation` for every regime, method and checkpoint. The exact
    trajectories ({step: float64 weight}, one per weight dtype) go into ``exact_at`` when
    a dict is given, for a caller that needs them too."""
    device = fk.kernel_device() if device is None else device
    steps = max(checkpoints)
    problem = dataclasses.replace(problem, steps=steps)
    base = make_inputs(problem, device)
    rows = []
    exact_at = {} if exact_at is None else exact_at
    for name, regime in regimes.items():
        w0 = base.weight.to(regime.weight)
        if regime.weight not in exact_at:
            exact_at[regime.weight] = exact_trajectory(rule, w0, base.batches, checkpoints)
        rows += _run_methods(name, regime, rule, base, w0, exact_at[regime.weight], checkpoints)
    return rows


def exact_trajectory(rule, w0: torch.Tensor, batches, checkpoints) -> dict:
    """{step: float64 weight} of the exact trajectory from ``w0`` (exact gradient sums, the
    rule in mpmath at 113 bits, nothing rounded) at each checkpoint."""
    exact = {}
    with mpmath.workprec(PRECISION_BITS):
        w = MPMATH.value(w0)
        state = {k: MPMATH.value(v) for k, v in rule.init_state(w0.double()).items()}
        for step, (x, dy) in enumerate(batches, start=1):
            w, state = reference_step(rule, w, exact_weight_grad(x, dy), state, step, MPMATH)
            if step in checkpoints:
                exact[step] = to_float64(w)
    return exact


def _run_methods(name, regime, rule, base, w0, exact, checkpoints):
    rows = []
    start = w0.detach().cpu().double().numpy()
    methods = ["forge", "standard"] + (["torch.optim"] if _torch_optim_applies(regime, rule) else [])
    torchao_adamw8bit = _torchao_adamw8bit() if isinstance(rule, fk.AdamW) else None
    if regime.state_format == "q8" and torchao_adamw8bit is not None:
        methods.append("torchao 8-bit")
    for method in methods:
        weight = w0.clone()
        state = rule.init_state(weight, state_format=regime.state_format)
        param = torch.nn.Parameter(w0.clone())
        if method == "torchao 8-bit":
            optimizer = torchao_adamw8bit([param], lr=rule.lr, betas=rule.betas, eps=rule.eps,
                                          weight_decay=rule.weight_decay)
        else:
            optimizer = torch_optimizer(param, rule)
        for step, (x, dy) in enumerate(base.batches, start=1):
            if method == "forge":
                fk.fused_weight_update(x, dy, weight, state, rule, step, rounding=regime.rounding, seed=regime.seed)
            elif method == "standard":
                stored = fk.weight_gradient(x, dy).to(regime.weight).float()
                fk.apply_rule(stored, weight, state, rule, step, rounding=regime.rounding, seed=regime.seed)
            else:
                param.grad = fk.weight_gradient(x, dy).to(regime.weight)
                optimizer.step()
                weight = param.detach()
            if step in checkpoints:
                rows.append(measure_deviation(name, method, step, weight, exact[step], start, regime.weight))
        if method == "torchao 8-bit" and type(optimizer.state[param]["exp_avg"]).__name__ != "OptimState8bit":
            rows = [row for row in rows if row.method != method]
    return rows
