"""The exactness claims can fail: realistic kernel mistakes are caught by the same
claim functions the properties run."""

import pytest
import torch
import triton
import triton.language as tl

import forge_kernels as fk
from forge_verify import claims
from forge_verify.problems import Problem


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
    from forge_verify import findings

    if not findings.BLOCK_T_CHANGES_BITS[(backend, torch.float32)]:
        pytest.skip(f"on {backend} BLOCK_T does not change fp32 bits (forge_verify.findings)")
    problem = Problem(tokens=512, out_features=40, in_features=24, dtype=torch.float32, steps=1, seed=5)
    with pytest.raises(AssertionError, match="differ bitwise"):
        claims.tiling_invariant(problem, fk.SGD(lr=0.1), fk.TileConfig(block_t=16), fk.TileConfig(block_t=64),
                                device)
