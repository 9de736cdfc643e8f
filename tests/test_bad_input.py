"""Every bad input to fused_weight_update gets a clear error, and nothing is written."""

import re

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks.catalog import CATALOG, reference_step
from forge_verify.numerics.bits import int_view


@pytest.fixture
def good(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 12, generator=gen).to(device)
    dy = torch.randn(20, 10, generator=gen).to(device)
    w = torch.randn(10, 12, generator=gen).to(device)
    rule = fk.AdamW(lr=1e-2)
    return x, dy, w, rule.init_state(w), rule


def _call(x, dy, w, state, rule, step=1, **kw):
    fk.fused_weight_update(x, dy, w, state, rule, step, **kw)


@pytest.mark.parametrize("case, error, message", [
    ("x_1d", ValueError, "x must be 2-D"),
    ("x_fp16", TypeError, "activations must be float32 or bfloat16"),
    ("x_int", TypeError, "activations must be float32 or bfloat16"),
    ("dy_dtype", TypeError, "dy is torch.bfloat16 but x is torch.float32"),
    ("weight_fp16", TypeError, "weights must be float32 or bfloat16"),
    ("tokens", ValueError, "x has 20 tokens (rows) but dy has 19"),
    ("in_features", ValueError, "but x has 11 input features"),
    ("out_features", ValueError, "but dy has 9 output features"),
    ("weight_strided", ValueError, "weight must be contiguous"),
    ("device", ValueError, "but kernels run on"),
    ("not_tensor", TypeError, "x must be a torch.Tensor"),
])
def test_bad_tensors_are_refused(good, case, error, message):
    x, dy, w, state, rule = good
    if case == "x_1d":
        x = x[0]
    elif case == "x_fp16":
        x, dy = x.half(), dy.half()
    elif case == "x_int":
        x, dy = x.int(), dy.int()
    elif case == "dy_dtype":
        dy = dy.bfloat16()
    elif case == "weight_fp16":
        w = w.half()
    elif case == "tokens":
        dy = dy[:19]
    elif case == "in_features":
        x = x[:, :11]
    elif case == "out_features":
        dy = dy[:, :9]
    elif case == "weight_strided":
        w = torch.randn(12, 10, device=w.device).t()
        state = rule.init_state(w.contiguous())
    elif case == "device":
        x = x.to("meta")
        dy = dy.to("meta")
    elif case == "not_tensor":
        x = x.tolist()
    before = w.clone()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        _call(x, dy, w, state, rule)
    if case not in ("weight_fp16", "weight_strided"):
        assert torch.equal(w, before)


def test_state_from_another_rule_is_refused(good):
    x, dy, w, _, rule = good
    with pytest.raises(ValueError, match="was it made by another rule"):
        _call(x, dy, w, fk.SGD(momentum=0.9).init_state(w), rule)


@pytest.mark.parametrize("problem, message", [
    ("dtype", "state is stored as float32 or bfloat16"),
    ("mixed", "state slots mix dtypes"),
    ("shape", "has shape"),
    ("not_dict", "state must be a dict"),
    ("strided", "must be contiguous"),
])
def test_malformed_state_is_refused(good, problem, message):
    x, dy, w, state, rule = good
    if problem == "dtype":
        state["exp_avg"] = state["exp_avg"].double()
    elif problem == "mixed":
        state["exp_avg_sq"] = state["exp_avg_sq"].bfloat16()
    elif problem == "shape":
        state["exp_avg"] = state["exp_avg"][:5]
    elif problem == "not_dict":
        state = list(state.values())
    elif problem == "strided":
        state["exp_avg"] = torch.zeros(12, 10, device=w.device).t()
    with pytest.raises((TypeError, ValueError), match=message):
        _call(x, dy, w, state, rule)


@pytest.mark.parametrize("alias", ["state_is_weight", "x_is_weight", "two_slots_one_tensor"])
def test_overlapping_tensors_are_refused(good, alias):
    x, dy, w, state, rule = good
    if alias == "state_is_weight":
        state["exp_avg"] = w
    elif alias == "x_is_weight":
        w = torch.randn(12, 12, device=w.device)
        x, dy, state = w, torch.randn(12, 12, device=w.device), rule.init_state(w)
    elif alias == "two_slots_one_tensor":
        state["exp_avg_sq"] = state["exp_avg"]
    with pytest.raises(ValueError, match="share memory"):
        _call(x, dy, w, state, rule)


@pytest.mark.parametrize("written, other, message", [
    ("square_sums", "weight", "weight and square_sums share memory"),
    ("square_sums", "state", "state['exp_avg_sq'] and square_sums share memory"),
    ("square_sums", "x", "square_sums and x share memory"),
    ("square_sums", "dy", "square_sums and dy share memory"),
    ("grad_scale", "weight", "weight and grad_scale share memory"),
    ("grad_scale", "state", "state['exp_avg'] and grad_scale share memory"),
    ("grad_scale", "square_sums", "square_sums and grad_scale share memory"),
])
def test_square_sums_and_a_device_grad_scale_sharing_memory_are_refused(good, written, other, message):
    """square_sums is written and a device grad_scale is read while the weight, state and
    sums are written: either inside another tensor of the call was accepted, and the step
    wrote a tile's sum of squares into the weight (or read a scale the step was writing)."""
    x, dy, w, state, rule = good
    sums = fk.empty_square_sums(w.shape, device=w.device)
    host = {"weight": w, "state": state["exp_avg_sq" if written == "square_sums" else "exp_avg"], "x": x, "dy": dy,
            "square_sums": sums}[other]
    alias = host.view(-1)[:sums.numel()].view(sums.shape) if written == "square_sums" else host.view(-1)[:1]
    options = {"square_sums": sums, "grad_scale": torch.ones(1, device=w.device)}
    options[written] = alias
    before = {name: t.clone() for name, t in (("weight", w), ("x", x), ("dy", dy), *state.items())}
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(x, dy, w, state, rule, **options)
    for name, tensor in (("weight", w), ("x", x), ("dy", dy), *state.items()):
        assert torch.equal(tensor, before[name]), name


def test_apply_rule_refuses_a_device_grad_scale_in_the_weight(good):
    _, _, w, state, rule = good
    before = w.clone()
    with pytest.raises(ValueError, match=re.escape("weight and grad_scale share memory")):
        fk.apply_rule(torch.randn_like(w), w, state, rule, 1, grad_scale=w.view(-1)[:1])
    assert torch.equal(w, before)


@pytest.mark.parametrize("step", [0, -1, 1.5, True, "1"])
def test_bad_step_is_refused(good, step):
    x, dy, w, state, rule = good
    with pytest.raises(ValueError, match="step must be an integer >= 1"):
        _call(x, dy, w, state, rule, step)


def test_bad_rounding_seed_and_state_format_are_refused(good):
    x, dy, w, state, rule = good
    with pytest.raises(ValueError, match="rounding must be one of"):
        _call(x, dy, w, state, rule, rounding="up")
    with pytest.raises(ValueError, match="seed must be an integer"):
        _call(x, dy, w, state, rule, seed=-3)
    with pytest.raises(ValueError, match="state_format must be one of"):
        rule.init_state(w, state_format="fp8")


@pytest.mark.parametrize("rule, message", [
    (fk.AdamW(eps=1e-46), "1e-46 is not representable in float32"),
    (fk.SGD(lr=1e39), "is not representable in float32"),
], ids=["eps_underflows", "lr_overflows"])
def test_hyperparameter_not_representable_in_fp32_is_refused(good, rule, message):
    x, dy, w, _, _ = good
    with pytest.raises(ValueError, match=message):
        _call(x, dy, w, rule.init_state(w), rule)


def test_bad_config_and_rule_are_refused(good):
    x, dy, w, state, rule = good
    with pytest.raises(TypeError, match="config must be a forge_kernels.TileConfig"):
        _call(x, dy, w, state, rule, config=(64, 64, 32))
    with pytest.raises(TypeError, match="rule must be a forge_kernels Rule"):
        _call(x, dy, w, state, torch.optim.AdamW)
    with pytest.raises(ValueError, match="block_t=24"):
        fk.TileConfig(block_t=24)
    for maxnreg in (100, 16, 256, True, 128.0):
        with pytest.raises(ValueError, match="maxnreg"):
            fk.TileConfig(maxnreg=maxnreg)
    for split, block_k in ((3, 64), (16, 256), (8, 64), (4, 32), (2.0, 64)):
        with pytest.raises(ValueError, match="epilogue_split"):
            fk.TileConfig(block_k=block_k, epilogue_split=split)
    with pytest.raises(ValueError, match="leaving row slices of at least 16"):
        fk.TileConfig(block_n=16, block_k=256, epilogue_split=2, epilogue_axis="rows")
    with pytest.raises(ValueError, match="epilogue_axis='diagonal'"):
        fk.TileConfig(epilogue_axis="diagonal")
    for stages in (0, 5, 2.0, True, "2"):
        with pytest.raises(ValueError, match=f"epilogue_stages={stages!r}: must be None"):
            fk.TileConfig(128, 128, 64, 8, 3, epilogue_split=8, kernel="hopper", epilogue_axis="rows",
                          epilogue_stages=stages)
    with pytest.raises(ValueError, match="epilogue_stages=3: only the split Hopper kernel"):
        fk.TileConfig(epilogue_stages=3)
    for name in ("wgmma_in_flight", "in_kernel_check"):
        for flag in (1, "True", None):
            with pytest.raises(TypeError, match=f"{name}={flag!r}: must be True or False"):
                fk.TileConfig(128, 128, 64, 8, 4, epilogue_split=8, kernel="hopper", epilogue_axis="rows",
                              **{name: flag})
        with pytest.raises(ValueError, match=f"{name}=True: only the split Hopper kernel"):
            fk.TileConfig(**{name: True})
    with pytest.raises(ValueError, match="block_k / epilogue_split >= 32"):
        _call(x, dy, w, rule.init_state(w, "q8"), rule, config=fk.TileConfig(block_k=64, epilogue_split=4))


@pytest.mark.parametrize("grad_scale, error, message", [
    (-0.5, ValueError, "grad_scale=-0.5 is outside"), (float("nan"), ValueError, "grad_scale=nan"),
    (True, TypeError, "grad_scale must be a real number"), (0.1, ValueError, "not a float32 value")])
def test_bad_grad_scale_is_refused_before_anything_is_written(good, grad_scale, error, message):
    x, dy, w, state, rule = good
    before = w.clone()
    with pytest.raises(error, match=message):
        _call(x, dy, w, state, rule, grad_scale=grad_scale)
    assert torch.equal(w, before)


@pytest.mark.parametrize("field, value", [
    ("block_n", 64.0), ("block_k", True), ("block_t", 32.0), ("num_warps", True), ("num_warps", 4.0),
    ("num_stages", 2.5), ("num_stages", 2.0), ("num_stages", True), ("num_stages", "2")])
def test_config_integers_must_be_ints(field, value):
    """Equal-comparing floats and bools passed the range checks and failed later, inside
    torch.zeros (block_n=64.0) or the launch (num_stages=2.5)."""
    with pytest.raises(TypeError, match=rf"TileConfig.{field}={value!r}: must be an int, not {type(value).__name__}"):
        fk.TileConfig(**{field: value})


def test_maxnreg_is_passed_as_a_launch_option():
    """A register cap goes to the launch (the compiler's option), and only when set;
    that it changes no bit is tests/test_epilogue_split.py's."""
    assert "maxnreg" not in fk.PINNED.launch_options()
    assert fk.TileConfig(num_warps=8, maxnreg=128).launch_options()["maxnreg"] == 128


def test_hyperparameter_changed_to_invalid_value_is_refused_at_launch(good):
    x, dy, w, state, rule = good
    rule.lr = -1.0
    before = w.clone()
    with pytest.raises(ValueError, match="lr=-1.0 is outside"):
        _call(x, dy, w, state, rule)
    assert torch.equal(w, before)


@pytest.mark.parametrize("where", ["x", "dy"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_inputs_write_nothing(good, where, value):
    """The error counts each input's non-finite elements under the input's name."""
    x, dy, w, state, rule = good
    (x if where == "x" else dy)[3, 4] = value
    (x if where == "x" else dy)[5, 1] = value
    counts = "x: 2, dy: 0" if where == "x" else "x: 0, dy: 2"
    before = (w.clone(), {k: v.clone() for k, v in state.items()})
    with pytest.raises(fk.NonFiniteInputError, match=f"NaN or infinite elements in {counts}; nothing was updated"):
        _call(x, dy, w, state, rule)
    assert torch.equal(w, before[0])
    assert all(torch.equal(state[k], before[1][k]) for k in state)


# The interpreter's numpy reports the overflow this test provokes on purpose.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("config, tiles, row, rows, columns", [
    (fk.TileConfig(block_n=16, block_k=16, block_t=16), 9, 5, (0, 16), (16, 32)),
    # 64-column tiles whose epilogue runs on 16-column slices: the slice is what is skipped.
    (fk.TileConfig(block_n=16, block_k=64, block_t=16, epilogue_split=4), 12, 5, (0, 16), (16, 32)),
    # 64-row tiles in 16-row slices, the overflow in the second: rows 16:32 of the tile (not
    # its 40 rows, nor another slice) are skipped.
    (fk.TileConfig(block_n=64, block_k=16, block_t=16, epilogue_split=4, epilogue_axis="rows"), 12, 21, (16, 32),
     (16, 32))],
    ids=["whole", "split", "row-split"])
def test_overflowing_tile_is_left_unchanged_and_reported(device, oracle, config, tiles, row, rows, columns):
    """A finite x and dy whose product overflows fp32 in one tile: that tile keeps its
    old weight and state, the others step, and the call says which tile it was."""
    x = torch.ones(4, 40, device=device)
    dy = torch.ones(4, 40, device=device)
    x[:, 20] = 1e20
    dy[:, row] = 1e20  # only dW[row, 20] = 4e40 overflows; SGD squares nothing, so no other element does
    w = torch.ones(40, 40, device=device)
    rule = fk.SGD(lr=1e-2, momentum=0.9)
    state = rule.init_state(w)
    (r0, r1), (c0, c1) = rows, columns
    with pytest.raises(fk.NonFiniteUpdateError,
                       match=rf"1 of {tiles} weight tiles .* rows {r0}:{r1}, columns {c0}:{c1}") as info:
        _call(x, dy, w, state, rule, config=config, oracle=oracle)
    assert info.value.tiles == [(r0, r1, c0, c1)]
    assert torch.all(w[r0:r1, c0:c1] == 1) and torch.all(state["momentum_buffer"][r0:r1, c0:c1] == 0)
    outside = torch.ones_like(w, dtype=torch.bool)
    outside[r0:r1, c0:c1] = False
    assert torch.all(w[outside] != 1)
    assert torch.isfinite(w).all() and all(torch.isfinite(s).all() for s in state.values())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_weight_is_not_propagated(good):
    x, dy, w, state, rule = good
    w[2, 3] = float("nan")
    with pytest.raises(fk.NonFiniteUpdateError):
        _call(x, dy, w, state, rule)
    assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()


def test_no_tokens_steps_with_zero_gradient(device):
    """T = 0 is the empty sum: the rule runs with g = 0 (SGD: only weight decay acts)."""
    w = torch.full((5, 7), 2.0, device=device)
    rule = fk.SGD(lr=0.5, weight_decay=0.1)
    fk.fused_weight_update(torch.empty(0, 7, device=device), torch.empty(0, 5, device=device),
                           w, rule.init_state(w), rule, 1)
    assert torch.all(w == torch.tensor(2.0) - torch.tensor(0.5) * (torch.tensor(0.1) * torch.tensor(2.0)))


@pytest.mark.parametrize("shape", [(0, 7), (5, 0)])
def test_empty_weight_is_a_no_op(shape, device):
    """An empty weight takes no step: nothing is launched or written, the state keeps
    its (empty) tensors, a deferred report is clean, and the oracle path agrees."""
    n, k = shape
    w = torch.empty(n, k, device=device)
    rule = fk.AdamW()
    state = rule.init_state(w)
    x, dy = torch.randn(3, k, device=device), torch.randn(3, n, device=device)
    assert fk.fused_weight_update(x, dy, w, state, rule, 1) is None
    assert w.shape == shape and all(v.shape == shape for v in state.values())
    report = fk.fused_weight_update(x, dy, w, state, rule, 2, report="defer")
    report.check()  # a clean report: nothing to raise
    assert fk.fused_weight_update(x, dy, w, state, rule, 3, oracle=True) is None


def _signless_update(w, g, s0, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7, VARIANT):
    return w - h0 * g, s0, s1, s2


def test_rule_kernel_built_for_the_other_backend_is_refused(good):
    """A rule whose @triton.jit ran before forge_kernels chose interpreter or compiler
    would fail deep inside Triton; it is refused up front instead."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    x, dy, w, _, _ = good
    wrong = JITFunction(_signless_update) if fk.interpreting() else InterpretedFunction(_signless_update)
    rule = type("WrongBackendSGD", (fk.SGD,), {"update": wrong})(lr=0.1)
    with pytest.raises(RuntimeError, match="import forge_kernels before defining kernels"):
        _call(x, dy, w, {}, rule)


def test_apply_rule_on_the_kernel_gradient_is_the_oracle(good):
    x, dy, w, state, rule = good
    w_oracle, s_oracle = w.clone(), {k: v.clone() for k, v in state.items()}
    fk.fused_weight_update(x, dy, w_oracle, s_oracle, rule, 1, oracle=True)
    fk.apply_rule(fk.weight_gradient(x, dy), w, state, rule, 1)
    assert torch.equal(w, w_oracle) and all(torch.equal(state[k], s_oracle[k]) for k in state)


@pytest.mark.parametrize("case, error, message", [
    ("dtype", TypeError, "grad is torch.bfloat16; the rule takes a float32 gradient"),
    ("shape", ValueError, r"grad has shape \(10, 11\), the weight \(10, 12\)"),
    ("strided", ValueError, "grad must be contiguous"),
    ("alias", ValueError, "share memory"),
    ("nan", fk.NonFiniteInputError, "nothing was updated"),
])
def test_apply_rule_refuses_bad_gradients(good, case, error, message):
    _, _, w, state, rule = good
    grad = torch.randn_like(w)
    if case == "dtype":
        grad = grad.bfloat16()
    elif case == "shape":
        grad = grad[:, :11]
    elif case == "strided":
        grad = torch.randn(12, 10, device=w.device).t()
    elif case == "alias":
        grad = state["exp_avg"]
    elif case == "nan":
        grad[0, 0] = float("nan")
    before = w.clone()
    with pytest.raises(error, match=message):
        fk.apply_rule(grad, w, state, rule, 1)
    assert torch.equal(w, before)


# The slots that square (and so accumulate) the gradient are those that only hold values
# >= 0 (``Rule.nonnegative``): AdamW/Adam exp_avg_sq, RMSprop square_avg, Adagrad sum.
_SQUARED_SLOTS = [pytest.param(entry, slot, id=f"{entry.name}-{slot}")
                  for entry in CATALOG for slot in entry.gate.nonnegative]
# The largest value each state format stores: fp32 and bf16 their finite maximum; a q8
# value must lie below 2**MAX_EXPONENT, its largest block exponent.
_FORMAT_MAX = {"fp32": torch.finfo(torch.float32).max, "bf16": torch.finfo(torch.bfloat16).max,
               "q8": 2.0 ** fk.q8.MAX_EXPONENT}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("oracle", [False, True], ids=["fused", "oracle"])
@pytest.mark.parametrize("state_format", ["fp32", "bf16", "q8"])
@pytest.mark.parametrize("entry, slot", _SQUARED_SLOTS)
def test_gradient_whose_square_overflows_the_state_writes_nothing(entry, slot, state_format, oracle, device):
    """One finite element of dW large enough that the slot's new value (a multiple of its
    square) exceeds what the state format stores: the tile, here the whole 4 x 40 weight,
    is refused, and the weight and every slot keep their bits. The weight stays finite
    (the huge denominator makes its step 0), so only the slot's own storability check
    catches it: without it inf (or a clamped q8 code) would be written into the state."""
    rule = entry.gate
    assert slot in rule.slots
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 40, generator=gen).to(device)
    state = rule.init_state(w, state_format=state_format)
    # The slot's coefficient of g*g in one step from the initial state, from the fp64
    # reference (1 - beta2, 1 - alpha, 1), sets the gradient: twice the format's maximum.
    ones, zeros = (torch.full((1, 1), v, dtype=torch.float64) for v in (1.0, 0.0))
    initial = {name: torch.full((1, 1), rule.initial_value(name), dtype=torch.float64) for name in rule.slots}
    coefficient = float(reference_step(rule, ones, ones, initial, 1)[1][slot] -
                        reference_step(rule, ones, zeros, initial, 1)[1][slot])
    g = float(torch.tensor((2 * _FORMAT_MAX[state_format] / coefficient) ** 0.5, dtype=torch.float32))
    assert g < torch.finfo(torch.float32).max
    # dW = dyᵀx: three ordinary tokens, and one that puts g at dW[2, 17] alone.
    x = torch.randn(4, 40, generator=gen) * 0.1
    dy = torch.randn(4, 4, generator=gen) * 0.1
    x[3], dy[3] = 0.0, 0.0
    x[3, 17], dy[3, 2] = g, 1.0
    x, dy = x.to(device), dy.to(device)
    grad = (dy.T.double() @ x.double()).cpu()
    assert float(reference_step(rule, w.double().cpu()[2:3, 17:18], grad[2:3, 17:18],
                                {k: v.double() for k, v in initial.items()}, 1)[1][slot]) > _FORMAT_MAX[state_format]
    before = (int_view(w).clone(), {k: int_view(v).clone() for k, v in state.items()})
    with pytest.raises(fk.NonFiniteUpdateError, match="1 of 1 weight tiles") as info:
        _call(x, dy, w, state, rule, oracle=oracle)
    assert info.value.tiles == [(0, 4, 0, 40)]
    assert torch.equal(int_view(w), before[0]), "weight written"
    for name in state:
        assert torch.equal(int_view(state[name]), before[1][name]), f"state[{name!r}] written"
