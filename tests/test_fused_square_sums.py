"""``fused_weight_update(..., square_sums=)``: the fused step keeps each tile's Σ dW² of
its own (unscaled) gradient tile, so previous-norm clipping takes a layer's norm with no
second pass over the tokens (proofs/gradient_norm.md).

Under the interpreter the sums are bitwise ``weight_gradient_square_sums``' (the same
tile loop, the same summing code), fused and oracle; on every backend the step's own
bits do not change and the norm is within the proof's bound of the float64 norm; the
Trainer's previous-norm steps with tile norms run no separate norm pass. On a Hopper
GPU the Hopper kernels' sums (each part's tree sum, parts added in part order) are
checked tile by tile within the fp32 summing bound of their float64 values.
"""

import math

import numpy as np
import pytest
import torch

import forge_kernels as fk
from forge_kernels.ops.gradient_norm import weight_gradient_square_sums
from forge_verify.numerics.bits import assert_bitwise_equal
from forge_verify.numerics.tolerances import gradient_norm_bound, tile_square_sum_factor
from tests.test_training import _closures, _gpt

SMALL = fk.TileConfig(32, 32, 16, 4, 2)
# (weight dtype, state format, config): q8 state needs tiles of whole 64-column q8 blocks.
REGIMES = {"fp32": (torch.float32, "fp32", SMALL), "bf16": (torch.bfloat16, "bf16", SMALL),
           "q8": (torch.bfloat16, "q8", fk.TileConfig(32, 64, 16, 4, 2))}


def _problem(regime, device, t=37, n=70, k=90, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_dtype, state_format, config = REGIMES[regime]
    x = torch.randn(t, k, generator=gen).to(device, torch.bfloat16)
    dy = (torch.randn(t, n, generator=gen) * 0.5).to(device, torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(device, w_dtype)
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    return x, dy, weight, rule.init_state(weight, state_format=state_format), rule, config


def _step(x, dy, weight, state, rule, config, grad_scale=0.5, step=1, **kwargs):
    weight, state = weight.clone(), {name: value.clone() for name, value in state.items()}
    fk.fused_weight_update(x, dy, weight, state, rule, step, config=config, seed=3, grad_scale=grad_scale, **kwargs)
    return weight, state


def _sums(weight, config):
    """A sums buffer holding NaN, so that a path that wrote nothing cannot pass."""
    return fk.empty_square_sums(weight.shape, config, weight.device).fill_(float("nan"))


def _assert_same_step(a, b, where):
    assert_bitwise_equal(a[0], b[0], f"{where}: weight")
    for name in a[1]:
        assert_bitwise_equal(a[1][name], b[1][name], f"{where}: {name}")


@pytest.mark.interpreter
@pytest.mark.exactness
@pytest.mark.parametrize("oracle", [False, True], ids=["fused", "oracle"])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_the_step_keeps_the_tile_loops_sums_of_the_unscaled_gradient(regime, oracle, device):
    """With grad_scale 0.5 the sums are still those of dW itself, bitwise
    ``weight_gradient_square_sums`` for the same tiles."""
    x, dy, weight, state, rule, config = _problem(regime, device)
    sums = _sums(weight, config)
    _step(x, dy, weight, state, rule, config, oracle=oracle, square_sums=sums)
    assert_bitwise_equal(sums, weight_gradient_square_sums(x, dy, config=config), "tile sums")


@pytest.mark.interpreter
@pytest.mark.exactness
@pytest.mark.parametrize("variant", ["row-parts", "column-parts", "slice", "device-scalars"])
def test_the_sums_do_not_depend_on_parts_slices_or_device_scalars(variant, device):
    """The epilogue in parts, a shard at an odd column of a larger weight, and the step's
    scalars and clip factor read on the device (a captured step's launch): the sums are
    the same bits, and so is the step (against the same call without sums)."""
    x, dy, weight, state, rule, config = _problem("bf16", device)
    options = {}
    if variant == "row-parts":
        config = fk.TileConfig(32, 32, 16, 4, 2, epilogue_split=2, epilogue_axis="rows")
    elif variant == "column-parts":
        config = fk.TileConfig(32, 32, 16, 4, 2, epilogue_split=2)
    elif variant == "slice":
        options["weight_slice"] = fk.WeightSlice(5, 3, (100, 101))
    else:
        options["step"] = fk.StepScalars(rule, seed=3, device=device).set(1)
        options["grad_scale"] = torch.tensor([0.5], device=device)
    sums = _sums(weight, config)
    kept = _step(x, dy, weight, state, rule, config, square_sums=sums, **options)
    assert_bitwise_equal(sums, weight_gradient_square_sums(x, dy, config=config), "tile sums")
    _assert_same_step(kept, _step(x, dy, weight, state, rule, config, **options), "with sums")


@pytest.mark.exactness
@pytest.mark.parametrize("oracle", [False, True], ids=["fused", "oracle"])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_keeping_the_sums_moves_no_bit_of_the_step_and_gives_the_norm(regime, oracle, device):
    """Weight and every state slot are the bits of the same step without sums, and the
    norm from the sums is within the proof's bound of the float64 norm of dW."""
    x, dy, weight, state, rule, config = _problem(regime, device, seed=1)
    sums = _sums(weight, config)
    kept = _step(x, dy, weight, state, rule, config, oracle=oracle, square_sums=sums)
    _assert_same_step(kept, _step(x, dy, weight, state, rule, config, oracle=oracle), "with sums")
    grad = fk.weight_gradient(x, dy, config=config)
    exact = float(np.linalg.norm(grad.double().cpu().numpy()))
    found = fk.norm_from_square_sums(sums)
    assert found.dtype == torch.float32 and found.shape == () and found.device == weight.device
    assert abs(float(found) - exact) <= gradient_norm_bound(exact, *grad.shape, config.block_n, config.block_k)


def test_no_tokens_give_zero_sums_and_a_non_finite_input_non_finite_ones(device):
    """T = 0: dW is 0 and so is every sum. A NaN in x: nothing is stepped (the call
    raises) and the norm is not finite, as ``weight_gradient_norm``'s would be."""
    x, dy, weight, state, rule, config = _problem("fp32", device, t=0)
    sums = fk.empty_square_sums(weight.shape, config, device).fill_(7.0)
    _step(x, dy, weight, state, rule, config, square_sums=sums)
    assert not sums.any()
    x, dy, weight, state, rule, config = _problem("fp32", device)
    x[5, 6] = float("nan")
    before = weight.clone()
    with pytest.raises(fk.NonFiniteInputError):
        fk.fused_weight_update(x, dy, weight, state, rule, 1, config=config, square_sums=sums)
    assert_bitwise_equal(weight, before, "weight")
    assert not math.isfinite(float(fk.norm_from_square_sums(sums)))


def test_a_wrong_sums_buffer_is_refused_before_anything_runs(device):
    x, dy, weight, state, rule, config = _problem("fp32", device)
    before = weight.clone()
    grid = fk.empty_square_sums(weight.shape, config, device).shape
    wrong = [(torch.empty(grid, dtype=torch.float64, device=device), ValueError, "contiguous float32"),
             (torch.empty(grid[0], grid[1] + 1, device=device), ValueError, r"shape \(3, 3\) for a \(70, 90\) weight"),
             (torch.empty(grid[1], grid[0], device=device).T, ValueError, "not contiguous"),
             (np.zeros(grid, dtype=np.float32), TypeError, "must be a torch.Tensor")]
    if torch.device(device).type != "cpu":
        wrong.append((torch.empty(grid), ValueError, "is on cpu"))
    for sums, error, message in wrong:
        with pytest.raises(error, match=message):
            fk.fused_weight_update(x, dy, weight, state, rule, 1, config=config, square_sums=sums)
    assert_bitwise_equal(weight, before, "weight")
    layer = fk.fuse(torch.nn.Sequential(torch.nn.Linear(90, 70)).to(device), rule)[0]
    with pytest.raises(ValueError, match="with a materialized grad"):
        layer._apply_step(None, None, grad=torch.zeros(70, 90, device=device),
                          square_sums=fk.empty_square_sums((70, 90), None, device))


@pytest.mark.parametrize("oracle", [False, True], ids=["fused", "oracle"])
def test_previous_norm_steps_with_tile_norms_run_no_separate_norm_pass(oracle, device, monkeypatch):
    """The exact first step measures every layer's norm with ``weight_gradient_norm`` (its
    first pass steps nothing); the previous-norm steps after it take the norms from the
    fused steps' sums and never call it. No second tile loop runs for the sums either
    (the fused kernel, at this test's portable tile, keeps its own; the oracle sums its
    gradient)."""
    model = fk.fuse(_gpt(device), fk.AdamW(lr=1e-2), oracle=oracle)
    layers = len(fk.fused_layers(model))
    trainer = fk.Trainer(model, torch.optim.AdamW(fk.unfused_parameters(model), lr=3e-3), max_norm=0.05,
                         clipping="previous-norm", norm="tiles")
    calls = []
    measured = fk.training.weight_gradient_norm
    monkeypatch.setattr(fk.training, "weight_gradient_norm", lambda *a, **k: calls.append(1) or measured(*a, **k))
    trainer.step(_closures(model, device, 0))
    assert len(calls) == layers
    if not oracle:
        def refuse(*args, **kwargs):
            raise AssertionError("a separate tile loop ran for the sums")
        monkeypatch.setattr(fk.ops.fused_weight_update, "launch_square_sums", refuse)
    norms = []
    for step in (1, 2):
        trainer.step(_closures(model, device, step))
        norms.append(float(trainer.last_norm))
    assert len(calls) == layers and all(math.isfinite(n) and n > 0.05 for n in norms)


def _exact_tile_sums(x, dy, config):
    """Each tile's Σ dW² in float64 (the fp32 dW elements are exact inputs), zero-padded
    to whole tiles."""
    grad = fk.weight_gradient(x, dy, config=config).double()
    n, k = grad.shape
    grad = torch.nn.functional.pad(grad, (0, -k % config.block_k, 0, -n % config.block_n))
    return grad.reshape(-1, config.block_n, grad.shape[1] // config.block_k, config.block_k).square().sum(dim=(1, 3))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the hopper kernel runs on compute capability 9.x GPUs only")
@pytest.mark.exactness
@pytest.mark.parametrize("config", [
    fk.TileConfig(128, 128, 64, 8, 3, epilogue_split=8, kernel="hopper", epilogue_axis="rows"),
    fk.TileConfig(128, 128, 32, 8, 4, epilogue_split=4, kernel="hopper"),
    fk.TileConfig(64, 32, 128, 4, 2, kernel="hopper"),
    fk.TileConfig(64, 128, 32, 4, 2, epilogue_split=4, kernel="hopper")],
    ids=["split-rows", "split-columns", "pingpong", "pingpong-parts"])
def test_the_hopper_kernels_keep_each_tiles_sum_within_its_bound(config):
    """The Hopper kernels keep the sums in their epilogues (a tile's parts' sums added in
    part order, each a tree of the part's layout). On a ragged 2600 x 2056 weight (over
    264 tiles: every program, and both ping-pong consumers, take several; partial tiles
    at both edges and a partial band): each tile's sum is within the fp32 summing bound
    of its float64 value (a square's rounding and γ_{m-1} over the tile's m squares,
    proofs/gradient_norm.md), and the step is the bits of the same step without sums.
    Then one tile alone made nonzero (x and dy zero outside its rows and columns), for
    the first tile, one in the partial last band and the last: its sum lands at its
    row-major index and every other tile's is +0 (no sum carried from tile to tile)."""
    x, dy, weight, state, rule, _ = _problem("bf16", "cuda", t=160, n=2600, k=2056)
    sums = _sums(weight, config)
    kept = _step(x, dy, weight, state, rule, config, square_sums=sums)
    _assert_same_step(kept, _step(x, dy, weight, state, rule, config), "with sums")
    exact = _exact_tile_sums(x, dy, config)
    assert sums.shape == exact.shape and sums.numel() > 264
    relative = tile_square_sum_factor(config.block_n * config.block_k) - 1
    assert (sums.double() - exact).abs().le(exact * relative).all(), (sums, exact)
    tiles_n, tiles_k = sums.shape
    for row, col in [(0, 0), (tiles_n - 1, tiles_k // 2), (tiles_n - 1, tiles_k - 1)]:
        rows = slice(row * config.block_n, (row + 1) * config.block_n)
        cols = slice(col * config.block_k, (col + 1) * config.block_k)
        hot_x, hot_dy = torch.zeros_like(x), torch.zeros_like(dy)
        hot_x[:, cols], hot_dy[:, rows] = x[:, cols], dy[:, rows]
        sums = _sums(weight, config)
        _step(hot_x, hot_dy, weight, state, rule, config, square_sums=sums)
        expected = _exact_tile_sums(hot_x, hot_dy, config)
        assert expected[row, col] > 0 and torch.equal(sums != 0, expected != 0), (row, col)
        assert abs(float(sums[row, col]) - float(expected[row, col])) <= float(expected[row, col]) * relative
