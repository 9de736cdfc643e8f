"""The fp32 enclosure is sound (every fp32 evaluation lands inside), not vacuous (it
is narrow), and it catches a planted scalar mistake that bitwise fused==oracle cannot."""

import mpmath
import numpy as np
import pytest
import torch

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks.catalog import reference_step
from forge_verify.checks.problems import Problem
from forge_verify.numerics import interval
from forge_verify.numerics.bits import ulp_distance
from forge_verify.numerics.interval import Interval
from forge_verify.numerics.reference import ENCLOSURE, POINT, RUNNING_ERROR, TORCH_OPTIM
from forge_verify.numerics.tolerances import FP32_UNDERFLOW


def _fp32(rng, n, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


def test_every_fp32_operation_lands_inside():
    rng = np.random.default_rng(0)
    a, b, c = _fp32(rng, 10_000), _fp32(rng, 10_000, 1e-3), _fp32(rng, 10_000, 1e3)
    ia, ib, ic = (Interval.exact(torch.from_numpy(v)) for v in (a, b, c))
    checks = {
        "add": (ia + ib, a + b),
        "sub": (ia - ic, a - c),
        "mul": (ia * ib, a * b),
        "div": (ia / ic, a / c),
        "sqrt": ((ia * ia).sqrt(), np.sqrt(a * a)),
        # one rounding of a*b + c, as an FMA computes it
        "fma": (ia * ib + ic, (a.astype(np.float64) * b + c).astype(np.float32)),
        "chain": ((ia * ib + ic) / (ia * ia).sqrt(), (a * b + c) / np.sqrt(a * a)),
    }
    for name, (enclosure, value) in checks.items():
        assert bool(enclosure.contains(torch.from_numpy(value)).all()), name


#: float64 values whose square root torch 2.13.0+cpu's float64 sqrt rounds one ulp away
#: from the correctly rounded value (under every ATEN_CPU_CAPABILITY)
TORCH_SQRT_MISSES = [51.0, 78.0, 0.19, 0.198]


def test_square_roots_are_correctly_rounded():
    """Each endpoint is moved outward by one float64 ulp, which covers its rounding only
    if it is the correctly rounded value (proofs/reference_enclosure.md): the float64
    reference's square root, and the enclosure's endpoints, are mpmath's at 53 bits."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(np.concatenate([TORCH_SQRT_MISSES, np.abs(rng.standard_normal(2000))
                                         * 10.0 ** rng.integers(-30, 30, 2000)]))
    with mpmath.workprec(53):
        rounded = torch.tensor([float(mpmath.sqrt(v)) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(POINT.sqrt(x), rounded)
    # torch's own float64 sqrt, which TORCH_OPTIM (running_error(2)) models as within one ulp
    # (not necessarily the nearest: which inputs it misses depends on the build)
    assert int(ulp_distance(torch.sqrt(x), rounded).max()) <= 1
    # the model's widening of the correctly rounded endpoint, once each way
    expected_lo = torch.nextafter(rounded, torch.zeros_like(rounded))
    expected_lo = torch.nextafter(expected_lo - (interval._OP_UNIT * expected_lo + FP32_UNDERFLOW),
                                  torch.full_like(rounded, -torch.inf)).clamp_min(0)
    assert torch.equal(Interval.exact(x).sqrt().lo, expected_lo)


def test_running_error_bounds_hold_the_exact_value():
    """RUNNING_ERROR's bounds are sound: each operation's exact value (mpmath at 200 bits,
    from the same float64 inputs and host scalar) lies within the bound of the float64 one."""
    rng = np.random.default_rng(1)
    a, b, c = (torch.from_numpy(rng.standard_normal(500) * scale) for scale in (1.0, 1e-3, 1e3))
    A = RUNNING_ERROR
    ra, rb, rc = A.value(a), A.value(b), A.value(c)
    ops = {
        "add": (ra + rb, lambda x, y, z: x + y),
        "mul-sub": (ra * rb - rc, lambda x, y, z: x * y - z),
        "div": (ra / (rc * rc), lambda x, y, z: x / (z * z)),
        "sqrt-chain": (((ra * ra + A.const(0.1) * (rb * rb)).sqrt() + A.const(1e-6)) / rc,
                       lambda x, y, z: (mpmath.sqrt(x * x + mpmath.mpf(0.1) * (y * y)) + mpmath.mpf(1e-6)) / z),
    }
    with mpmath.workprec(200):
        for name, (rounded, exact) in ops.items():
            values = [exact(*(mpmath.mpf(float(t[i])) for t in (a, b, c))) for i in range(len(a))]
            distance = [abs(mpmath.mpf(float(v)) - e) for v, e in zip(rounded.value, values)]
            assert all(d <= float(bound) for d, bound in zip(distance, rounded.error)), name


def test_underflow_lands_inside():
    tiny = torch.tensor([1e-38, 3e-39, 1e-45], dtype=torch.float32)
    product = (tiny.numpy() * np.float32(0.37)).astype(np.float32)
    assert bool((Interval.exact(tiny) * 0.37).contains(torch.from_numpy(product)).all())


def test_enclosure_of_an_adamw_step_is_narrow():
    """Not vacuous: the radius is a few fp32 ulps of the weight plus the step's size (lr)."""
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    rule = fk.AdamW(lr=1e-3)
    state = {k: ENCLOSURE.value(v) for k, v in rule.init_state(w).items()}
    w_enc, _ = reference_step(rule, ENCLOSURE.value(w), ENCLOSURE.value(g), state, 1, ENCLOSURE)
    scale = torch.finfo(torch.float32).eps * (w.abs().double() + rule.lr)
    assert float((w_enc.radius / scale).max()) < 8


@pytest.mark.parametrize("arithmetic", [POINT, ENCLOSURE], ids=lambda a: a.name)
def test_reference_matches_torch_optim_on_sgd(arithmetic):
    """The reference is the textbook rule: plain SGD with decay equals torch.optim.SGD in fp64."""
    gen = torch.Generator().manual_seed(1)
    w, g = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randn(8, 8, generator=gen, dtype=torch.float64)
    rule = fk.SGD(lr=0.1, weight_decay=0.01)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    torch.optim.SGD([p], lr=0.1, weight_decay=0.01).step()
    new_w, _ = reference_step(rule, arithmetic.value(w), arithmetic.value(g), {}, 1, arithmetic)
    if arithmetic is POINT:
        # each side within its running error bound of the exact step: ours RUNNING_ERROR's,
        # torch.optim's TORCH_OPTIM's (proofs/reference_enclosure.md, "Two float64 evaluations")
        ours, theirs = (reference_step(rule, A.value(w), A.value(g), {}, 1, A)[0].error
                        for A in (RUNNING_ERROR, TORCH_OPTIM))
        assert bool(((new_w - p.detach()).abs() <= ours + theirs).all())
    else:
        assert bool(new_w.contains(p.detach()).all())


class _BiasCorrectedTwice(fk.AdamW):
    """A planted mistake in the host scalars: the first bias correction applied twice.
    Fused and oracle share it, so only the reference can notice."""

    def _host_scalars(self, step):
        values = list(super()._host_scalars(step))
        values[5] /= fk.bias_corrections(*self.betas, step)[0]
        return tuple(values)


def test_planted_bias_correction_mistake_leaves_the_enclosure(device, backend):
    problem = Problem(tokens=40, out_features=24, in_features=16, dtype=torch.float32, steps=2, seed=11)
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    claims.within_enclosure(problem, fk.AdamW(**hyper), fk.PINNED, device, backend)
    with pytest.raises(AssertionError, match="outside the proven enclosure"):
        claims.within_enclosure(problem, _BiasCorrectedTwice(**hyper), fk.PINNED, device, backend)


def test_torch_optim_distance_is_zero_where_the_operation_order_is_the_same(device):
    """Plain SGD with a power-of-two learning rate: lr*g is exact, so w - lr*g rounds once
    whether or not torch fuses it into an FMA: 0 ulp. A measurement that reported a
    distance here would be feeding torch.optim a different gradient."""
    from forge_verify.checks.torch_optim import distance_to_torch_optim

    problem = Problem(tokens=50, out_features=20, in_features=30, dtype=torch.float32, steps=3, seed=2)
    assert int(distance_to_torch_optim(problem, fk.SGD(lr=0.0625), device).max()) == 0
    assert int(distance_to_torch_optim(problem, fk.AdamW(lr=1e-3), device).max()) < 64


def test_exact_trajectory_check_resolves_a_few_fp32_ulps(monkeypatch, backend):
    """The mpmath property is not vacuous: an exact trajectory off by one part in a
    million (about eight fp32 ulps) is reported outside the enclosure."""
    from forge_verify.checks import claims as claims_module

    problem = Problem(tokens=16, out_features=6, in_features=6, dtype=torch.float32, steps=2, seed=2)
    rule = fk.SGD(lr=0.1, momentum=0.9)
    claims.exact_inside_enclosure(problem, rule, backend)
    exact = claims_module.to_float64
    monkeypatch.setattr(claims_module, "to_float64", lambda values: exact(values) * (1 + 1e-6))
    with pytest.raises(AssertionError, match="outside the proven enclosure"):
        claims.exact_inside_enclosure(problem, rule, backend)
