"""Which tile configs are exactness-equivalent.

Claim: the bits do not depend on BLOCK_N or BLOCK_K (each element's token sum runs
in the same order whatever tile it sits in), nor on how the first config reads its
operands (masked pointer loads or TMA tensor descriptors: ``TileConfig.operand_loads``;
the second reads by pointers). Whether BLOCK_T changes the bits is a
per-backend finding (forge_verify.numerics.findings): asserted on a fixed problem so that a
change of behaviour is noticed, and where it does not, configs with different
BLOCK_T are drawn into the invariance property too.
"""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks import strategies as fst
from forge_verify.checks.observations import observe
from forge_verify.checks.problems import Problem, make_inputs
from forge_verify.numerics import findings

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("family", sorted(fst.RULES))
@given(data=st.data())
def test_exactness_equivalent_configs_give_same_bits(family, data, device, backend):
    """Configs that differ in BLOCK_N, BLOCK_K (and BLOCK_T, where the backend's finding
    says it does not matter), and in how they read their operands, give the same bits."""
    loads = data.draw(fst.operand_loads(), label="operand_loads")
    unit = fst.TMA_FEATURE_UNIT if loads == "tma" else 1
    problem = data.draw(fst.problems(max_steps=2, feature_unit=unit), label="problem")
    rule = data.draw(fst.RULES[family], label="rule")
    config_a = dataclasses.replace(data.draw(fst.tile_configs(), label="config_a"), operand_loads=loads)
    block_t = config_a.block_t if findings.BLOCK_T_CHANGES_BITS[(backend, problem.dtype)] else None
    config_b = data.draw(fst.tile_configs(block_t=block_t), label="config_b")
    regime = data.draw(fst.regimes(), label="regime")
    claims.tiling_invariant(problem, rule, fst.fit_config(config_a, regime), fst.fit_config(config_b, regime),
                            device, regime=regime)
    observe(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_t_finding(dtype, device, backend):
    """A fixed problem long enough for several token blocks, run with BLOCK_T 16 and 64:
    whether the gradient's bits differ must match the recorded finding."""
    problem = Problem(tokens=512, out_features=48, in_features=40, dtype=dtype, steps=1, seed=7)
    inputs = make_inputs(problem, device)
    x, dy = inputs.batches[0]
    grads = [fk.weight_gradient(x, dy, config=fk.TileConfig(block_t=bt)) for bt in (16, 64)]
    differs = not torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))
    expected = findings.BLOCK_T_CHANGES_BITS[(backend, dtype)]
    assert differs == expected, (
        f"on {backend} with {dtype} activations BLOCK_T {'changed' if differs else 'did not change'} the "
        f"gradient's bits, but forge_verify.numerics.findings records {expected}: update the finding and the README")
    # One level up, the fused update inherits that gradient's bits: at each BLOCK_T it is the
    # rule applied to that BLOCK_T's materialized gradient (the oracle), bit for bit, weight and
    # state. Whether the two weights then differ is the rule's business, not the finding's: AdamW's
    # first step, about lr·sign(g), absorbed the gradients' few-ulp differences on these inputs.
    rule = fk.AdamW(lr=1e-3)
    for block_t in (16, 64):
        claims.fused_matches_oracle(problem, rule, fk.TileConfig(block_t=block_t), device)
    observe(0)
