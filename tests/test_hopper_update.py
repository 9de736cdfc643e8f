"""The Hopper kernel (``TileConfig(kernel="hopper")``) computes the portable kernel's
function bit for bit: for every rule and slot layout, every storage regime and rounding,
in both structures (``num_warps`` 4: ping-pong consumers; 8 or 16: a matrix warpgroup per
64 rows of a 64- or 128-row tile feeding eight or sixteen epilogue warps), on shapes with ragged edges
and on shapes with many tiles per program (every barrier through several phases, the
rings wrapping), at an offset in a larger weight, with a gradient scale, with device
scalars inside a CUDA graph, and through the non-finite paths (nothing written, skipped
tiles, the same flags). GPU-only (sm_90); what it refuses where it cannot run is checked
everywhere."""

import dataclasses

import pytest
import torch

import forge_kernels as fk
from forge_verify import assert_bitwise_equal
from forge_verify.checks.claims import assert_parts_kept, epilogue_parts

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="the hopper kernel runs on compute capability 9.x GPUs only")
CONFIGS = [fk.TileConfig(64, 32, 64, 4, 4, kernel="hopper"), fk.TileConfig(64, 64, 64, 4, 3, kernel="hopper"),
           # Tiles of several column parts: the accumulator in shared memory, two staging slots.
           fk.TileConfig(64, 128, 32, 4, 2, epilogue_split=4, kernel="hopper"),
           fk.TileConfig(64, 64, 64, 4, 3, epilogue_split=2, kernel="hopper"),
           # The split kernel: eight epilogue warps, one part per tile and four (the tuned tile).
           fk.TileConfig(64, 64, 64, 8, 4, kernel="hopper"),
           fk.TileConfig(64, 128, 64, 8, 3, epilogue_split=4, kernel="hopper"),
           # 128-row tiles: two matrix warpgroups reading each x block; a 128 x 128 tile
           # (the tuned one) has one gradient slot, a 128 x 64 tile two.
           fk.TileConfig(128, 128, 32, 8, 4, epilogue_split=4, kernel="hopper"),
           fk.TileConfig(128, 64, 32, 8, 3, epilogue_split=2, kernel="hopper"),
           # 16-column parts: a seven-stage ring beside the 128 x 128 tile's slot.
           fk.TileConfig(128, 128, 32, 8, 7, epilogue_split=8, kernel="hopper"),
           # Row parts (whole rows of the tile): eight of the 128 x 128 tile (the tuned one),
           # four of a 64 x 128 tile.
           fk.TileConfig(128, 128, 64, 8, 3, epilogue_split=8, kernel="hopper", epilogue_axis="rows"),
           fk.TileConfig(64, 128, 64, 8, 3, epilogue_split=4, kernel="hopper", epilogue_axis="rows"),
           # Staging slots other than two: one (each part loaded while the last one is worked on),
           # three beside a two-stage ring (the 128 x 128 tile's row parts).
           fk.TileConfig(64, 128, 64, 8, 3, epilogue_split=4, kernel="hopper", epilogue_stages=1),
           fk.TileConfig(128, 128, 64, 8, 2, epilogue_split=8, kernel="hopper", epilogue_axis="rows",
                         epilogue_stages=3),
           # Sixteen epilogue warps (tiles of at most 64 columns): row parts of a 64 x 64 tile,
           # 16-column parts of a 128 x 64 tile, 32-row parts of one (bf16-sr's tuned 256 tile).
           fk.TileConfig(64, 64, 64, 16, 3, epilogue_split=2, kernel="hopper", epilogue_axis="rows"),
           fk.TileConfig(128, 64, 32, 16, 4, epilogue_split=4, kernel="hopper"),
           fk.TileConfig(128, 64, 64, 16, 4, epilogue_split=4, kernel="hopper", epilogue_axis="rows"),
           # One wgmma in flight in the token loop (each ring stage released a block later): the
           # 4,096-token tile (four stages, one staging slot), a two-stage ring (a stage refilled
           # the moment it is released), sixteen epilogue warps.
           fk.TileConfig(128, 128, 64, 8, 4, epilogue_split=8, kernel="hopper", epilogue_axis="rows",
                         epilogue_stages=1, wgmma_in_flight=True),
           fk.TileConfig(64, 64, 64, 8, 2, kernel="hopper", wgmma_in_flight=True),
           fk.TileConfig(128, 64, 32, 16, 4, epilogue_split=4, kernel="hopper", wgmma_in_flight=True),
           # The input check inside the kernel (a cooperative launch): the 16,384-token fp32 tile
           # and sixteen epilogue warps.
           fk.TileConfig(128, 128, 64, 8, 4, epilogue_split=8, kernel="hopper", epilogue_axis="rows",
                         epilogue_stages=1, wgmma_in_flight=True, in_kernel_check=True),
           fk.TileConfig(64, 64, 64, 16, 3, epilogue_split=2, kernel="hopper", epilogue_axis="rows",
                         in_kernel_check=True)]
SPLIT = CONFIGS[5]
WIDE = CONFIGS[6]
ROWS = CONFIGS[9]
ONE_SLOT, THREE_SLOTS = CONFIGS[11], CONFIGS[12]
SIXTEEN_WARPS = CONFIGS[13]
SIXTEEN_WARPS_COLUMNS, SIXTEEN_WARPS_ROWS = CONFIGS[14], CONFIGS[15]  # four parts each
IN_FLIGHT, IN_FLIGHT_TWO_STAGES = CONFIGS[16:18]  # the third, sixteen warps, runs in the bits matrix only
IN_KERNEL_CHECK, IN_KERNEL_CHECK_SIXTEEN_WARPS = CONFIGS[19:21]
SHORT_BLOCKS = fk.TileConfig(64, 32, 32, 4, 2, kernel="hopper")  # 32-token blocks, two buffers
RULES = {
    "adamw": lambda: fk.AdamW(lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: fk.SGD(lr=0.1, momentum=0.9),
    "sgd-nesterov": lambda: fk.SGD(lr=0.1, momentum=0.9, nesterov=True),
    "sgd": lambda: fk.SGD(lr=0.1),
    "lion": lambda: fk.Lion(lr=1e-3),
    "adagrad": lambda: fk.Adagrad(lr=0.1),
    "rmsprop": lambda: fk.RMSprop(lr=1e-2),
    "rmsprop-momentum": lambda: fk.RMSprop(lr=1e-2, momentum=0.5),
    "rmsprop-centered": lambda: fk.RMSprop(lr=1e-2, momentum=0.5, centered=True),  # three state slots
    "rmsprop-centered-plain": lambda: fk.RMSprop(lr=1e-2, centered=True),  # slots 0 and 2, none in 1
}
REGIMES = {  # name: (weight dtype, state format, rounding)
    "fp32": (torch.float32, "fp32", "nearest"),
    "bf16-sr": (torch.bfloat16, "bf16", "stochastic"),
    "bf16-nearest": (torch.bfloat16, "bf16", "nearest"),
    "fp32-weight-bf16-state": (torch.float32, "bf16", "stochastic"),
    "fp32-weight-bf16-state-nearest": (torch.float32, "bf16", "nearest"),
    "bf16-weight-fp32-state": (torch.bfloat16, "fp32", "stochastic"),
}


SHARED_BYTES = 232_448  # what one block may have on sm_90


def _fits(config, rule_name, regime):
    """Whether the kernel's shared memory holds the config's buffers (the rest are refused:
    ``test_hopper_kernel_refuses_a_tile_that_does_not_fit``). Ping-pong: a weight and
    three fp32 slots exceed it beside a 64x64 tile's ring, or beside a wider tile's
    accumulator and two staging slots. Split: the ring, the gradient slots (two, or one of
    a 128 x 128 tile) and ``staging_slots`` slots of a part's weight and state, with 2 KB
    to spare for barriers, reductions and (sixteen epilogue warps) two parts' row counts."""
    w_dtype, state_format, _ = REGIMES[regime]
    if config.num_warps == 4:
        return not (rule_name == "rmsprop-centered" and state_format == "fp32" and config.block_k >= 64)
    slots = sum(name is not None for name in RULES[rule_name]().slot_layout)
    part_rows, part_cols = config.part_shape
    part_bytes = part_rows * part_cols * (torch.finfo(w_dtype).bits // 8 + slots * (4 if state_format == "fp32" else 2))
    staged = config.staging_slots * part_bytes
    ring = config.num_stages * config.block_t * (config.block_n + config.block_k) * 2
    gradient = config.block_n * config.block_k * 4
    gradient_slots = 2 if 2 * gradient <= 64 * 1024 else 1
    return ring + gradient_slots * gradient + staged <= SHARED_BYTES - 2048


CASES = [(config, regime, rule_name) for config in CONFIGS for regime in REGIMES for rule_name in RULES
         if _fits(config, rule_name, regime)]


@pytest.fixture
def launches(monkeypatch):
    """The number of times the Gluon kernel was launched: a bits test that silently ran
    the portable kernel on both sides would compare it with itself."""
    from forge_kernels.ops import hopper_update
    count = [0]
    launch = hopper_update.launch

    def counted(*args):
        count[0] += 1
        return launch(*args)
    monkeypatch.setattr(hopper_update, "launch", counted)
    return count


def _inputs(t, n, k, w_dtype, seed=0, device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, k, generator=gen).bfloat16().to(device)
    dy = (torch.randn(t, n, generator=gen) * 0.1).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device, w_dtype)
    return x, dy, w


def _state(rule, w, state_format):
    state = rule.init_state(w, state_format=state_format)
    for value in state.values():  # a nonzero, nonnegative state, as after some steps
        value.copy_(torch.rand(value.shape, generator=torch.Generator().manual_seed(1)).to(value.dtype) * 1e-3)
    return state


def _steps(config, rule, x, dy, w, state, **kwargs):
    """(weight, state) after two steps with ``config``, from copies of the given ones."""
    w = w.clone()
    state = {name: value.clone() for name, value in state.items()}
    for step in (1, 2):
        fk.fused_weight_update(x, dy, w, state, rule, step, config=config, **kwargs)
    return w, state


def _assert_same(a, b, where):
    assert_bitwise_equal(a[0], b[0], f"{where}: weight")
    for name in a[1]:
        assert_bitwise_equal(a[1][name], b[1][name], f"{where}: {name}")


def _assert_portable_bits_in_a_slice(config, regime, rule_name, shape, where, seeds, launches):
    """Two steps of ``config`` on a (tokens, rows, columns) weight placed at ``where`` in a
    larger one give the portable kernel's bits; ``seeds``: the inputs' and the rounding's."""
    w_dtype, state_format, rounding = REGIMES[regime]
    rule = RULES[rule_name]()
    x, dy, w = _inputs(*shape, w_dtype, seed=seeds[0])
    state = _state(rule, w, state_format)
    kwargs = dict(rounding=rounding, seed=seeds[1], weight_slice=where)
    fast = _steps(config, rule, x, dy, w, state, **kwargs)
    assert launches[0] == 2
    _assert_same(fast, _steps(_portable(config), rule, x, dy, w, state, **kwargs), "portable")


def _assert_the_same_skips(config, x, dy, w):
    """One SGD step of ``config`` and of the portable kernel on an overflowing gradient:
    both skip and name the same parts (returned) and leave the same weight."""
    rule = fk.SGD(lr=1.0)
    found = []
    for kernel_config in (config, _portable(config)):
        w_k, state = w.clone(), rule.init_state(w)
        with pytest.raises(fk.NonFiniteUpdateError) as raised:
            fk.fused_weight_update(x, dy, w_k, state, rule, 1, config=kernel_config)
        found.append((raised.value.tiles, w_k))
    assert found[0][0] == found[1][0]
    assert_bitwise_equal(found[0][1], found[1][1], "weight after the skipped tile")
    return found[0][0]


def _name(config):
    return (f"{config.block_n}x{config.block_k}x{config.block_t}x{config.num_stages}/{config.epilogue_split}"
            f"{'r' if config.epilogue_axis == 'rows' else ''}w{config.num_warps}"
            f"{'' if config.epilogue_stages is None else f's{config.epilogue_stages}'}"
            f"{'-inflight' if config.wgmma_in_flight else ''}{'-check' if config.in_kernel_check else ''}")


def _portable(config):
    return dataclasses.replace(config, kernel="portable", epilogue_stages=None, wgmma_in_flight=False,
                               in_kernel_check=False)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config, regime, rule_name", CASES,
                         ids=[f"{_name(c)}-{g}-{r}" for c, g, r in CASES])
def test_hopper_kernel_gives_the_portable_kernels_bits(config, regime, rule_name, launches):
    w_dtype, state_format, rounding = REGIMES[regime]
    rule = RULES[rule_name]()
    # Ragged in every direction: 200 rows (3 full tiles of 64 and 8, or one of 128 and 72), 72 columns, 100 tokens.
    x, dy, w = _inputs(100, 200, 72, w_dtype)
    state = _state(rule, w, state_format)
    fast = _steps(config, rule, x, dy, w, state, rounding=rounding, seed=5)
    assert launches[0] == 2
    _assert_same(fast, _steps(_portable(config), rule, x, dy, w, state, rounding=rounding, seed=5), "portable")
    _assert_same(fast, _steps(config, rule, x, dy, w, state, rounding=rounding, seed=5, oracle=True), "oracle")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: _name(c))
@pytest.mark.parametrize("regime, rule_name", [("bf16-sr", "adamw"), ("bf16-sr", "rmsprop-centered"),
                                               ("fp32", "sgd-momentum"), ("fp32-weight-bf16-state", "lion")])
@pytest.mark.parametrize("col_start", [0, 5])
def test_hopper_kernel_with_many_tiles_per_program(config, regime, rule_name, col_start, launches):
    """1024 x 1152 is 144 tiles of 64 x 128, 288 of 64 x 64 and 576 of 64 x 32: more than
    one per program on a 132-multiprocessor GPU, so both ping-pong consumers (or both of
    the split kernel's gradient slots) take tiles, the barriers go through several phases
    and the rings (and a wide tile's two staging slots) wrap; placed at an even or odd
    column of a larger weight. (Of 128 x 128 tiles it is 72, one per program: the
    several-tiles-per-slot case below gives that tile five.)"""
    where = fk.WeightSlice(128, col_start, (1280, 1200))
    _assert_portable_bits_in_a_slice(config, regime, rule_name, (160, 1024, 1152), where, (4, 11), launches)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPLIT, WIDE, ROWS, ONE_SLOT, THREE_SLOTS, IN_FLIGHT, IN_FLIGHT_TWO_STAGES,
                                    IN_KERNEL_CHECK],
                         ids=lambda c: _name(c))
@pytest.mark.parametrize("regime, rule_name", [("fp32", "adamw"), ("bf16-sr", "adamw")])
@pytest.mark.parametrize("col_start", [0, 3])
def test_split_kernel_with_several_tiles_per_slot(config, regime, rule_name, col_start, launches):
    """2048 x 5120 is 1,280 tiles of 64 x 128 and 640 of 128 x 128, about ten or five per
    program on a 132-multiprocessor GPU: each of the split kernel's gradient slots (two,
    or the 128 x 128 tile's one) and its staging slots (one to three) is refilled several
    times, across tiles too, so every mbarrier of the hand-offs goes through both parities
    more than once."""
    where = fk.WeightSlice(64, col_start, (2176, 5200))
    _assert_portable_bits_in_a_slice(config, regime, rule_name, (96, 2048, 5120), where, (6, 13), launches)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPLIT, ROWS, THREE_SLOTS, IN_FLIGHT, IN_KERNEL_CHECK], ids=lambda c: _name(c))
@pytest.mark.parametrize("regime", ["fp32", "bf16-sr"])
def test_split_kernel_order_with_a_partial_band(config, regime, launches):
    """The split kernel's programs take tiles down bands of eight tile rows: 1,304 rows are
    21 tile rows of 64 (bands of 8, 8 and 5) or 11 of 128 (8 and 3), the last tile 24
    rows, over 2 tile columns, so the last band's shorter column order and its ragged tile
    are reached, with more tiles than programs for the 64-row tile."""
    where = fk.WeightSlice(0, 0, (1304, 200))
    _assert_portable_bits_in_a_slice(config, regime, "adamw", (80, 1304, 200), where, (7, 17), launches)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPLIT, ROWS], ids=lambda c: _name(c))
def test_skipped_tiles_are_named_by_their_place_not_their_turn(config):
    """A tile of the first tile row and second tile column overflows: in the split kernel's
    band order it is taken after the first column's tiles, in row-major order (which names
    the portable kernel's verdict flags) it comes second. Both kernels skip and name the
    same parts."""
    x, dy, w = _inputs(64, 192, 256, torch.float32)
    x[:, 160:192] = 2.0**60
    dy[:, 0:64] = 2.0**80
    skipped = _assert_the_same_skips(config, x, dy, w)
    assert skipped and all(r0 < 64 and c0 < 192 and c1 > 160 for r0, _, c0, c1 in skipped)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS[1:4] + [fk.TileConfig(64, 128, 64, 8, 3, epilogue_split=2, kernel="hopper"),
                                                  fk.TileConfig(64, 64, 128, 8, 4, kernel="hopper"), WIDE],
                         ids=lambda c: _name(c))
def test_hopper_kernel_refuses_a_tile_that_does_not_fit(config, launches):
    """A weight and three fp32 slots beside a 64 x 64 tile's ring, or beside a wider
    tile's accumulator (ping-pong), or, staged two parts each, beside the ring and the
    gradient slots (split: two, or one of 128 x 128), where they exceed the shared memory:
    refused, nothing written."""
    assert not _fits(config, "rmsprop-centered", "fp32")
    rule = RULES["rmsprop-centered"]()
    x, dy, w = _inputs(100, 200, 72, torch.float32)
    state = _state(rule, w, "fp32")
    w_k, s_k = w.clone(), {name: value.clone() for name, value in state.items()}
    with pytest.raises(ValueError, match="out of resource: shared memory"):
        fk.fused_weight_update(x, dy, w_k, s_k, rule, 1, config=config)
    _assert_same((w, state), (w_k, s_k), "after the refusal")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SHORT_BLOCKS, SPLIT, WIDE, ROWS, SIXTEEN_WARPS],
                         ids=["64-token", "32-token", "split", "split-128-rows", "split-row-parts", "split-16-warps"])
@pytest.mark.parametrize("col_start", [0, 3])
def test_hopper_kernel_keys_rounding_on_the_global_index(config, col_start, launches):
    """A shard at rows 64.., columns ``col_start``.. of a larger weight, with a gradient
    scale: an odd column start splits the Philox pairs (the per-element draw)."""
    rule = fk.AdamW(lr=1e-2)
    x, dy, w = _inputs(96, 128, 64, torch.bfloat16, seed=2)
    state = _state(rule, w, "bf16")
    where = fk.WeightSlice(64, col_start, (256, 200))
    kwargs = dict(seed=9, weight_slice=where, grad_scale=0.5)
    fast = _steps(config, rule, x, dy, w, state, **kwargs)
    assert launches[0] == 2
    _assert_same(fast, _steps(_portable(config), rule, x, dy, w, state, **kwargs), f"slice at column {col_start}")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT, ROWS], ids=["pingpong", "split", "split-row-parts"])
def test_hopper_kernel_reads_a_device_grad_scale(config, launches):
    """A one-element device tensor as ``grad_scale`` gives the portable kernel's bits with
    the same tensor, and the bits of the same scale passed as a number."""
    rule = fk.AdamW(lr=1e-2)
    x, dy, w = _inputs(96, 128, 64, torch.bfloat16, seed=4)
    state = _state(rule, w, "bf16")
    scale = torch.tensor([0.375], device="cuda")
    fast = _steps(config, rule, x, dy, w, state, seed=9, grad_scale=scale)
    assert launches[0] == 2
    _assert_same(fast, _steps(_portable(config), rule, x, dy, w, state, seed=9, grad_scale=scale), "portable")
    _assert_same(fast, _steps(config, rule, x, dy, w, state, seed=9, grad_scale=0.375), "the number")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT, WIDE, ROWS, IN_FLIGHT, IN_KERNEL_CHECK],
                         ids=lambda c: _name(c))
def test_hopper_kernel_captured_with_step_scalars_equals_the_eager_steps(config):
    rule = fk.AdamW(lr=1e-2)
    x, dy, w = _inputs(128, 384, 224, torch.bfloat16, seed=3)  # several tiles, so several programs
    state = _state(rule, w, "bf16")
    eager = _steps(config, rule, x, dy, w, state, seed=4)
    w_c = w.clone()
    s_c = {name: value.clone() for name, value in state.items()}
    scalars = fk.StepScalars(rule, seed=4, device="cuda").set(1)
    fk.fused_weight_update(x, dy, w_c.clone(), {n: v.clone() for n, v in s_c.items()}, rule, scalars, seed=4,
                           config=config, report="defer")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        report = fk.fused_weight_update(x, dy, w_c, s_c, rule, scalars, seed=4, config=config, report="defer")
    for step in (1, 2):
        scalars.set(step)
        graph.replay()
    report.check()
    _assert_same(eager, (w_c, s_c), "captured")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2], SPLIT, WIDE, ROWS, IN_FLIGHT, IN_FLIGHT_TWO_STAGES,
                                    IN_KERNEL_CHECK], ids=lambda c: _name(c))
def test_hopper_kernel_with_no_tokens_steps_on_a_zero_gradient(config):
    rule = fk.AdamW(lr=1e-2, weight_decay=0.1)
    x, dy, w = _inputs(0, 64, 64, torch.float32)
    state = _state(rule, w, "fp32")
    _assert_same(_steps(config, rule, x, dy, w, state), _steps(_portable(config), rule, x, dy, w, state), "T = 0")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT, WIDE, ROWS, IN_FLIGHT, IN_KERNEL_CHECK,
                                    IN_KERNEL_CHECK_SIXTEEN_WARPS], ids=lambda c: _name(c))
def test_hopper_kernel_writes_nothing_on_a_non_finite_input(config):
    rule = fk.AdamW()
    x, dy, w = _inputs(64, 64, 64, torch.float32)
    x[3, 5] = float("nan")
    state = _state(rule, w, "fp32")
    before = (w.clone(), {name: value.clone() for name, value in state.items()})
    with pytest.raises(fk.NonFiniteInputError):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=config)
    _assert_same(before, (w, state), "after a NaN input")


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT, ROWS, IN_FLIGHT, IN_KERNEL_CHECK,
                                    IN_KERNEL_CHECK_SIXTEEN_WARPS], ids=lambda c: _name(c))
@pytest.mark.parametrize("where", ["x", "dy"])
def test_hopper_kernel_counts_the_non_finite_inputs_the_separate_check_counts(config, where):
    """Non-finite values in x or dy reach only a few columns or rows of dW, yet no tile of
    any program is written: a weight of many tiles (48 of 128 x 128, 384 of 64 x 32), so
    that most programs' own tiles are clean, 200 tokens (a partial block of rows), the values in the input's first and last
    elements and one inside. The report names the counts the portable kernel's call
    names (the check's, one per element)."""
    rule = fk.AdamW()
    x, dy, w = _inputs(200, 1024, 768, torch.float32)
    bad = x if where == "x" else dy
    bad[0, 0], bad[77, 300], bad[199, bad.shape[1] - 1] = float("inf"), float("nan"), float("-inf")
    state = _state(rule, w, "fp32")
    messages = []
    for kernel_config in (config, _portable(config)):
        w_k, state_k = w.clone(), {name: value.clone() for name, value in state.items()}
        with pytest.raises(fk.NonFiniteInputError) as raised:
            fk.fused_weight_update(x, dy, w_k, state_k, rule, 1, config=kernel_config)
        _assert_same((w, state), (w_k, state_k), f"after non-finite {where}")
        messages.append(str(raised.value))
    assert messages[0] == messages[1]
    assert f"{where}: 3" in messages[0]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[0], SPLIT, ROWS, IN_FLIGHT, SIXTEEN_WARPS_ROWS], ids=lambda c: _name(c))
@pytest.mark.parametrize("where", ["x", "dy"])
def test_unscanned_non_finite_inputs_fail_the_portable_kernels_tiles(config, where):
    """input_check="tiles": no scan, so a NaN and an infinity in x (or dy) reach the parts
    holding their columns (rows) through the wgmma sums, 0 * inf included (the
    infinity's token row of the other operand is zero). The Hopper kernel names exactly
    those parts (the portable kernel's parts: ``part_shape`` over the weight), leaves
    their bits, gives every other part its own scanned step's bits on the clean inputs and
    stores nothing non-finite."""
    rule = fk.AdamW()
    x, dy, w = _inputs(200, 1024, 768, torch.float32)
    (dy if where == "x" else x)[150] = 0
    state = _state(rule, w, "fp32")
    clean_w, clean_state = w.clone(), {name: value.clone() for name, value in state.items()}
    fk.fused_weight_update(x, dy, clean_w, clean_state, rule, 1, config=config)
    bad = x if where == "x" else dy
    bad[77, 300], bad[150, 5] = float("nan"), float("inf")
    w_k, state_k = w.clone(), {name: value.clone() for name, value in state.items()}
    with pytest.raises(fk.NonFiniteUpdateError, match="not scanned") as raised:
        fk.fused_weight_update(x, dy, w_k, state_k, rule, 1, config=config, input_check="tiles")
    axis = 2 if where == "x" else 0  # a part's (first, end) columns for x, rows for dy
    reached = [part for part in epilogue_parts(config, w.shape)
               if any(part[axis] <= i < part[axis + 1] for i in (300, 5))]
    assert sorted(raised.value.tiles) == reached
    after = {"weight": w_k, **state_k}
    assert_parts_kept(after, {"weight": w, **state}, {"weight": clean_w, **clean_state}, reached,
                      f"unscanned non-finite {where}")
    assert all(torch.isfinite(v).all() for v in after.values())


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [IN_KERNEL_CHECK, IN_KERNEL_CHECK_SIXTEEN_WARPS], ids=lambda c: _name(c))
def test_in_kernel_check_meets_every_program_once_a_launch(config):
    """Every program of the launch takes one ticket at the grid barrier: the counter reads
    the grid after a launch, and twice it after a second launch on the same words (whose
    programs wait for their own round, not the first's)."""
    from forge_kernels.ops.fused_weight_update import _Epilogue
    rule = fk.AdamW()
    x, dy, w = _inputs(200, 1024, 768, torch.float32)
    epilogue = _Epilogue(w, _state(rule, w, "fp32"), rule, 1, config, "stochastic", 0, 1.0, None)
    multiprocessors = torch.cuda.get_device_properties(w.device).multi_processor_count
    programs = min(epilogue.grid[0] * epilogue.grid[1], multiprocessors)
    assert programs > 1
    for launches in (1, 2):
        epilogue.fused(x, dy, w)
        assert int(epilogue.tickets) == launches * programs
    assert epilogue.status.tolist() == [0, 0, 0]


@hopper
@pytest.mark.gpu
def test_in_kernel_check_replaces_the_separate_check(monkeypatch):
    """With ``in_kernel_check`` no check kernel is launched before the fused kernel (the
    read of x and dy it saves), while the oracle still launches one."""
    from forge_kernels.ops import fused_weight_update as module
    calls = []
    check = module.launch_finite_check

    def counted(*args):
        calls.append(args)
        return check(*args)
    monkeypatch.setattr(module, "launch_finite_check", counted)
    rule = fk.AdamW()
    x, dy, w = _inputs(64, 128, 128, torch.float32)
    fk.fused_weight_update(x, dy, w, _state(rule, w, "fp32"), rule, 1, config=IN_KERNEL_CHECK)
    assert calls == []
    fk.fused_weight_update(x, dy, w, _state(rule, w, "fp32"), rule, 1, config=IN_KERNEL_CHECK, oracle=True)
    assert len(calls) == 1


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config, hot, skipped", [
    (CONFIGS[0], (64, 128), [(64, 128, 32, 64)]), (CONFIGS[2], (64, 128), [(64, 128, 32, 64)]),
    (SPLIT, (64, 128), [(64, 128, 32, 64)]), (WIDE, (64, 128), [(0, 128, 32, 64)]),
    (ROWS, (64, 128), [(row, row + 16, 0, 96) for row in range(64, 128, 16)]), (ROWS, (80, 96), [(80, 96, 0, 96)]),
    (IN_FLIGHT, (80, 96), [(80, 96, 0, 96)]), (IN_KERNEL_CHECK, (80, 96), [(80, 96, 0, 96)]),
    # Sixteen epilogue warps publish each part's count with the barrier that frees its slot.
    (SIXTEEN_WARPS_COLUMNS, (64, 128), [(0, 128, 32, 48), (0, 128, 48, 64)]),
    (SIXTEEN_WARPS_ROWS, (64, 128), [(64, 96, 0, 64), (96, 128, 0, 64)])],
    ids=lambda c: _name(c) if isinstance(c, fk.TileConfig) else f"rows{c[0]}-{c[1]}" if isinstance(c, tuple) else "")
def test_hopper_kernel_skips_and_names_the_same_overflowing_tiles(config, hot, skipped):
    """A gradient that overflows in the ``hot`` rows and columns 32-63 only. Rows 64-127
    of a 128-row tile are its second matrix warpgroup's, so the skipped column part spans
    rows 0-127; row parts of 16 skip the four that hold rows 64-127, across the tile's
    width (the weight's 96 columns), and with rows 80-95 hot the sixth part alone (which
    pins the parts' order against the portable kernel's, not only their set)."""
    x, dy, w = _inputs(64, 192, 96, torch.float32)
    x[:, 32:64] = 2.0**60
    dy[:, hot[0]:hot[1]] = 2.0**80
    assert _assert_the_same_skips(config, x, dy, w) == skipped


def test_num_warps_picks_the_structure():
    """4 warps run the ping-pong kernel, 8 and 16 the split one (a config launched on the
    other structure would compile for a partition it was not written for). Gluon compiles
    nothing here: only the dispatch is checked, on any machine."""
    pytest.importorskip("triton.experimental.gluon")
    from forge_kernels.ops import hopper_pingpong, hopper_split, hopper_update
    assert hopper_update.kernel_for(CONFIGS[1]) is hopper_pingpong.pingpong_kernel
    assert hopper_update.kernel_for(SPLIT) is hopper_split.split_kernel
    assert hopper_update.kernel_for(SIXTEEN_WARPS) is hopper_split.split_kernel
    assert {config.num_warps for config in CONFIGS} == {4, 8, 16}


@pytest.mark.parametrize("fields, wrong", [
    (dict(block_n=128), "block_n=128"),
    (dict(block_k=64, num_warps=8, epilogue_split=4), r"epilogue_split=4 \(must be such that block_k / epilogue_split"),
    (dict(block_k=256, epilogue_split=4), "block_k=256"),
    (dict(num_warps=2), "num_warps=2"), (dict(maxnreg=128), "maxnreg=128"),
    (dict(epilogue_split=2), "epilogue_split=2"), (dict(block_k=128), "epilogue_split=1"),
    (dict(block_t=16), "block_t=16"), (dict(num_stages=1), "num_stages=1"),
    (dict(epilogue_split=2, epilogue_axis="rows"), "epilogue_split=2.*with num_warps=8"),
    (dict(num_warps=8, epilogue_split=4, epilogue_axis="rows"), "epilogue_split=4.*not 16 x 32"),
    (dict(epilogue_axis="diagonal"), "epilogue_axis='diagonal'"),
    (dict(epilogue_stages=3), r"epilogue_stages=3 \(must be None with num_warps=4"),
    (dict(block_k=128, num_warps=16, epilogue_split=4), r"block_k=128 \(must be 32, 64 or 128 \(32 or 64 with "
                                                        r"num_warps=16\)"),
    (dict(num_warps=16, epilogue_split=2, epilogue_axis="rows"), r"epilogue_split=2 .*2,048 with 16.*not 32 x 32"),
    # The ping-pong consumers (num_warps=4) run their token loops without a wgmma in flight.
    (dict(wgmma_in_flight=True), "wgmma_in_flight=True: only the split Hopper kernel"),
    # Nor do they check their inputs: the separate check runs before them.
    (dict(in_kernel_check=True), "in_kernel_check=True: only the split Hopper kernel")])
def test_hopper_config_refuses_shapes_it_is_not_built_for(fields, wrong):
    base = dict(block_n=64, block_k=32, block_t=64, num_warps=4, num_stages=3, kernel="hopper")
    with pytest.raises(ValueError, match=wrong):
        fk.TileConfig(**{**base, **fields})


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel='blackwell'"):
        fk.TileConfig(kernel="blackwell")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="checks the refusal where the hopper kernel cannot run")
def test_hopper_config_is_refused_where_it_cannot_run():
    device = fk.kernel_device()
    rule = fk.AdamW()
    x, dy, w = _inputs(16, 64, 32, torch.float32, device=device)
    state = rule.init_state(w)
    before = w.clone()
    with pytest.raises(RuntimeError, match="kernel='portable'"):
        fk.fused_weight_update(x, dy, w, state, rule, 1, config=CONFIGS[0])
    assert_bitwise_equal(before, w, "weight after the refusal")


@hopper
@pytest.mark.gpu
def test_hopper_kernel_refuses_what_it_cannot_read():
    rule = fk.AdamW()
    x, dy, w = _inputs(16, 64, 32, torch.float32)
    with pytest.raises(TypeError, match="bf16 activations"):
        fk.fused_weight_update(x.float(), dy.float(), w, rule.init_state(w), rule, 1, config=CONFIGS[0])
    with pytest.raises(ValueError, match="q8 state runs on the portable kernel"):
        fk.fused_weight_update(x, dy, w.bfloat16(), rule.init_state(w.bfloat16(), "q8"), rule, 1, config=CONFIGS[0])
    rows_72_bytes_apart = torch.zeros(16, 36, dtype=torch.bfloat16, device="cuda")[:, :32]
    with pytest.raises(ValueError, match="TMA"):
        fk.fused_weight_update(rows_72_bytes_apart, dy, w, rule.init_state(w), rule, 1, config=CONFIGS[0])
