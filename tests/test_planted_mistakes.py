"""The exactness claims can fail: realistic kernel mistakes are caught by the same
claim functions the properties run."""

import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks.problems import Problem


@triton.jit
def _adamw_update_reordered(w, g, m, v, unused, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                            step_size, bias_correction2_sqrt, eps, VARIANT: tl.constexpr):
    # The same mathematics as adamw_update, with (step_size * m) / denom in place of
    # step_size * (m / denom): one rounding moves.
    w = w * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    w = w - tl.div_rn(step_size * m, denom)
    return w, m, v, unused


class _ReorderedAdamW(fk.AdamW):
    update = _adamw_update_reordered


PROBLEM = Problem(tokens=70, out_features=40, in_features=24, dtype=torch.float32, steps=2, seed=3)


@pytest.mark.exactness
def test_reordered_rule_in_fused_path_is_caught(device):
    hyper = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    with pytest.raises(AssertionError, match="differ bitwise"):
        claims.fused_matches_oracle(PROBLEM, _ReorderedAdamW(**hyper), fk.PINNED, device,
                                    oracle_rule=fk.AdamW(**hyper))


@pytest.mark.exactness
def test_unchanged_rule_passes_the_same_check(device):
    """The control for the test above: same problem, same rule on both paths."""
    rule = fk.AdamW(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    claims.fused_matches_oracle(PROBLEM, rule, fk.PINNED, device)


@pytest.mark.exactness
def test_different_token_block_on_one_path_is_caught(device, backend):
    """Configs chosen per shape (here: a different BLOCK_T) break exactness wherever
    BLOCK_T changes the bits; the claim function reports it."""
    from forge_verify.numerics import findings

    if not findings.BLOCK_T_CHANGES_BITS[(backend, torch.float32)]:
        pytest.skip(f"on {backend} BLOCK_T does not change fp32 bits (forge_verify.numerics.findings)")
    problem = Problem(tokens=512, out_features=40, in_features=24, dtype=torch.float32, steps=1, seed=5)
    with pytest.raises(AssertionError, match="differ bitwise"):
        claims.tiling_invariant(problem, fk.SGD(lr=0.1), fk.TileConfig(block_t=16), fk.TileConfig(block_t=64),
                                device)


@triton.jit
def _lion_sign_zero_is_plus(w, g, m, unused1, unused2, lr, decay, beta1, one_minus_beta1, beta2,
                            one_minus_beta2, h6, h7, VARIANT: tl.constexpr):
    c = beta1 * m + one_minus_beta1 * g
    direction = tl.where(c >= 0, 1.0, -1.0)  # sign(0) taken as +1
    w = w * decay - lr * direction
    m = beta2 * m + one_minus_beta2 * g
    return w, m, unused1, unused2


@triton.jit
def _sgd_nesterov_with_old_buffer(w, g, buf, unused1, unused2, lr, weight_decay, buf_factor, grad_factor,
                                  momentum, h5, h6, h7, VARIANT: tl.constexpr):
    d = g + weight_decay * w
    old = buf
    buf = buf_factor * buf + grad_factor * d
    d = d + momentum * old  # Nesterov must look ahead with the new buffer
    w = w - lr * d
    return w, buf, unused1, unused2


@triton.jit
def _adagrad_eps_inside_sqrt(w, g, state_sum, unused1, unused2, clr, weight_decay, eps, h3, h4, h5, h6, h7,
                             VARIANT: tl.constexpr):
    d = g + weight_decay * w
    state_sum = state_sum + d * d
    std = tl.sqrt_rn(state_sum + eps)
    w = w - clr * tl.div_rn(d, std)
    return w, state_sum, unused1, unused2


MUTANTS = [
    (type("LionSignZeroIsPlus", (fk.Lion,), {"update": _lion_sign_zero_is_plus}), dict(lr=1e-3), True),
    (type("NesterovOldBuffer", (fk.SGD,), {"update": _sgd_nesterov_with_old_buffer}),
     dict(lr=0.1, momentum=0.9, nesterov=True), False),
    (type("AdagradEpsInsideSqrt", (fk.Adagrad,), {"update": _adagrad_eps_inside_sqrt}),
     dict(lr=0.1, eps=1e-3), False),
]


@pytest.mark.parametrize("mutant, hyper, sparse", MUTANTS, ids=[m[0].__name__ for m in MUTANTS])
def test_mistaken_rule_leaves_the_enclosure(mutant, hyper, sparse, device, backend):
    """A rule kernel that is wrong in both paths alike passes fused == oracle; the
    enclosure of the true rule catches it (Lion's on the exact zeros of a sparse dW)."""
    problem = Problem(tokens=40, out_features=24, in_features=18, dtype=torch.float32, steps=2, seed=8,
                      scale=1e-3, sparse=sparse)
    claims.fused_matches_oracle(problem, mutant(**hyper), fk.PINNED, device)
    with pytest.raises(AssertionError, match="outside the proven enclosure"):
        claims.within_enclosure(problem, mutant(**hyper), fk.PINNED, device, backend)
