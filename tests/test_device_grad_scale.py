"""A gradient scale held in device memory (a one-element float32 tensor as ``grad_scale``)
gives the bits of the same scale passed as a number, on every path (fused, oracle,
``apply_rule``) and storage regime, also with a ``StepScalars`` step; a negative or
non-finite one stores nothing and reports every tile; a malformed one is refused."""

import pytest
import torch

import forge_kernels as fk
from forge_verify.numerics.bits import assert_bitwise_equal

REGIMES = {  # name: (weight dtype, state format, rounding)
    "fp32": (torch.float32, "fp32", "nearest"),
    "bf16-sr": (torch.bfloat16, "bf16", "stochastic"),
    "q8": (torch.bfloat16, "q8", "stochastic"),
}
CONFIG = fk.TileConfig(16, 32, 16, epilogue_split=1)  # whole q8 blocks per tile, two tiles per row


def _problem(device, w_dtype, state_format, rule):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 64, generator=gen).to(device)
    dy = torch.randn(24, 40, generator=gen).to(device)
    w = (torch.randn(40, 64, generator=gen) * 0.1).to(device, w_dtype)
    state = rule.init_state(w, state_format=state_format)
    if state_format != "q8":
        for value in state.values():  # a nonzero, nonnegative state, as after some steps
            value.copy_(torch.rand(value.shape, generator=gen).to(value.dtype) * 1e-3)
    return x, dy, w, state


def _copies(w, state):
    return w.clone(), {name: value.clone() for name, value in state.items()}


def _step(path, x, dy, w, state, rule, step, **kw):
    if path == "apply_rule":
        grad = fk.weight_gradient(x, dy, config=CONFIG)
        fk.apply_rule(grad, w, state, rule, step, config=CONFIG, **kw)
    else:
        fk.fused_weight_update(x, dy, w, state, rule, step, config=CONFIG, oracle=path == "oracle", **kw)


def _assert_same(a, b, where):
    assert_bitwise_equal(a[0], b[0], f"{where}: weight")
    for name in a[1]:
        assert_bitwise_equal(a[1][name], b[1][name], f"{where}: {name}")


@pytest.mark.parametrize("path", ["fused", "oracle", "apply_rule"])
@pytest.mark.parametrize("regime", REGIMES)
def test_a_device_scale_gives_the_bits_of_the_same_number(device, path, regime):
    w_dtype, state_format, rounding = REGIMES[regime]
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    x, dy, w, state = _problem(device, w_dtype, state_format, rule)
    for scale in (0.0, 0.375, 1.0, 2.5):
        host, on_device = _copies(w, state), _copies(w, state)
        for step in (1, 2):
            _step(path, x, dy, *host, rule, step, rounding=rounding, seed=5, grad_scale=scale)
            _step(path, x, dy, *on_device, rule, step, rounding=rounding, seed=5,
                  grad_scale=torch.tensor([scale], device=device))
        _assert_same(on_device, host, f"{path}, {regime}, scale {scale}")
        if scale != 1.0:  # the scale reached the kernel: the step differs from an unscaled one
            plain = _copies(w, state)
            for step in (1, 2):
                _step(path, x, dy, *plain, rule, step, rounding=rounding, seed=5)
            assert not torch.equal(plain[0], host[0]), f"{path}, {regime}: scale {scale} changed nothing"


def test_a_device_scale_with_step_scalars_is_the_numbered_step_with_the_number(device):
    rule = fk.SGD(lr=0.1, momentum=0.9)
    x, dy, w, state = _problem(device, torch.bfloat16, "bf16", rule)
    numbered, captured_form = _copies(w, state), _copies(w, state)
    scalars = fk.StepScalars(rule, seed=7, device=device)
    for step in (1, 2, 3):
        _step("fused", x, dy, *numbered, rule, step, seed=7, grad_scale=0.5)
        fk.fused_weight_update(x, dy, *captured_form, rule, scalars.set(step), config=CONFIG, seed=7,
                               report="defer", grad_scale=torch.tensor([0.5], device=device)).check()
    _assert_same(captured_form, numbered, "StepScalars with a device scale")


@pytest.mark.parametrize("scale", [-0.5, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("path", ["fused", "apply_rule"])
def test_a_negative_or_non_finite_device_scale_stores_nothing(device, scale, path):
    rule = fk.AdamW(lr=1e-2)
    x, dy, w, state = _problem(device, torch.float32, "fp32", rule)
    before = _copies(w, state)
    with pytest.raises(fk.NonFiniteUpdateError, match="6 of 6 weight tiles"):
        _step(path, x, dy, w, state, rule, 1, grad_scale=torch.tensor([scale], device=device))
    _assert_same((w, state), before, f"scale {scale}")


@pytest.mark.parametrize("make, message", [
    (lambda device: torch.tensor([0.5], dtype=torch.float64, device=device), "one float32 value"),
    (lambda device: torch.tensor([0.5, 0.5], device=device), r"shape \(2,\)"),
    (lambda device: torch.tensor([], device=device), r"shape \(0,\)"),
    (lambda device: torch.tensor([0.5], device="meta"), "grad_scale is on meta"),
])
def test_a_malformed_device_scale_is_refused_before_anything_is_written(device, make, message):
    rule = fk.AdamW(lr=1e-2)
    x, dy, w, state = _problem(device, torch.float32, "fp32", rule)
    before = _copies(w, state)
    with pytest.raises(ValueError, match=message):
        _step("fused", x, dy, w, state, rule, 1, grad_scale=make(device))
    _assert_same((w, state), before, "refused")


class _TensorSubclass(torch.Tensor):
    """A stand-in for a DTensor or any tensor wrapper: its memory is not a plain tensor's."""


def test_a_tensor_subclass_as_the_scale_is_refused(device):
    rule = fk.AdamW(lr=1e-2)
    x, dy, w, state = _problem(device, torch.float32, "fp32", rule)
    before = _copies(w, state)
    with pytest.raises(TypeError, match="must be a plain torch.Tensor, got _TensorSubclass"):
        _step("fused", x, dy, w, state, rule, 1, grad_scale=torch.tensor([0.5], device=device).as_subclass(
            _TensorSubclass))
    _assert_same((w, state), before, "refused")
