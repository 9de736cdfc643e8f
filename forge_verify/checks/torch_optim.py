"""Distance to ``torch.optim`` given the same gradient, in ulps: measured and reported,
no bound asserted. torch.optim evaluates the same mathematics in another operation
order (lerp, addcmul, addcdiv), so only closeness can hold; how close is a number
to publish, not a claim (README, "Closeness to torch.optim")."""

import torch

import forge_kernels as fk

from ..numerics.bits import ulp_distance
from .catalog import CATALOG, entry_for
from .problems import Problem, make_inputs, run_rule


def has_counterpart(rule) -> bool:
    """Whether torch.optim has this rule (Lion has none)."""
    return entry_for(rule).torch_optim is not None


def torch_optimizer(param, rule):
    """The torch.optim optimizer over ``param`` with ``rule``'s hyperparameters (single-tensor
    path), or None for a rule torch.optim does not have (Lion)."""
    factory = entry_for(rule).torch_optim
    return None if factory is None else factory(param, rule)


#: the rules measured, one representative configuration each
MEASURED_RULES = {entry.name: entry.closeness for entry in CATALOG if entry.closeness is not None}


def _run_torch_optim(problem: Problem, rule, device, config=None):
    """(fused weight, torch.optim weight): torch.optim's single-tensor path stepping on the
    kernel's own gradient (``fk.weight_gradient``, same config)."""
    inputs = make_inputs(problem, device)
    ours, _ = run_rule(inputs, rule, config=config)
    param = torch.nn.Parameter(inputs.weight.clone())
    optimizer = torch_optimizer(param, rule)
    for x, dy in inputs.batches:
        param.grad = fk.weight_gradient(x, dy, config=config)
        optimizer.step()
    return ours.cpu(), param.detach().cpu()


def distance_to_torch_optim(problem: Problem, rule, device, config=None) -> torch.Tensor:
    """Per-element ulp distance between the fused update and torch.optim on the same gradient."""
    return ulp_distance(*_run_torch_optim(problem, rule, device, config))


def measure(device, seeds=range(4), steps=3) -> list:
    """Rows (rule, activation dtype, median ulp, max ulp, max |difference| in units of
    eps * max|w|) over seeded 64x48 problems of 96 tokens. The last column keeps weights
    that land near zero, where one ulp is tiny, from dominating the picture."""
    rows = []
    eps = torch.finfo(torch.float32).eps
    for name, rule in MEASURED_RULES.items():
        for dtype in (torch.float32, torch.bfloat16):
            ulps, scaled = [], []
            for seed in seeds:
                ours, theirs = _run_torch_optim(Problem(96, 64, 48, dtype, steps, seed), rule, device)
                ulps.append(ulp_distance(ours, theirs).flatten())
                scaled.append(float((ours.double() - theirs.double()).abs().max() / (eps * ours.abs().max())))
            ulps = torch.cat(ulps)
            rows.append((name, str(dtype).replace("torch.", ""), float(ulps.double().median()), int(ulps.max()),
                         max(scaled)))
    return rows
