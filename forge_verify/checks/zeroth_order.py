"""Claims about zeroth-order fine-tuning (GRZO, MeZO) as functions: quadratic test
problems whose gradients are known, draws injected pattern by pattern, the exact moments
of the estimators (proofs/zeroth_order.md) and many calls' estimates at once.

The estimators' exact statistics on quadratic per-example losses ℓ_i, gradients g_i,
ḡ their mean, d the number of perturbed coordinates:

* GRZO (normalize="none"): E[ĝ | U] = U ⊙ U ⊙ ḡ, E[ĝ] = ḡ,
  tr Cov(ĝ) = ((d - 1)/B) mean‖g_i‖² + 2‖ḡ‖²;
* MeZO: E[ĝ] = ḡ, tr Cov(ĝ) = (d + 1)‖ḡ‖².
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import _splitmix64, _splitmix64_array
from forge_kernels.zeroth_order.draws import BASE, COL, ROW, name_hash, philox4x32

from ..numerics.tolerances import UNIT_ROUNDOFF, gamma


@dataclass
class QuadraticProblem:
    """One float64 nn.Linear and per-example losses ℓ_i = ½‖W x_i + b - y_i‖², quadratic
    in (W, b), so central differences are exact and each g_i is known in closed form."""

    model: nn.Linear
    inputs: torch.Tensor
    targets: torch.Tensor

    def losses(self) -> torch.Tensor:
        return 0.5 * ((self.model(self.inputs) - self.targets) ** 2).sum(-1)

    def closure(self):
        return self.losses

    def per_example_gradients(self) -> torch.Tensor:
        """(B, d): g_i flattened as [weight row-major, bias], the optimizer's target order."""
        with torch.no_grad():
            residual = self.model(self.inputs) - self.targets
            weight = residual[:, :, None] * self.inputs[:, None, :]
            parts = [weight.reshape(len(residual), -1)]
            if self.model.bias is not None:
                parts.append(residual)
            return torch.cat(parts, dim=1)

    @property
    def dimension(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def quadratic_problem(d_out: int, d_in: int, batch: int, *, identical: bool, bias: bool = True,
                      seed: int = 0) -> QuadraticProblem:
    """Identical examples (every g_i the same) or heterogeneous ones (drawn independently)."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Linear(d_in, d_out, bias=bias).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    rows = 1 if identical else batch
    inputs = torch.randn(rows, d_in, generator=generator, dtype=torch.float64).expand(batch, d_in).clone()
    targets = torch.randn(rows, d_out, generator=generator, dtype=torch.float64).expand(batch, d_out).clone()
    return QuadraticProblem(model, inputs, targets)


def flatten(estimate: dict, names) -> torch.Tensor:
    return torch.cat([estimate[n].reshape(-1) for n in names])


# --- exact moments ------------------------------------------------------------------

def grzo_trace_variance(grads: torch.Tensor) -> float:
    """((d - 1)/B) mean‖g_i‖² + 2‖ḡ‖² for per-example gradients (B, d)."""
    batch, d = grads.shape
    mean = grads.mean(0)
    return float((d - 1) / batch * (grads ** 2).sum(1).mean() + 2 * (mean ** 2).sum())


def mezo_trace_variance(mean_grad: torch.Tensor) -> float:
    """(d + 1)‖ḡ‖²."""
    return float((mean_grad.numel() + 1) * (mean_grad ** 2).sum())


def grzo_helps(grads: torch.Tensor) -> bool:
    """GRZO's trace variance is below MeZO's exactly when mean‖g_i - ḡ‖² < (B - 1)‖ḡ‖²."""
    batch = grads.shape[0]
    mean = grads.mean(0)
    return bool(((grads - mean) ** 2).sum(1).mean() < (batch - 1) * (mean ** 2).sum())


def grzo_conditional_second_moment(base: torch.Tensor, grads: torch.Tensor) -> float:
    """E[‖ĝ‖² | U] = (1/B²)(‖U‖² Σ_i Σ_n g_in² U_n² + Σ_{i≠i'} Σ_m U_m⁴ g_im g_i'm), for
    signs whose products are pairwise orthogonal within an example and independent
    across examples (proofs/zeroth_order.md, "Second moment")."""
    batch = grads.shape[0]
    u2 = base ** 2
    diagonal = (u2.sum() * (grads ** 2 * u2).sum())
    total = grads.sum(0)
    cross = (u2 ** 2 * (total ** 2 - (grads ** 2).sum(0))).sum()
    return float((diagonal + cross) / batch**2)


def mezo_squared_norm_variance(mean_grad: torch.Tensor) -> float:
    """Var ‖ĝ‖² of MeZO's estimate, exactly: E‖ĝ‖⁴ - (E‖ĝ‖²)² = (K_d - (d + 2)²)‖ḡ‖⁴
    = (2d² + 26d + 68)‖ḡ‖⁴ (proofs/zeroth_order.md, "Monte Carlo radii")."""
    d = mean_grad.numel()
    return float((fourth_moment_factor(d) - (d + 2) ** 2) * (mean_grad ** 2).sum() ** 2)


def mezo_squared_norm(z: torch.Tensor, mean_grad: torch.Tensor) -> float:
    """‖ĝ‖² = ⟨ḡ, z⟩² ‖z‖² of MeZO's estimate ĝ = ⟨ḡ, z⟩ z along z (its central
    difference is ⟨ḡ, z⟩ on a quadratic: tests/test_zeroth_order.py checks the optimizer)."""
    return float((z @ mean_grad) ** 2 * (z @ z))


def fourth_moment_factor(d: int) -> int:
    """K_d with E[⟨g, z⟩⁴ ‖z‖⁴] = K_d ‖g‖⁴ for z ~ N(0, I_d): 3d² + 30d + 72. Bounds
    E‖ĝ‖⁴ by K_d ‖ḡ‖⁴ (MeZO, equality) and K_d mean‖g_i‖⁴ (GRZO, proofs/zeroth_order.md)."""
    return 3 * d * d + 30 * d + 72


#: the 3-node Gauss–Hermite rule for N(0, 1): nodes -√3, 0, √3 with weights 1/6, 2/3,
#: 1/6, exact for polynomials of degree at most 5 (each rounded once to float64)
_NODES = (-math.sqrt(3.0), 0.0, math.sqrt(3.0))
_WEIGHTS = (1 / 6, 2 / 3, 1 / 6)


def gaussian_expectation(function, d: int) -> float:
    """E f(U), U ~ N(0, I_d), by the tensor 3-node Gauss–Hermite rule: exact for
    polynomials of degree at most 5 in each coordinate (up to the rounding that
    ``quadrature_rounding_bound`` bounds)."""
    total = 0.0
    for index in itertools.product(range(3), repeat=d):
        u = torch.tensor([_NODES[i] for i in index], dtype=torch.float64)
        total += float(np.prod([_WEIGHTS[i] for i in index])) * function(u)
    return total


def _u64_gamma(n: int) -> float:
    return gamma(n, UNIT_ROUNDOFF[torch.float64])


def _evaluation_margin(k: int) -> float:
    """1 + 2γ_k ≥ 1/(1 − γ_k) (γ_k ≤ ½): a float64 value of non-negative terms computed with
    k roundings on any path, times this, is at least the exact value; every bound here
    that must cover its own evaluation is multiplied by it (proofs/zeroth_order.md)."""
    return 1 + 2 * _u64_gamma(k)


def quadrature_rounding_bound(magnitude, d: int, operations: int, degree: int) -> float:
    """A bound on |gaussian_expectation(f, d) - E f(U)| for a polynomial f of total
    degree ``degree`` in U, of degree at most 5 in each coordinate, whose float64
    evaluation takes at most ``operations`` roundings along any path and is within
    γ_operations of ``magnitude(u)`` (f with every coefficient and term made
    non-negative, evaluated at |u|): γ_N Σ_nodes w · magnitude(|u|) with N =
    operations + degree + 2d + 3^d + 1, the sum (computed by the same rule) multiplied
    by 1 + 2γ_N (proofs/zeroth_order.md, "Rounding in the exact tests")."""
    total = gaussian_expectation(lambda u: magnitude(u.abs()), d)
    n = operations + degree + 2 * d + 3**d + 1
    return _u64_gamma(n) * total * _evaluation_margin(n)  # the sum's own rounding


def _abs_closed_form(base: torch.Tensor, magnitudes: torch.Tensor) -> float:
    """``grzo_conditional_second_moment`` with every term non-negative, at the
    per-example gradient magnitudes ``magnitudes`` (B, d) and |U|: the size of what it
    sums, (1/B²)(‖U‖² Σ_i Σ_n v_in² U_n² + Σ_m U_m⁴ ((Σ_i v_im)² + Σ_i v_im²))."""
    batch = magnitudes.shape[0]
    u2 = base ** 2
    diagonal = u2.sum() * (magnitudes ** 2 * u2).sum()
    cross = (u2 ** 2 * (magnitudes.sum(0) ** 2 + (magnitudes ** 2).sum(0))).sum()
    return float((diagonal + cross) / batch**2)


def _law_bound(quadrature: float, n: int, size: float, m: int) -> float:
    """Q (1 + u) + γ_n S, S the exact size that ``size`` computes from |g| with m roundings
    on any monomial (non-negative terms, so S ≤ size/(1 − γ_m)), evaluated in float64 as
    (Q + γ_n size)(1 + 2γ_{m+5}): the five are γ_n's two roundings, the product, the sum
    and the last product; 1 + 2γ_k as computed times 1 − γ_k is at least 1 + u for 4 ≤ k,
    γ_k ≤ ⅕ (proofs/zeroth_order.md, "Rounding in the exact tests", "The laws")."""
    return (quadrature + _u64_gamma(n) * size) * _evaluation_margin(m + 5)


def grzo_law_rounding_bound(grads: torch.Tensor) -> float:
    """A bound on |got - law| in test_variance_law_is_the_gaussian_mean_of_the_second_moment
    (got: the quadrature of ``grzo_conditional_second_moment`` less ‖ḡ‖², law:
    ``grzo_trace_variance``, both from the same float64 ``grads``): the quadrature's
    rounding (its closed form takes at most Bd + B + 2d + 10 roundings along a path, and
    is of degree 4 in U), times 1 + u for the subtraction, plus γ_n of the size of ‖ḡ‖²
    and of the law, n = max(B + d + 4, 2B + d + 2) (proofs/zeroth_order.md, "Rounding in
    the exact tests", "The laws")."""
    batch, d = grads.shape
    magnitudes = grads.abs()
    quadrature = quadrature_rounding_bound(lambda u: _abs_closed_form(u, magnitudes), d,
                                           batch * d + batch + 2 * d + 10, 4)
    # the sizes by the compared numbers' own operations, at |g|: n roundings on any monomial
    mean_sizes = float((magnitudes.mean(0) ** 2).sum())
    law_size = (d - 1) / batch * float((grads ** 2).sum(1).mean()) + 2 * mean_sizes
    n = max(batch + d + 4, 2 * batch + d + 2)
    return _law_bound(quadrature, n, law_size + mean_sizes, n)


def mezo_law_rounding_bound(mean_grad: torch.Tensor) -> float:
    """The same for MeZO's test: ``mezo_squared_norm`` takes 3d + 2 roundings on any
    monomial (two dot products of d, the square, the product), degree 4 in z; plus
    γ_{d+2} of (d + 2)‖ḡ‖², the size of got's ‖ḡ‖² and of the law (d + 1)‖ḡ‖², whose
    computed value takes d + 1 roundings."""
    d = mean_grad.numel()
    magnitudes = mean_grad.abs()
    quadrature = quadrature_rounding_bound(lambda z: float((z @ magnitudes) ** 2 * (z @ z)), d, 3 * d + 2, 4)
    return _law_bound(quadrature, d + 2, (d + 2) * float((mean_grad ** 2).sum()), d + 1)


def enumeration_bounds(problem: QuadraticProblem, bases: dict, opt) -> tuple:
    """Bounds on ``enumeration_errors``' two numbers (in its units) when the optimizer is
    right: the float64 rounding of its forwards, coefficients, update and of the
    reference, each step's γ_n from the operations it takes (proofs/zeroth_order.md,
    "Rounding in the exact tests"), evaluated at this problem's magnitudes.

    Ẽ_i = ½ Σ_j E_ij² with E_ij = (|W| |x_i|)_j + |b_j| + σ ((|U| |x_i|)_j + |u_j|) + |y_ij|
    bounds example i's losses at ±σ and their rounding scale; a loss is within
    γ_{2(d_in+4)+d_out} Ẽ_i of the exact one, δ_i within γ_{2(d_in+4)+d_out+2} Ẽ_i/σ, an
    estimate's coordinate within max|U| max Ẽ / σ · γ_{2(d_in+4)+d_out+B+3} =: e1 of its
    exact value (|ĝ| ≤ max|U| max Ẽ / σ =: G1), the mean over the P sign patterns adds
    γ_P (G1 + e1), and the reference U ⊙ U ⊙ ḡ (from the float64 gradients, each within
    η = γ_{d_in+3} E |x| of the exact) max|U|² γ_{d_in+B+6} max E max(|x|, 1). The mean
    square: per pattern d G1² γ_{2(...)+d}, with γ_P, plus the closed form's change
    over η and its own rounding."""
    model, x, y = problem.model, problem.inputs, problem.targets
    batch, d_in = x.shape
    d_out = model.weight.shape[0]
    sigma = opt.sigma
    with torch.no_grad():
        bias = model.bias.abs() if model.bias is not None else torch.zeros(d_out, dtype=torch.float64)
        base_bias = bases["bias"].abs() if "bias" in bases else torch.zeros(d_out, dtype=torch.float64)
        spread = x.abs() @ model.weight.abs().T + bias + sigma * (x.abs() @ bases["weight"].abs().T + base_bias) \
            + y.abs()
        loss_size = float(0.5 * (spread ** 2).sum(1).max())
        u = torch.cat([bases["weight"].reshape(-1)] + ([bases["bias"]] if "bias" in bases else []))
        grads = problem.per_example_gradients()
        parts = [(spread[:, :, None] * x.abs()[:, None, :]).reshape(batch, -1)]
        if model.bias is not None:
            parts.append(spread)
        eta = _u64_gamma(d_in + 3) * torch.cat(parts, dim=1)
    d = u.numel()
    patterns = 2 ** (batch * sum(size for _, _, size in sign_slots(opt)))
    n_loss = 2 * (d_in + 4) + d_out
    u_max = float(u.abs().max())
    size = u_max * loss_size / sigma
    e1 = size * _u64_gamma(n_loss + batch + 3)
    reference = u_max ** 2 * _u64_gamma(d_in + batch + 6) * float(spread.max()) * max(float(x.abs().max()), 1.0)
    mean_bound = e1 + _u64_gamma(patterns) * (size + e1) + reference
    magnitudes = grads.abs()
    upper = _abs_closed_form(u, magnitudes + 2 * eta)
    change = upper - _abs_closed_form(u, (magnitudes - eta).clamp_min(0))
    second_bound = d * size ** 2 * _u64_gamma(2 * (n_loss + batch + 3) + d + patterns) + change \
        + 2 * _u64_gamma(batch * d + batch + 2 * d + 10) * upper
    scale = float((u ** 2).sum() * grads.norm(dim=1).max())
    margin = _evaluation_margin(batch * d + 64)  # the bounds' own float64 evaluation
    return mean_bound / scale * margin, second_bound / scale ** 2 * margin


# --- injected draws -----------------------------------------------------------------

class FixedDraws:
    """A fixed base U per target and given signs per (target, kind): the interface of
    ``forge_kernels.zeroth_order.draws.CallDraws``, for enumerating sign patterns."""

    def __init__(self, bases: dict, signs: dict):
        self.bases, self.sign_table = bases, signs

    def base(self, target, rows):
        u = self.bases[target.name].to(target.work_dtype)
        return u if rows is None else u[rows]

    def signs(self, target, kind, batch, first=0):
        return self.sign_table[(target.name, kind)][first:first + batch].to(target.work_dtype)


def sign_slots(opt) -> list:
    """(target name, kind, size) of every sign vector one example draws."""
    slots = []
    for t in opt.targets:
        slots.append((t.name, ROW, t.rows))
        if t.is_matrix:
            slots.append((t.name, COL, t.cols))
    return slots


def enumerated_estimates(opt, closure, bases: dict, batch: int) -> torch.Tensor:
    """ĝ (flattened in target order) for every joint sign pattern of every example,
    through the optimizer's own hooks and update formula (``estimate_with``), U fixed."""
    slots = sign_slots(opt)
    per_example = sum(size for _, _, size in slots)
    names = [t.name for t in opt.targets]
    out = []
    for bits in itertools.product((1.0, -1.0), repeat=per_example * batch):
        grid = torch.tensor(bits, dtype=torch.float64).reshape(batch, per_example)
        table, start = {}, 0
        for name, kind, size in slots:
            table[(name, kind)] = grid[:, start:start + size]
            start += size
        out.append(flatten(opt.estimate_with(FixedDraws(bases, table), closure), names))
    return torch.stack(out)


# --- many calls at once -------------------------------------------------------------

def _keys(seed, calls, name, kind) -> torch.Tensor:
    """``stream_key(seed, c, name, kind)`` for every call c, vectorised (numpy's uint64
    arithmetic wraps as SplitMix64's mask does)."""
    z = _splitmix64_array(np.uint64(_splitmix64(seed)) ^ np.asarray(calls, dtype=np.uint64))
    z = _splitmix64_array(z ^ np.uint64(name_hash(name)))
    return torch.from_numpy((_splitmix64_array(z ^ np.uint64(kind)) >> np.uint64(1)).astype(np.int64))


def _normal(keys, counters):
    w0, w1, _, _ = philox4x32(keys, counters)
    u1 = (w0.to(torch.float64) + 0.5) * 2.0**-32
    u2 = w1.to(torch.float64) * 2.0**-32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * np.pi) * u2)


def _signs(keys, counters):
    return (1 - 2 * (philox4x32(keys, counters)[0] >> 31)).to(torch.float64)


def grzo_projections_over_calls(problem: QuadraticProblem, seed: int, calls: range):
    """(Δ_i of every call (n, B, d), δ_i = ⟨g_i, Δ_i⟩ (n, B)) of calls ``calls`` of
    ``GRZO(problem.model, seed=seed)``, from the same Philox streams, all at once; δ_i is
    the exact central difference of the quadratic losses."""
    model, grads = problem.model, problem.per_example_gradients()
    batch = grads.shape[0]
    d_out, d_in = model.weight.shape
    n = len(calls)
    ex = torch.arange(batch)

    def key(name, kind):
        return _keys(seed, calls, name, kind)[:, None, None]

    u_w = _normal(key("weight", BASE)[:, :, 0], torch.arange(d_out * d_in)[None, :])  # (n, d_out*d_in)
    r = _signs(key("weight", ROW), ex[None, :, None] * d_out + torch.arange(d_out)[None, None, :])
    s = _signs(key("weight", COL), ex[None, :, None] * d_in + torch.arange(d_in)[None, None, :])
    directions = [u_w[:, None, :] * (r[:, :, :, None] * s[:, :, None, :]).reshape(n, batch, -1)]
    if model.bias is not None:
        u_b = _normal(key("bias", BASE)[:, :, 0], torch.arange(d_out)[None, :])
        t = _signs(key("bias", ROW), ex[None, :, None] * d_out + torch.arange(d_out)[None, None, :])
        directions.append(u_b[:, None, :] * t)
    delta = torch.cat(directions, dim=2)
    return delta, (delta * grads[None]).sum(2)


def grzo_estimates_over_calls(problem: QuadraticProblem, seed: int, calls: range) -> torch.Tensor:
    """(len(calls), d): the normalize="none" estimates of those calls, (1/B) Σ_i δ_i Δ_i."""
    delta, projections = grzo_projections_over_calls(problem, seed, calls)
    return (projections[:, :, None] * delta).mean(1)


def mezo_estimates_over_calls(problem: QuadraticProblem, seed: int, calls: range) -> torch.Tensor:
    """(len(calls), d): the estimates of calls ``calls`` of ``MeZO(problem.model, seed=seed)``,
    with (L⁺ - L⁻)/(2ε) = ⟨ḡ, z⟩ exactly."""
    mean = problem.per_example_gradients().mean(0)
    parts = []
    for name, p in problem.model.named_parameters():
        parts.append(_normal(_keys(seed, calls, name, BASE)[:, None], torch.arange(p.numel())[None, :]))
    z = torch.cat(parts, dim=1)
    return (z @ mean)[:, None] * z


# --- signs ------------------------------------------------------------------------------

def neighbour_products(signs: torch.Tensor) -> dict:
    """{what: (mean, count)} of products of neighbouring ±1 signs of a (B × size) draw:
    examples i and i + 1 at the same index, indices j and j + 1 in the same example, and
    the mean sign itself. Independent fair signs give means of order 1/√count."""
    return {"examples": ((signs[1:] * signs[:-1]).mean().item(), signs[1:].numel()),
            "indices": ((signs[:, 1:] * signs[:, :-1]).mean().item(), signs[:, 1:].numel()),
            "marginal": (signs.mean().item(), signs.numel())}


def parity_signs(batch: int, size: int, seed: int) -> torch.Tensor:
    """The GRZO code's norm and embedding signs: ((a·odd + b·odd + seed) & 1), a parity of
    example and index, i.e. a checkerboard (a planted mistake for the sign tests)."""
    a = torch.arange(batch)[:, None] * 0x9E3779B1
    b = torch.arange(size)[None, :] * 0x85EBCA77
    return (1 - 2 * ((a + b + seed) & 1)).to(torch.float64)


def enumeration_errors(problem: QuadraticProblem, bases: dict, opt) -> tuple:
    """(|mean ĝ - U ⊙ U ⊙ ḡ|_max / s, |mean ‖ĝ‖² - closed form| / s²) over every joint sign
    pattern, s = ‖U‖² max‖g_i‖: both are float64 rounding, within ``enumeration_bounds``,
    when the optimizer is right (``opt`` built on ``problem.model`` with normalize="none")."""
    batch = problem.inputs.shape[0]
    estimates = enumerated_estimates(opt, problem.closure(), bases, batch)
    parts = [bases["weight"].reshape(-1)] + ([bases["bias"]] if problem.model.bias is not None else [])
    u = torch.cat(parts)
    grads = problem.per_example_gradients()
    scale = float((u ** 2).sum() * grads.norm(dim=1).max())
    mean_error = float((estimates.mean(0) - u * u * grads.mean(0)).abs().max())
    second_error = abs(float((estimates ** 2).sum(1).mean()) - grzo_conditional_second_moment(u, grads))
    return mean_error / scale, second_error / scale**2


# --- a batch-invariant model, for data parallelism --------------------------------------

class BatchInvariantModel(nn.Module):
    """Every kind of parameter GRZO perturbs, in a float64 forward whose per-example bits
    provably do not depend on the other examples of the batch (so 2 ranks with b examples
    each compute the losses the single process computes for the same examples):

    * an embedding (a gather) and a Linear(2, 2) without bias on features that are
      powers of two: W x, and the hook's U (s ⊙ x), are sums of two exact products,
      rounded once, the same in any order, with or without FMA, whatever W is;
    * LayerNorm and RMSNorm over 2 channels, row by row;
    * per-example losses summed over positions and channels one term at a time
      (elementwise operations on B-vectors), not by a reduction kernel."""

    def __init__(self, vocab: int = 7, seed: int = 0):
        super().__init__()
        self.tok = nn.Embedding(vocab, 2)
        self.lin = nn.Linear(2, 2, bias=False)
        self.norm = nn.LayerNorm(2)
        self.rms = nn.RMSNorm(2, eps=1e-6)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-3, 4, p.shape, generator=generator).to(p.dtype))
        self.double()

    def forward(self, tokens, features, targets) -> torch.Tensor:
        h = self.rms(self.norm(self.tok(tokens) + self.lin(features)))
        losses = torch.zeros(tokens.shape[0], dtype=torch.float64)
        for t in range(tokens.shape[1]):
            for c in range(2):
                losses = losses + (h[:, t, c] - targets[:, t, c]) ** 2
        return losses


def batch_invariant_data(batch: int, length: int = 3, vocab: int = 7, seed: int = 1) -> tuple:
    """(tokens, features, targets) for ``BatchInvariantModel``: features in ±{1/2, 1, 2}."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    magnitude = 2.0 ** torch.randint(-1, 2, (batch, length, 2), generator=generator)
    sign = 1 - 2 * torch.randint(0, 2, (batch, length, 2), generator=generator)
    targets = torch.randint(-2, 3, (batch, length, 2), generator=generator).to(torch.float64)
    return tokens, (magnitude * sign).to(torch.float64), targets


def zeroth_order_optimizer(method: str, model, group=None):
    """The optimizer the data-parallel comparison steps: GRZO (paper's "std") or MeZO."""
    if method == "GRZO":
        return fk.GRZO(model, lr=0.05, sigma=1e-2, seed=11, group=group)
    if method == "MeZO":
        return fk.MeZO(model, lr=0.05, eps=1e-2, seed=11, group=group)
    raise ValueError(f"method must be GRZO or MeZO, got {method!r}")


def mean_of_rank_means(losses: torch.Tensor, sizes: list) -> torch.Tensor:
    """What MeZO's data-parallel loss is: the mean over the ranks, whose local batches
    are ``sizes`` (in rank order), of each rank's mean loss, in the order the all-reduce
    forms it (the sum over ranks, then the division): each rank weighs 1/W."""
    total = torch.zeros((), dtype=torch.float64)
    for part in losses.split(sizes):
        total = total + part.mean()
    return total / len(sizes)


def zeroth_order_steps(method: str, steps: int, data: tuple, group=None, sizes=None) -> dict:
    """The parameters of ``BatchInvariantModel`` after ``steps`` steps on ``data`` (this
    process's examples), as {name: tensor}. Single process (``group`` None): MeZO's loss
    is that of ranks with local batches ``sizes`` (None: one rank holding all of ``data``)."""
    sizes = sizes or [len(data[0])]
    model = BatchInvariantModel()
    opt = zeroth_order_optimizer(method, model, group)
    if method == "GRZO":
        def closure():
            return model(*data)
    else:
        def closure():
            # the single process (group None) forms the mean of the ranks' means itself
            losses = model(*data)
            return losses.mean() if group is not None else mean_of_rank_means(losses, sizes)
    for _ in range(steps):
        opt.step(closure)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
