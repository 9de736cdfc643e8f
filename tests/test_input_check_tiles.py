"""``input_check="tiles"``: no scan of x and dy; a non-finite element fails exactly the
tiles whose sums it reaches, which keep their bits, and every other tile takes the
clean step's bits."""

import math

import pytest
import torch

import forge_kernels as fk
from forge_verify.checks import claims
from forge_verify.checks.problems import FP32, Problem, Regime
from forge_verify.numerics.bits import int_view

N, K, T = 40, 40, 24
CONFIGS = {
    "whole": fk.TileConfig(block_n=16, block_k=16, block_t=16),
    # 64-column tiles whose epilogue runs on 16-column parts: a part is what is skipped.
    "split": fk.TileConfig(block_n=16, block_k=64, block_t=16, epilogue_split=4),
    "row-split": fk.TileConfig(block_n=64, block_k=16, block_t=16, epilogue_split=4, epilogue_axis="rows"),
}
# The split Hopper tile that scans its inputs itself, which "tiles" contradicts.
IN_KERNEL_SCAN = fk.TileConfig(block_n=128, block_k=128, block_t=64, num_warps=8, num_stages=4, epilogue_split=8,
                               kernel="hopper", epilogue_axis="rows", epilogue_stages=1, in_kernel_check=True)


def _inputs(device, dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=gen).to(device, dtype)
    dy = torch.randn(T, N, generator=gen).to(device, dtype)
    return x, dy


def _fresh(device, weight_dtype, state_format):
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(N, K, generator=gen).to(device, weight_dtype)
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    return w, rule.init_state(w, state_format=state_format), rule


def _bits(w, state):
    return [int_view(w)] + [int_view(v) for _, v in sorted(state.items())]


REGIMES = {"fp32": FP32, "bf16-sr": Regime(weight=torch.bfloat16, state_format="bf16", rounding="stochastic", seed=1)}


@pytest.mark.exactness
@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("oracle", [False, True], ids=["fused", "oracle"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("where, index, value", [("x", 21, math.nan), ("dy", 19, math.nan), ("x", 21, math.inf),
                                                 ("dy", 19, -math.inf)])
def test_non_finite_input_fails_exactly_the_tiles_it_reaches(device, regime, oracle, config, where, index, value):
    """The property's claim on fixed cases: x[5, 21] fails the parts holding column 21,
    dy[5, 19] those holding row 19; the other operand's row 5 is zero, so an infinity's
    products are 0 * inf = NaN."""
    dtype = torch.bfloat16 if regime == "bf16-sr" else torch.float32
    problem = Problem(tokens=T, out_features=N, in_features=K, dtype=dtype, steps=1, seed=7)
    claims.non_finite_input_fails_reached_tiles(problem, fk.AdamW(lr=1e-2, weight_decay=0.1), CONFIGS[config],
                                                device, (where, 5, index, value, True), regime=REGIMES[regime],
                                                oracle=oracle)


@pytest.mark.exactness
@pytest.mark.parametrize("report", ["raise", "defer"])
def test_clean_inputs_step_as_the_scanned_step(device, report):
    x, dy = _inputs(device, torch.float32)
    config = CONFIGS["split"]
    scanned, scanned_state, rule = _fresh(device, torch.float32, "fp32")
    fk.fused_weight_update(x, dy, scanned, scanned_state, rule, 1, config=config)
    w, state, _ = _fresh(device, torch.float32, "fp32")
    outcome = fk.fused_weight_update(x, dy, w, state, rule, 1, config=config, report=report, input_check="tiles")
    if report == "defer":
        outcome.check()
    assert all(torch.equal(a, b) for a, b in zip(_bits(w, state), _bits(scanned, scanned_state)))


def test_deferred_report_names_the_tiles(device):
    x, dy = _inputs(device, torch.float32)
    x[2, 3] = math.nan
    w, state, rule = _fresh(device, torch.float32, "fp32")
    outcome = fk.fused_weight_update(x, dy, w, state, rule, 1, config=CONFIGS["whole"], report="defer",
                                     input_check="tiles")
    with pytest.raises(fk.NonFiniteUpdateError, match=r"3 of 9 weight tiles .* x and dy were not scanned") as info:
        outcome.check()
    assert sorted(info.value.tiles) == [(0, 16, 0, 16), (16, 32, 0, 16), (32, 40, 0, 16)]


def test_scanned_step_still_skips_everything(device):
    """The default is unchanged: the scan finds the element and nothing is written."""
    x, dy = _inputs(device, torch.float32)
    x[2, 3] = math.nan
    w, state, rule = _fresh(device, torch.float32, "fp32")
    before = _bits(w, state)
    with pytest.raises(fk.NonFiniteInputError, match="x: 1, dy: 0; nothing was updated"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=CONFIGS["whole"])
    assert all(torch.equal(a, b) for a, b in zip(_bits(w, state), before))


def test_bad_input_check_is_refused(device):
    x, dy = _inputs(device, torch.float32)
    w, state, rule = _fresh(device, torch.float32, "fp32")
    before = _bits(w, state)
    with pytest.raises(ValueError, match=r"input_check must be one of \('step', 'tiles'\), got 'none'"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, input_check="none")
    with pytest.raises(ValueError, match="input_check must be one of"):
        fk.ForgeLinear(K, N, rule=rule, input_check=False)
    with pytest.raises(ValueError, match="input_check must be one of"):
        fk.fuse(torch.nn.Sequential(torch.nn.Linear(K, N)), rule, input_check="scan")
    assert all(torch.equal(a, b) for a, b in zip(_bits(w, state), before))


def test_tiles_and_the_in_kernel_scan_are_refused_together(device):
    x, dy = _inputs(device, torch.bfloat16)
    w, state, rule = _fresh(device, torch.float32, "fp32")
    before = _bits(w, state)
    with pytest.raises(ValueError, match=r'input_check="tiles" launches no scan .* pass one or the other'):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=IN_KERNEL_SCAN, input_check="tiles")
    assert all(torch.equal(a, b) for a, b in zip(_bits(w, state), before))


def _fused_layer(device, input_check):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(device)
    return fk.fuse(model, fk.AdamW(lr=1e-2), config=CONFIGS["whole"], input_check=input_check)


def test_fused_layer_steps_the_parts_a_non_finite_input_does_not_reach(device):
    """Through fk.fuse, with a loss whose dY is finite (a sum): the backward raises naming
    the layer and the parts holding the NaN's column; the other parts took the scanned
    clean step's bits; the layer is stopped (its step not counted) until
    forge_accept_partial_step(), and nothing non-finite is stored."""
    scanned, unscanned = _fused_layer(device, "step"), _fused_layer(device, "tiles")
    layer = unscanned[0]
    assert layer.input_check == "tiles" and scanned[0].input_check == "step"
    x = torch.randn(T, K, device=device)
    scanned(x).sum().backward()
    x[4, 30] = math.nan
    with pytest.raises(fk.NonFiniteUpdateError, match=r"fused layer '0', step 1: 3 of 9 .* not scanned") as info:
        unscanned(x).sum().backward()
    reached = [(0, 16, 16, 32), (16, 32, 16, 32), (32, 40, 16, 32)]
    assert sorted(info.value.tiles) == reached
    after, before, clean = ({"weight": m.weight.detach(), **m.forge_state}
                            for m in (layer, _fused_layer(device, "tiles")[0], scanned[0]))
    claims.assert_parts_kept(after, before, clean, reached, "fused layer, x[4, 30] = NaN")
    assert all(torch.isfinite(v).all() for v in after.values())
    assert int(layer.forge_step) == 0
    with pytest.raises(RuntimeError, match="stopped at step 1"):
        unscanned(torch.randn(T, K, device=device)).sum().backward()
    layer.forge_accept_partial_step()
    assert int(layer.forge_step) == 1
    unscanned(torch.randn(T, K, device=device)).sum().backward()
    assert int(layer.forge_step) == 2


def test_tiles_and_an_in_kernel_scan_config_are_refused_at_construction(device):
    with pytest.raises(ValueError, match=r'input_check="tiles" launches no scan .* pass one or the other'):
        fk.ForgeLinear(K, N, rule=fk.AdamW(), config=IN_KERNEL_SCAN, input_check="tiles")


def test_trainer_refuses_tiles_with_fused_accumulation(device):
    model = fk.fuse(torch.nn.Sequential(torch.nn.Linear(K, N)).to(device), fk.SGD(lr=0.1, momentum=0.9),
                    config=CONFIGS["whole"], input_check="tiles")
    trainer = fk.Trainer(model, torch.optim.SGD(fk.unfused_parameters(model), lr=0.1))
    x = torch.randn(T, K, device=device)
    before = int_view(model[0].weight).clone()
    with pytest.raises(ValueError, match="input_check='tiles' a non-finite input in one micro-batch"):
        trainer.step([lambda: model(x).square().mean()] * 2)
    assert torch.equal(int_view(model[0].weight), before)
