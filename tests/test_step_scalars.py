"""StepScalars: a step whose scalars and rounding key are read from device memory is
bitwise the step given as a number, in every storage regime, on both paths; on a GPU,
a CUDA graph captured once and replayed at later steps (``set`` before each replay)
gives the uncaptured steps' bits; and what a capture would get wrong is refused."""

import pytest
import torch

import forge_kernels as fk
from forge_verify import assert_bitwise_equal

N, K, T = 24, 40, 17
CONFIG = fk.TileConfig(block_n=16, block_k=32, block_t=16)
REGIMES = {"fp32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16"), "q8": (torch.bfloat16, "q8")}


def _inputs(device, weight_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(N, K, generator=gen) * 0.1).to(weight_dtype)
    return (weight.to(device), torch.randn(T, K, generator=gen).to(device),
            (torch.randn(T, N, generator=gen) * 0.1).to(device))


def _same(a_weight, a_state, b_weight, b_state):
    assert_bitwise_equal(a_weight, b_weight, "weight")
    for key in a_state:
        assert_bitwise_equal(a_state[key], b_state[key], key)


@pytest.mark.exactness
@pytest.mark.parametrize("path", ["fused", "apply_rule"])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_device_scalars_step_is_the_numbered_step(regime, path, device):
    weight_dtype, state_format = REGIMES[regime]
    weight, x, dy = _inputs(device, weight_dtype)
    rule = fk.AdamW(lr=1e-2)
    scalars = fk.StepScalars(rule, seed=11, device=device)
    w_a, w_b = weight.clone(), weight.clone()
    s_a, s_b = rule.init_state(w_a, state_format), rule.init_state(w_b, state_format)
    for step in (1, 2, 3):
        if path == "fused":
            fk.fused_weight_update(x, dy, w_a, s_a, rule, step, seed=11, config=CONFIG)
            fk.fused_weight_update(x, dy, w_b, s_b, rule, scalars.set(step), seed=11, config=CONFIG)
        else:
            grad = fk.weight_gradient(x, dy, config=CONFIG)
            fk.apply_rule(grad, w_a, s_a, rule, step, seed=11, config=CONFIG)
            fk.apply_rule(grad, w_b, s_b, rule, scalars.set(step), seed=11, config=CONFIG)
        _same(w_a, s_a, w_b, s_b)


def test_step_scalars_refuse_another_rule_seed_or_no_step(device):
    weight, x, dy = _inputs(device, torch.float32)
    rule = fk.AdamW()
    state = rule.init_state(weight)
    scalars = fk.StepScalars(rule, seed=1, device=device)
    with pytest.raises(ValueError, match="never called"):
        fk.fused_weight_update(x, dy, weight, state, rule, scalars, seed=1)
    scalars.set(1)
    with pytest.raises(ValueError, match="another rule"):
        fk.fused_weight_update(x, dy, weight, state, fk.AdamW(), scalars, seed=1)
    with pytest.raises(ValueError, match="seed=2 differs"):
        fk.fused_weight_update(x, dy, weight, state, rule, scalars, seed=2)
    with pytest.raises(ValueError, match="step must be an integer"):
        scalars.set(0)


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        report = fn()
    return graph, report


@pytest.mark.exactness
@pytest.mark.gpu
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_captured_step_replays_the_uncaptured_steps(regime):
    weight_dtype, state_format = REGIMES[regime]
    weight, x, dy = _inputs("cuda", weight_dtype)
    rule = fk.AdamW(lr=1e-2)
    scalars = fk.StepScalars(rule, seed=7, device="cuda").set(1)
    w_graph = weight.clone()
    s_graph = rule.init_state(w_graph, state_format)
    graph, report = _capture(lambda: fk.fused_weight_update(x, dy, w_graph, s_graph, rule, scalars, seed=7,
                                                            config=CONFIG, report="defer"))
    # The warm-up call outside the capture took step 1: start both from its result.
    w_plain, s_plain = w_graph.clone(), {k: v.clone() for k, v in s_graph.items()}
    for step in (2, 3, 4):
        scalars.set(step)
        graph.replay()
        fk.fused_weight_update(x, dy, w_plain, s_plain, rule, step, seed=7, config=CONFIG)
        torch.cuda.synchronize()
        report.check()
        _same(w_graph, s_graph, w_plain, s_plain)


@pytest.mark.gpu
def test_capture_refuses_a_numbered_step_and_report_raise():
    weight, x, dy = _inputs("cuda", torch.float32)
    rule = fk.AdamW()
    state = rule.init_state(weight)
    scalars = fk.StepScalars(rule, device="cuda").set(1)
    for step, report, message in [(1, "defer", "needs its step as"), (scalars, "raise", 'report="defer"')]:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=message):
            with torch.cuda.graph(graph):
                # Something captured before the refusal: an empty graph warns, and warnings are errors here.
                torch.ones(1, device="cuda").add_(1)
                fk.fused_weight_update(x, dy, weight, state, rule, step, report=report)


def test_a_group_writes_each_members_own_step_scalars():
    """StepScalarsGroup (one buffer, keys derived vectorized) holds, for every member, the
    words its own StepScalars.set would write: the same scalars and the same Philox key
    (stream_seed), at seeds and steps at the ends of their ranges."""
    from forge_kernels.ops.step_scalars import StepScalarsGroup
    rule = fk.AdamW(lr=1e-2)
    seeds = [0, 1, 7, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 123456789012345678]
    group = StepScalarsGroup(rule, seeds, device="cpu")
    for step in (1, 2, 1000, 2**31, 2**32 + 5, 2**62, 2**63 - 1):
        group.set(step)
        for seed, member in zip(seeds, group.members):
            own = fk.StepScalars(rule, seed=seed, device="cpu").set(step)
            assert torch.equal(member.words, own.words), f"seed {seed}, step {step}"
            assert member.step == step
