"""GRZO's per-example signs are independent across neighbouring examples, rows and
columns, across successive calls and between a layer's weight rows and its bias, for
every kind of parameter (Linear weight and bias, Embedding, LayerNorm weight and bias,
RMSNorm): the count of +1 among n sign products passes the exact binomial test for
Binomial(n, ½) at a false alarm of 1e-6 per check (independent fair signs make it exactly
that; proofs/zeroth_order.md). The GRZO code's parity rule for norm and embedding signs (a
checkerboard) fails the same check.
"""

import pytest
from torch import nn

import forge_kernels as fk
from forge_kernels.zeroth_order.draws import COL, ROW, CallDraws
from forge_verify.checks.observations import RADIUS, observe
from forge_verify.checks.zeroth_order import neighbour_products, parity_signs
from forge_verify.numerics.stats import sign_product_radius, sign_products_consistent

BATCH = 64


def _model():
    return nn.ModuleDict({"tok": nn.Embedding(80, 16), "norm": nn.LayerNorm(16), "proj": nn.Linear(16, 48),
                          "rms": nn.RMSNorm(48)})


def _draws():
    opt = fk.GRZO(_model(), lr=0.1, seed=2026)
    return opt.targets, CallDraws(opt.seed, 0), CallDraws(opt.seed, 1)


def _slots():
    targets, _, _ = _draws()
    return [(t.name, kind) for t in targets for kind in ((ROW, COL) if t.is_matrix else (ROW,))]


def _check(mean, count):
    observe(abs(mean) / sign_product_radius(count), RADIUS)
    return sign_products_consistent(mean, count)


@pytest.mark.stats
@pytest.mark.parametrize("slot", _slots(), ids=lambda s: f"{s[0]}-{'rows' if s[1] == ROW else 'cols'}")
def test_signs_are_independent_across_examples_indices_and_calls(slot):
    name, kind = slot
    targets, first, second = _draws()
    target = next(t for t in targets if t.name == name)
    signs = first.signs(target, kind, BATCH)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    for what, (mean, count) in neighbour_products(signs).items():
        assert _check(mean, count), f"{name}: {what} sign products average {mean:.4f} over {count}"
    later = second.signs(target, kind, BATCH)
    assert _check((signs * later).mean().item(), signs.numel()), f"{name}: successive calls correlate"


@pytest.mark.stats
def test_a_linears_row_signs_and_its_bias_signs_are_independent():
    targets, draws, _ = _draws()
    weight = next(t for t in targets if t.name == "proj.weight")
    bias = next(t for t in targets if t.name == "proj.bias")
    product = draws.signs(weight, ROW, BATCH) * draws.signs(bias, ROW, BATCH)
    assert _check(product.mean().item(), product.numel())


@pytest.mark.stats
def test_the_grzo_codes_parity_signs_fail_the_check():
    """The planted mistake: a checkerboard's neighbouring products are all -1."""
    means = neighbour_products(parity_signs(BATCH, 48, seed=2026))
    assert not sign_products_consistent(*means["examples"]) and not sign_products_consistent(*means["indices"])
