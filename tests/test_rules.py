"""Rules: hyperparameter validation, the host scalars, state layout, and that
hyperparameters and the step reach the kernel as runtime values."""

import inspect
import math

import numpy as np
import pytest
import torch
import triton.language as tl

import forge_kernels as fk
from forge_kernels.ops import fused_weight_update as fwu_module
from forge_kernels.ops import weight_gradient as wg_module

ALL_RULES = [fk.AdamW(), fk.Adam(), fk.SGD(), fk.SGD(momentum=0.9), fk.SGD(momentum=0.9, nesterov=True),
             fk.Lion(), fk.RMSprop(), fk.RMSprop(momentum=0.9, centered=True), fk.Adagrad()]


@pytest.mark.parametrize("make, message", [
    (lambda: fk.AdamW(lr=-1e-3), "lr=-0.001 is outside"),
    (lambda: fk.AdamW(betas=(1.0, 0.999)), r"betas\[0\]=1.0 is outside"),
    (lambda: fk.AdamW(betas=(0.9,)), "betas must be a pair"),
    (lambda: fk.AdamW(eps=float("nan")), "eps=nan is outside"),
    (lambda: fk.AdamW(lr="0.1"), "lr must be a real number"),
    (lambda: fk.Adam(weight_decay=0.1), "use AdamW for decoupled decay"),
    (lambda: fk.SGD(nesterov=True), "Nesterov momentum requires"),
    (lambda: fk.SGD(momentum=0.9, dampening=0.1, nesterov=True), "Nesterov momentum requires"),
    (lambda: fk.SGD(dampening=1.5), "dampening=1.5 is outside"),
    (lambda: fk.Lion(betas=(0.9, 1.5)), r"betas\[1\]=1.5 is outside"),
    (lambda: fk.RMSprop(alpha=-0.1), "alpha=-0.1 is outside"),
    (lambda: fk.Adagrad(lr_decay=-1.0), "lr_decay=-1.0 is outside"),
])
def test_bad_hyperparameters_are_refused(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize("make", [
    lambda eps: fk.AdamW(eps=eps), lambda eps: fk.Adam(eps=eps), lambda eps: fk.RMSprop(eps=eps),
    lambda eps: fk.RMSprop(eps=eps, momentum=0.9, centered=True), lambda eps: fk.Adagrad(eps=eps),
    lambda eps: fk.Adagrad(eps=eps, initial_accumulator_value=0.1)],
    ids=["AdamW", "Adam", "RMSprop", "RMSprop-centered", "Adagrad", "Adagrad-initial"])
def test_zero_eps_is_refused(make):
    """eps is the denominators' floor: with eps=0 one zero gradient element of a zero state
    divides 0 by 0, and the step then stopped blaming the gradient, weight or state. A
    centered RMSprop's variance estimate is 0 for any constant gradient, and q8 state
    stores an Adagrad sum below 2**-36 of its block's largest as 0 even when the sums
    start above 0, so no setting makes 0 safe."""
    with pytest.raises(ValueError, match=r"eps=0.0 is outside \(0.0, inf\]: eps must be > 0"):
        make(0.0)
    rule = make(1e-8)
    rule.eps = 0
    with pytest.raises(ValueError, match="eps must be > 0"):
        rule.scalars(1)


def test_switching_momentum_on_after_construction_is_refused():
    rule = fk.SGD(lr=0.1)
    rule.momentum = 0.9
    with pytest.raises(ValueError, match="changes which state the rule keeps"):
        rule.scalars(1)


@pytest.mark.parametrize("rule", ALL_RULES, ids=repr)
def test_scalars_are_fp32_values_padded_to_eight(rule):
    values = rule.scalars(3)
    assert len(values) == 8
    assert all(isinstance(v, float) and float(np.float32(v)) == v for v in values)


def test_adamw_bias_corrections_are_computed_in_one_place():
    rule = fk.AdamW(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    for step in (1, 2, 10, 1000):
        bc1, bc2_sqrt = fk.bias_corrections(0.9, 0.999, step)
        assert bc1 == 1 - 0.9**step and bc2_sqrt == math.sqrt(1 - 0.999**step)
        scalars = rule.scalars(step)
        assert scalars[5] == float(np.float32(1e-3 / bc1)) and scalars[6] == float(np.float32(bc2_sqrt))


def test_sgd_first_step_copies_the_gradient_into_the_buffer():
    rule = fk.SGD(lr=0.1, momentum=0.9, dampening=0.5)
    assert rule.scalars(1)[2:4] == (0.0, 1.0)
    assert rule.scalars(2)[2:4] == (float(np.float32(0.9)), 0.5)


@pytest.mark.parametrize("rule, slots", [
    (fk.AdamW(), ("exp_avg", "exp_avg_sq")), (fk.SGD(), ()), (fk.SGD(momentum=0.5), ("momentum_buffer",)),
    (fk.Lion(), ("exp_avg",)), (fk.RMSprop(centered=True), ("square_avg", "grad_avg")),
    (fk.RMSprop(momentum=0.1), ("square_avg", "momentum_buffer")), (fk.Adagrad(), ("sum",)),
], ids=repr)
def test_state_slots(rule, slots):
    w = torch.randn(3, 4)
    state = rule.init_state(w)
    assert rule.slots == slots and tuple(state) == slots
    assert all(s.dtype == torch.float32 and s.shape == w.shape and s.is_contiguous() for s in state.values())


def test_adagrad_initial_accumulator_value():
    assert torch.all(fk.Adagrad(initial_accumulator_value=0.25).init_state(torch.zeros(2, 2))["sum"] == 0.25)


def _constexpr_params(kernel):
    return {name for name, p in inspect.signature(kernel.fn).parameters.items() if p.annotation is tl.constexpr}


@pytest.mark.parametrize("kernel", [fwu_module._fused_weight_update_kernel, fwu_module._apply_rule_kernel,
                                    wg_module._weight_grad_kernel], ids=lambda k: k.fn.__name__)
def test_only_shapes_tiles_and_flags_are_compile_time(kernel):
    allowed = {"RULE", "VARIANT", "HAS_S0", "HAS_S1", "HAS_S2", "BLOCK_N", "BLOCK_K", "BLOCK_T", "SPLIT", "ROWS",
               "W_BF16", "S_BF16", "S_Q8", "STOCHASTIC", "NONNEGATIVE", "ALIGNED_PAIRS",
               "DEVICE_SCALARS", "DEVICE_GRAD_SCALE", "SQUARE_SUMS", "TMA"}
    assert _constexpr_params(kernel) <= allowed
    params = inspect.signature(kernel.fn).parameters
    assert not any(params[h].annotation is tl.constexpr for h in params if h.startswith("h"))


@pytest.mark.gpu
def test_changing_lr_and_step_does_not_recompile(device):
    """Two hundred steps with a new learning rate each: the compiled-kernel cache does not grow."""
    kernel = fwu_module._fused_weight_update_kernel
    rule = fk.AdamW(lr=1e-3)
    w = torch.randn(64, 64, device=device)
    state = rule.init_state(w)
    x, dy = torch.randn(32, 64, device=device), torch.randn(32, 64, device=device)
    fk.fused_weight_update(x, dy, w, state, rule, 1)
    compiled = sum(len(cache[0]) for cache in kernel.device_caches.values())
    for step in range(2, 202):
        rule.lr = 1e-3 / step
        fk.fused_weight_update(x, dy, w, state, rule, step)
    assert sum(len(cache[0]) for cache in kernel.device_caches.values()) == compiled
