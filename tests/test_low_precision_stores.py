"""What the fused kernel stores in the bf16 and q8 formats: exactly the rounding the
statistical tests examine, with the streams the documentation names, and nothing when
a value cannot be stored."""

import numpy as np
import pytest
import torch

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import stream_seed
from forge_verify import assert_bitwise_equal
from forge_verify.checks.claims import decoded_state
from forge_verify.numerics.philox import stochastic_round_reference
from forge_verify.numerics.stats import freedman_radius


def _problem(device, n=20, k=36, t=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, k, generator=gen).to(device), torch.randn(t, n, generator=gen).to(device),
            torch.randn(n, k, generator=gen))


@pytest.mark.exactness
@pytest.mark.parametrize("step, k", [(1, 36), (2, 37), (7, 36)])
def test_fused_bf16_stores_are_the_philox_rounding_of_the_fp32_step(step, k, device):
    """A bf16-weight, bf16-state AdamW step stores, bit for bit, stochastic_round of the fp32
    step taken from the same values: one Philox call per pair of neighbouring columns,
    keyed on the step's stream seed with the pair's index as counter; 16 bits of its word
    0 (low half for the even column, high half for the odd) round the weight, of word
    1 + p the state slot at position p. K = 36 and 37 (odd: a row's last column is
    alone in its pair), and a 16-column tile, so pairs meet tile edges."""
    x, dy, w = _problem(device, k=k)
    rule, seed = fk.AdamW(lr=1e-2), 1234
    config = fk.TileConfig(block_n=16, block_k=16, block_t=16)
    w16 = w.bfloat16().to(device)
    state16 = {k: (torch.rand(w.shape) * (k == "exp_avg_sq") + torch.randn(w.shape) * (k == "exp_avg"))
               .bfloat16().to(device) for k in rule.slots}
    w32, state32 = w16.float(), {k: v.float() for k, v in state16.items()}
    fk.fused_weight_update(x, dy, w16, state16, rule, step, seed=seed, config=config)
    fk.fused_weight_update(x, dy, w32, state32, rule, step, config=config)
    key = stream_seed(seed, step)
    assert_bitwise_equal(w16.cpu(), stochastic_round_reference(w32.cpu(), key, word=0, pairs=True), "weight")
    for position, slot in enumerate(rule.slot_layout):
        if slot is not None:
            expected = stochastic_round_reference(state32[slot].cpu(), key, word=1 + position, pairs=True)
            assert_bitwise_equal(state16[slot].cpu(), expected, slot)


@pytest.mark.exactness
def test_fused_nearest_stores_are_torch_round_to_nearest(device):
    x, dy, w = _problem(device)
    rule = fk.SGD(lr=0.1, momentum=0.9)
    w16, w32 = w.bfloat16().to(device), w.bfloat16().float().to(device)
    s16, s32 = rule.init_state(w16, "bf16"), rule.init_state(w32)
    fk.fused_weight_update(x, dy, w16, s16, rule, 1, rounding="nearest")
    fk.fused_weight_update(x, dy, w32, s32, rule, 1)
    assert_bitwise_equal(w16.cpu(), w32.cpu().bfloat16(), "weight")
    assert_bitwise_equal(s16["momentum_buffer"].cpu(), s32["momentum_buffer"].cpu().bfloat16(), "buffer")


@pytest.mark.parametrize("state_format", ["bf16", "q8"])
def test_state_too_large_for_its_format_is_not_stored(state_format, device):
    """An SGD momentum buffer that would exceed the format (bf16: above the last midpoint,
    so round-to-nearest gives inf; q8: at or above 2**126, where the block exponent clamps)
    leaves its tile untouched, codes and exponents included, and is reported."""
    config = fk.TileConfig(block_n=16, block_k=32, block_t=16)
    x = torch.ones(4, 64, device=device)
    dy = torch.ones(4, 40, device=device)
    rule = fk.SGD(lr=0.0, momentum=0.5)
    w = torch.zeros(40, 64, device=device)
    state = rule.init_state(w, state_format)
    fk.fused_weight_update(x, dy, w, state, rule, 1, config=config, rounding="nearest")
    before = {k: v.clone() for k, v in state.items()}
    big = 3.4e38 if state_format == "bf16" else 1e38
    x[:, 40] = big ** 0.5
    dy[:, 3] = big ** 0.5 / 4
    with pytest.raises(fk.NonFiniteUpdateError, match=r"1 of 6 weight tiles .*rows 0:16, columns 32:64"):
        fk.fused_weight_update(x, dy, w, state, rule, 2, config=config, rounding="nearest")
    for key in state:
        tile = (slice(0, 16), slice(32, 64) if not key.endswith("_exponent") else slice(1, 2))
        assert torch.equal(state[key][tile], before[key][tile]), key
    assert torch.isfinite(decoded_state(rule, state)["momentum_buffer"]).all()


def _q8_second_moment_under_a_constant_gradient(device, rounding, steps=400, rows=32):
    """AdamW (no decay) with a gradient of 1 everywhere on a (rows, 32) weight, q8 state:
    the decoded second moments after ``steps`` steps, and their exact expectation
    y = c (1 - b^steps) / (1 - b) from the rule's fp32 scalars b = beta2, c = 1 - beta2."""
    rule = fk.AdamW(lr=1e-3, weight_decay=0.0)
    x = torch.eye(32, device=device)               # 32 tokens, one per input feature
    dy = torch.ones(32, rows, device=device)        # dW = dyᵀ x = 1
    w = torch.zeros(rows, 32, device=device)
    state = rule.init_state(w, "q8")
    for step in range(1, steps + 1):
        fk.fused_weight_update(x, dy, w, state, rule, step, rounding=rounding, seed=5)
    beta2, one_minus_beta2 = float(np.float32(0.999)), float(np.float32(1 - 0.999))
    exact = one_minus_beta2 * (1 - beta2**steps) / (1 - beta2)
    return decoded_state(rule, state)["exp_avg_sq"].cpu().double(), exact


# The threshold, derived in advance (proofs/stochastic_rounding.md, "q8 codes"): each
# stochastic code store errs by less than a gap <= (1 - 2**(-1/7)) * 2**e <= 0.1886 (block
# values stay below 2, so 2**e <= 2) with conditional variance <= |change| * gap <=
# 0.001 * 0.1886, since the previous value is itself a level of the new map (7 levels per
# octave); the error made at step s reaches step 400 multiplied by beta2**(400 - s).
Q8_SR_ELEMENTS, Q8_SR_STEPS, Q8_SR_BETA2 = 32 * 32, 400, 0.999
Q8_SR_GAP = 2 * (1 - 2 ** (-1 / 7))
Q8_SR_VARIANCE = (Q8_SR_ELEMENTS * 0.001 * Q8_SR_GAP
                  * sum(Q8_SR_BETA2 ** (2 * k) for k in range(Q8_SR_STEPS)))
# 1e-4: the deterministic part (fp32 arithmetic of the rule and the 2**-24 rounding-up
# bias of the 24-bit decision over 400 steps), bounded in the proof.
Q8_SR_RADIUS = freedman_radius(Q8_SR_VARIANCE, Q8_SR_GAP, 1e-9) / Q8_SR_ELEMENTS + 1e-4


@pytest.mark.stats
def test_q8_stochastic_codes_keep_a_slow_second_moment_unbiased(device):
    """With stochastic codes the mean second moment over 1024 elements tracks its exact
    expectation after 400 steps of beta2 = 0.999 (within Freedman's radius at a 1e-9
    false-alarm rate), where nearest codes stall (next test)."""
    v, exact = _q8_second_moment_under_a_constant_gradient(device, "stochastic")
    assert abs(float(v.mean()) - exact) <= Q8_SR_RADIUS, (float(v.mean()), exact, Q8_SR_RADIUS)


def test_q8_nearest_codes_stall_a_slow_second_moment(device):
    """The documented limitation of nearest codes, and the power of the test above: a
    second moment whose per-step change (1 - beta2 of its gap to g**2) is under half a
    level stops moving, far outside the stochastic test's radius."""
    v, exact = _q8_second_moment_under_a_constant_gradient(device, "nearest")
    assert torch.all(v == v[0, 0])
    assert exact - float(v.mean()) > 3 * Q8_SR_RADIUS, (float(v.mean()), exact, Q8_SR_RADIUS)
