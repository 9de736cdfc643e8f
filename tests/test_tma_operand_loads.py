"""``TileConfig(operand_loads="tma")``: the portable kernel reading its dy and x blocks
through tensor descriptors computes the same step, bit for bit, as with masked pointer
loads and as the oracle (which reads by pointers), at ragged edges, with operands that are
column slices of wider tensors or start inside them, with and without gradient-norm sums;
the kernel does read through the descriptors; operands TMA cannot copy, GPUs without TMA,
and configs that cannot use it, are refused before anything runs."""

import dataclasses

import pytest
import torch

import forge_kernels as fk
from forge_kernels.ops import fused_weight_update as fwu
from forge_kernels.ops import hopper_support
from forge_kernels.token_split import linear_split_step
from forge_verify.numerics.bits import assert_bitwise_equal

# Compiled, TMA needs sm_90 or later (the refusal on older GPUs is checked below on every backend).
needs_tma = pytest.mark.skipif(not hopper_support.tma_available(),
                               reason="TMA operand loads run on sm_90 and later GPUs; this one is older")

REGIMES = {  # name: (weight dtype, state format, rounding)
    "fp32": (torch.float32, "fp32", "nearest"),
    "bf16-sr": (torch.bfloat16, "bf16", "stochastic"),
    "bf16-rn": (torch.bfloat16, "bf16", "nearest"),
    "q8": (torch.bfloat16, "q8", "stochastic"),
}
# Ragged on every axis: 45 tokens in blocks of 16, 80 rows in tiles of 32, 160 columns in
# tiles of 64 (whole q8 blocks per slice with split 1 or row slices).
POINTERS = fk.TileConfig(32, 64, 16, num_warps=4)
CONFIGS = [POINTERS, fk.TileConfig(32, 64, 16, num_warps=4, epilogue_split=2, epilogue_axis="rows")]
T, N, K = 45, 80, 160


def _operands(device, dtype, padded):
    """x (T, K) and dy (T, N); with ``padded``, each a column slice of a wider tensor whose
    rows are 16-byte multiples apart (TMA reads them; the pointer loads read any strides)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(T, K + (16 if padded else 0), generator=gen).to(device, dtype)
    dy = (torch.randn(T, N + (8 if padded else 0), generator=gen) * 0.1).to(device, dtype)
    return x[:, :K], dy[:, :N]


def _layer(device, regime, rule):
    w_dtype, state_format, _ = REGIMES[regime]
    gen = torch.Generator().manual_seed(12)
    w = (torch.randn(N, K, generator=gen) * 0.1).to(device, w_dtype)
    state = rule.init_state(w, state_format=state_format)
    if state_format != "q8":
        for value in state.values():  # nonzero, nonnegative, as after some steps
            value.copy_(torch.rand(value.shape, generator=gen).to(value.dtype) * 1e-3)
    return w, state


def _stepped(x, dy, regime, config, *, oracle=False, sums=False, n=N):
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    w, state = _layer(x.device, regime, rule)
    w, state = w[:n], {name: value[:n] for name, value in state.items()}
    square_sums = fk.empty_square_sums(w.shape, config, w.device) if sums else None
    for step in (1, 2):
        fk.fused_weight_update(x, dy, w, state, rule, step, config=config, oracle=oracle, seed=7,
                               rounding=REGIMES[regime][2], square_sums=square_sums)
    return w, state, square_sums


def _assert_same(a, b, where):
    assert_bitwise_equal(a[0], b[0], f"{where}: weight")
    for name in a[1]:
        assert_bitwise_equal(a[1][name], b[1][name], f"{where}: {name}")
    if a[2] is not None:
        assert_bitwise_equal(a[2], b[2], f"{where}: tile square sums")


@needs_tma
@pytest.mark.exactness
@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "column-slices"])
@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("config", CONFIGS, ids=["whole-tile", "row-slices"])
def test_tma_loads_give_the_bits_of_pointer_loads_and_the_oracle(device, config, regime, activations, padded):
    x, dy = _operands(device, activations, padded)
    tma = dataclasses.replace(config, operand_loads="tma")
    sums = regime != "q8"
    by_tma = _stepped(x, dy, regime, tma, sums=sums)
    _assert_same(by_tma, _stepped(x, dy, regime, config, sums=sums), f"{regime}: tma against pointers")
    _assert_same(by_tma, _stepped(x, dy, regime, config, oracle=True, sums=sums), f"{regime}: tma against the oracle")


@needs_tma
@pytest.mark.exactness
@pytest.mark.parametrize("case", ["inner-start", "few-rows", "few-tokens"])
def test_tma_loads_at_offsets_and_below_one_block(device, case):
    """Operands starting 8 bf16 columns (16 bytes) into wider tensors; fewer weight rows
    than a tile's 32; fewer tokens than a block's 16: the descriptors' zero fill."""
    x, dy = _operands(device, torch.bfloat16, True)
    n = N
    if case == "inner-start":
        x = torch.randn(T, K + 24, device=device).to(torch.bfloat16)[:, 8:K + 8]
        dy = torch.randn(T, N + 24, device=device).mul(0.1).to(torch.bfloat16)[:, 8:N + 8]
    elif case == "few-rows":
        n = 16
        dy = dy[:, :n]
    else:
        x, dy = x[:5], dy[:5]
    tma = dataclasses.replace(POINTERS, operand_loads="tma")
    by_tma = _stepped(x, dy, "bf16-sr", tma, sums=True, n=n)
    _assert_same(by_tma, _stepped(x, dy, "bf16-sr", POINTERS, sums=True, n=n), f"{case}: tma against pointers")
    _assert_same(by_tma, _stepped(x, dy, "bf16-sr", POINTERS, oracle=True, sums=True, n=n), f"{case}: the oracle")


@needs_tma
def test_the_kernel_reads_through_the_descriptors(device, monkeypatch):
    """Descriptors made over 2 x instead of x: the step is the pointer loads' step on 2 x,
    and not on x. (Bitwise equality with the pointer loads alone could not tell a kernel
    that ignored its descriptors.)"""
    x, dy = _operands(device, torch.bfloat16, True)
    made, kept = [], []

    class Doubling:
        @staticmethod
        def from_tensor(t, block):
            made.append(tuple(block))
            if len(made) == 1:  # x: the first descriptor made
                t = t * 2
                kept.append(t)  # alive until the launch has run
            return fk_descriptor(t, block)

    fk_descriptor = fwu.TensorDescriptor.from_tensor
    monkeypatch.setattr(fwu, "TensorDescriptor", Doubling)
    tma = dataclasses.replace(POINTERS, operand_loads="tma")
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    w, state = _layer(device, "fp32", rule)
    fk.fused_weight_update(x, dy, w, state, rule, 1, config=tma, rounding="nearest")
    assert made == [(POINTERS.block_t, POINTERS.block_k), (POINTERS.block_t, POINTERS.block_n)]
    monkeypatch.undo()
    doubled = (x * 2).contiguous()
    w2, state2 = _layer(device, "fp32", rule)
    fk.fused_weight_update(doubled, dy, w2, state2, rule, 1, config=POINTERS, rounding="nearest")
    _assert_same((w, state, None), (w2, state2, None), "descriptors over 2 x against pointer loads of 2 x")
    w1, state1 = _layer(device, "fp32", rule)
    fk.fused_weight_update(x, dy, w1, state1, rule, 1, config=POINTERS, rounding="nearest")
    assert not torch.equal(w, w1), "the step ignored its descriptors: it equals the pointer loads' step on x"


@needs_tma
def test_no_tokens_take_a_zero_gradient_step(device):
    """No tokens, no descriptor (nothing is read): the step of a zero gradient."""
    x, dy = _operands(device, torch.bfloat16, False)
    tma = dataclasses.replace(POINTERS, operand_loads="tma")
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    w, state = _layer(device, "fp32", rule)
    fk.fused_weight_update(x[:0], dy[:0], w, state, rule, 1, config=tma, rounding="nearest")
    w0, state0 = _layer(device, "fp32", rule)
    fk.apply_rule(torch.zeros(N, K, device=device), w0, state0, rule, 1, config=POINTERS, rounding="nearest")
    _assert_same((w, state, None), (w0, state0, None), "no tokens against a zero gradient")


def _untouchable(device, name, bad):
    """``name``'s operand (x is (T, K), dy is (T, N)) laid out so TMA cannot copy it."""
    width = K if name == "x" else N
    if bad == "odd-start":  # one bf16 element in: 2 bytes past a 16-byte boundary
        return torch.zeros(T, width + 16, device=device, dtype=torch.bfloat16)[:, 1:width + 1]
    if bad == "odd-row-bytes":  # rows 2 * (width + 1) bytes apart
        return torch.zeros(T, width + 1, device=device, dtype=torch.bfloat16)[:, :width]
    return torch.zeros(width, T, device=device, dtype=torch.bfloat16).t()


@needs_tma
@pytest.mark.parametrize("name", ["x", "dy"])
@pytest.mark.parametrize("bad", ["odd-start", "odd-row-bytes", "column-stride"])
def test_operands_tma_cannot_copy_are_refused_before_anything_runs(device, bad, name):
    x, dy = _operands(device, torch.bfloat16, True)
    if name == "x":
        x = _untouchable(device, name, bad)
    else:
        dy = _untouchable(device, name, bad)
    rule = fk.AdamW()
    w, state = _layer(device, "fp32", rule)
    before = w.clone(), {key: value.clone() for key, value in state.items()}
    with pytest.raises(ValueError, match=rf"operand_loads='tma'.* reads {name} by TMA"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=dataclasses.replace(POINTERS, operand_loads="tma"))
    _assert_same((w, state, None), (*before, None), "a refused call")
    # The same operands through pointer loads: taken.
    fk.fused_weight_update(x, dy, w, state, rule, 1, config=POINTERS)


@needs_tma
def test_a_split_step_refuses_a_later_part_before_writing_the_first(device):
    """``linear_split_step`` launches once per part: a part TMA cannot copy, after one it
    can, is refused before the first part's step is written."""
    x, dy = _operands(device, torch.float32, False)
    rule = fk.SGD(lr=0.1)
    w = torch.randn(N, K, device=device)
    state = rule.init_state(w)
    before = w.clone()
    parts = [(x, dy), (torch.zeros(T, K + 1, device=device)[:, :K], dy)]
    with pytest.raises(ValueError, match=r"operand_loads='tma'.* reads x by TMA"):
        linear_split_step(parts, w, state, rule, 1, config=dataclasses.replace(POINTERS, operand_loads="tma"))
    assert_bitwise_equal(w, before, "the weight after a refused split step")


def test_gpus_without_tma_are_refused(device, monkeypatch):
    """Compiled on a GPU older than sm_90 (stood in for here on every backend), a TMA
    config is refused before anything runs, naming the pointer loads that run there."""
    monkeypatch.setattr(hopper_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    x, dy = _operands(device, torch.bfloat16, False)
    rule = fk.AdamW()
    w, state = _layer(device, "fp32", rule)
    before = w.clone()
    with pytest.raises(RuntimeError, match=r"capability 9\.0 and later.*is 8\.0: use operand_loads='pointers'"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=dataclasses.replace(POINTERS, operand_loads="tma"))
    assert_bitwise_equal(w, before, "the weight after a refused call")


def test_configs_that_cannot_use_tma_loads_are_refused():
    with pytest.raises(ValueError, match="operand_loads='bulk': must be one of"):
        fk.TileConfig(operand_loads="bulk")
    with pytest.raises(ValueError, match="operand_loads=.*reads its operands by TMA whatever"):
        fk.TileConfig(64, 64, 32, num_warps=4, kernel="hopper", operand_loads="tma")
