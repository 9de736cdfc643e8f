"""``TileConfig(operand_loads="tma")``: the portable kernel reading its dy and x blocks
through tensor descriptors computes the same step, bit for bit, as with masked pointer
loads and as the oracle (which reads by pointers), at ragged edges, with operands that are
column slices of wider tensors, with and without gradient-norm sums; operands TMA cannot
copy, and configs that cannot use it, are refused before anything runs."""

import dataclasses

import pytest
import torch

import forge_kernels as fk
from forge_verify.numerics.bits import assert_bitwise_equal

REGIMES = {  # name: (weight dtype, state format, rounding)
    "fp32": (torch.float32, "fp32", "nearest"),
    "bf16-sr": (torch.bfloat16, "bf16", "stochastic"),
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


def _stepped(x, dy, regime, config, *, oracle=False, sums=False):
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    w, state = _layer(x.device, regime, rule)
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


def test_no_tokens_take_a_zero_gradient_step(device):
    x, dy = _operands(device, torch.bfloat16, False)
    tma = dataclasses.replace(POINTERS, operand_loads="tma")
    _assert_same(_stepped(x[:0], dy[:0], "fp32", tma), _stepped(x[:0], dy[:0], "fp32", POINTERS), "no tokens")


@pytest.mark.parametrize("bad", ["odd-start", "odd-row-bytes", "column-stride"])
def test_operands_tma_cannot_copy_are_refused_before_anything_runs(device, bad):
    x, dy = _operands(device, torch.bfloat16, True)
    if bad == "odd-start":  # one bf16 element in: 2 bytes past a 16-byte boundary
        x = torch.zeros(T, K + 16, device=device, dtype=torch.bfloat16)[:, 1:K + 1]
    elif bad == "odd-row-bytes":  # rows 2 * 161 bytes apart
        x = torch.zeros(T, K + 1, device=device, dtype=torch.bfloat16)[:, :K]
    else:
        x = torch.zeros(K, T, device=device, dtype=torch.bfloat16).t()
    rule = fk.AdamW()
    w, state = _layer(device, "fp32", rule)
    before = w.clone(), {name: value.clone() for name, value in state.items()}
    with pytest.raises(ValueError, match=r"operand_loads='tma'.* reads x by TMA"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=dataclasses.replace(POINTERS, operand_loads="tma"))
    _assert_same((w, state, None), (*before, None), "a refused call")
    # The same operands through pointer loads: taken.
    fk.fused_weight_update(x, dy, w, state, rule, 1, config=POINTERS)


def test_configs_that_cannot_use_tma_loads_are_refused():
    with pytest.raises(ValueError, match="operand_loads='bulk': must be one of"):
        fk.TileConfig(operand_loads="bulk")
    with pytest.raises(ValueError, match="operand_loads=.*reads its operands by TMA whatever"):
        fk.TileConfig(64, 64, 32, num_warps=4, kernel="hopper", operand_loads="tma")
