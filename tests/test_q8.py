"""The q8 state format: codes equal the host reference exactly, 2.06 bytes per
parameter for AdamW, small second moments stay distinguishable from zero, checkpoints
round-trip bit for bit, and bad q8 input is refused."""

import copy

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch import nn

import forge_kernels as fk
from forge_kernels import q8
from forge_kernels.ops.q8_codec import _bracket, q8_decode, q8_encode
from forge_kernels.ops.stochastic_round import stream_seed
from forge_verify import assert_bitwise_equal
from forge_verify.checks.claims import decoded_state
from forge_verify.numerics.philox import philox_randint, philox_words
from forge_verify.numerics.tolerances import UNIT_ROUNDOFF, gamma


def _problem(device, n=24, k=70, t=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, k, generator=gen).to(device), torch.randn(t, n, generator=gen).to(device),
            torch.randn(n, k, generator=gen).to(device))


@pytest.mark.exactness
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("rule", [fk.AdamW(lr=1e-2), fk.RMSprop(momentum=0.5, centered=True), fk.Adagrad()],
                         ids=repr)
def test_kernel_codes_equal_the_host_encoding_of_the_fp32_step(rule, rounding, device):
    """One q8 step from state S equals, code for code, the host encoding of the fp32 step
    taken from decode(S): decoding is exact (a level times a power of two), the rule's fp32
    arithmetic is the same epilogue, and encoding is exact comparisons with the levels
    (stochastic: with the Philox words of the slot's stream at each element's index)."""
    x, dy, w = _problem(device)
    seed, step = 77, 3
    state = rule.init_state(w, state_format="q8")
    for earlier in (1, 2):  # move the q8 state off its start
        fk.fused_weight_update(x, dy, w.clone(), state, rule, earlier, rounding=rounding, seed=seed)
    fp32_state = {k: v.to(device) for k, v in decoded_state(rule, state).items()}
    w_q8, w_fp32 = w.clone(), w.clone()
    fk.fused_weight_update(x, dy, w_q8, state, rule, step, rounding=rounding, seed=seed)
    fk.fused_weight_update(x, dy, w_fp32, fp32_state, rule, step)
    assert_bitwise_equal(w_q8, w_fp32, "weight")
    for position, slot in enumerate(rule.slot_layout):
        if slot is None:
            continue
        words = None
        if rounding == "stochastic":
            words = philox_words(stream_seed(seed, step), np.arange(w.numel()))[1 + position]
        codes, exponents = q8.encode(fp32_state[slot], signed=slot not in rule.nonnegative, random_words=words)
        assert_bitwise_equal(state[slot].cpu(), codes, f"{slot} codes")
        assert_bitwise_equal(state[slot + q8.EXPONENT_SUFFIX].cpu(), exponents, f"{slot} exponents")


def test_adamw_state_takes_at_most_2_1_bytes_per_parameter():
    state = fk.AdamW().init_state(torch.zeros(64, 4096), state_format="q8")
    per_param = sum(t.numel() * t.element_size() for t in state.values()) / (64 * 4096)
    assert per_param == 2 + 2 / q8.BLOCK and per_param <= 2.1


def _relative_store_error(rounding, per_octave=q8.UNSIGNED_LEVELS_PER_OCTAVE):
    """Largest relative error of a q8 store between adjacent levels a < b = a * 2**(1/per_octave):
    (b - a)/(b + a) to nearest, (b - a)/a stochastically (proofs/reference_enclosure.md),
    compounded with gamma_4 for what the float64 expectation leaves out: the rule's fp32
    arithmetic on the second moment (g * g, two products with fp32 scalars, one sum; the
    gradient itself is exact here) and the fp32 rounding of 1 - beta2."""
    ratio = 2.0 ** (1 / per_octave)
    store = (ratio - 1) / (ratio + 1 if rounding == "nearest" else 1)
    return store + gamma(4, UNIT_ROUNDOFF[torch.float32]) * (1 + store)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_small_second_moments_stay_nonzero(rounding, device):
    """Rows whose gradients span five decades (second moments: ten, inside the unsigned
    map's 2**-36 range): every second moment keeps a nonzero code, within the map's
    relative step. A linear absmax int8 code (the FORGE release's format) rounds most of
    them to zero, and the update would then divide by eps alone."""
    g = torch.logspace(-5, 0, 32).repeat(8, 1)          # the gradient we want: (8, 32)
    x = torch.eye(32, device=device)                     # T = 32 tokens, one per column
    dy = g.T.contiguous().to(device)                     # dW = dyᵀ x = g
    w = torch.zeros(8, 32, device=device)                # one q8 block per row
    rule = fk.AdamW(lr=1e-3)
    state = rule.init_state(w, state_format="q8")
    fk.fused_weight_update(x, dy, w, state, rule, 1, rounding=rounding)
    v = decoded_state(rule, state)["exp_avg_sq"].cpu().double()
    exact = (1 - 0.999) * g.double().square()
    assert torch.all(state["exp_avg_sq"] > 0)
    assert torch.all((v - exact).abs() <= _relative_store_error(rounding) * exact)
    # For contrast (no kernel involved): a linear absmax int8 code, round(exact / rowmax * 127),
    # is 0 for 24 of each row's 32 second moments here.


def test_q8_needs_whole_blocks_per_tile(device):
    x, dy, w = _problem(device)
    rule = fk.AdamW()
    with pytest.raises(ValueError, match="q8 state needs block_k / epilogue_split >= 32"):
        fk.fused_weight_update(x, dy, w, rule.init_state(w, "q8"), rule, 1, config=fk.TileConfig(block_k=16))


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.update(exp_avg_exponent=s["exp_avg_exponent"][:, :1].contiguous()), "must be int8 of shape"),
    (lambda s: s.update(exp_avg_exponent=s["exp_avg_exponent"].to(torch.int16)), "must be int8 of shape"),
    (lambda s: s.pop("exp_avg_sq_exponent"), "was it made by another rule"),
])
def test_malformed_q8_state_is_refused(damage, message, device):
    x, dy, w = _problem(device)
    rule = fk.AdamW()
    state = rule.init_state(w, "q8")
    damage(state)
    with pytest.raises((TypeError, ValueError), match=message):
        fk.fused_weight_update(x, dy, w, state, rule, 1)


def test_initial_accumulator_is_encoded(device):
    state = fk.Adagrad(initial_accumulator_value=0.1).init_state(torch.zeros(3, 40, device=device), "q8")
    values = decoded_state(fk.Adagrad(), state)["sum"].double()
    assert torch.all((values - 0.1).abs() <= _relative_store_error("nearest") * 0.1)


@pytest.mark.exactness
@pytest.mark.parametrize("state_format", ["fp32", "bf16", "q8"])
def test_checkpoint_resume_takes_the_identical_next_step(state_format, device):
    """state_dict() of a fused model round-trips bit for bit, and the resumed model's next
    step equals the uninterrupted one's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(40, 64), nn.GELU(), nn.Linear(64, 32)).to(device)
    batches = [torch.randn(5, 40, device=device) for _ in range(3)]

    def train(model, xs):
        for x in xs:
            model(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None

    kwargs = dict(state_format=state_format, seed=9)
    running = fk.fuse(copy.deepcopy(base), fk.AdamW(lr=1e-2), **kwargs)
    train(running, batches[:2])
    checkpoint = {k: v.clone() for k, v in running.state_dict().items()}
    resumed = fk.fuse(copy.deepcopy(base), fk.AdamW(lr=1e-2), **kwargs)
    resumed.load_state_dict(checkpoint)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), checkpoint.items()):
        assert_bitwise_equal(a, b, f"loaded {name}")
    train(running, batches[2:])
    train(resumed, batches[2:])
    for (name, a), (_, b) in zip(resumed.state_dict().items(), running.state_dict().items()):
        assert_bitwise_equal(a, b, f"after resume: {name}")


@pytest.mark.parametrize("key, value, message", [
    ("0.forge_state_exp_avg_exponent", -127, r"exponents in \[-127, .*outside the q8 format's \[-126, 126\]"),
    ("0.forge_state_exp_avg_sq_exponent", 127, r"outside the q8 format's \[-126, 126\]"),
    ("0.forge_step", -5, r"forge_step -5 is not a step count"),
], ids=["exponent-127", "exponent127", "negative-step"])
def test_checkpoint_values_outside_the_format_are_refused(key, value, message, device):
    """The per-step checks see shapes and dtypes only; a checkpoint's values are checked
    when it loads: a q8 exponent the format does not have (the kernel decodes -127 as 0,
    where the host decodes 2**-127·m) or a negative step count is refused, naming it, and
    the layer keeps its own."""
    torch.manual_seed(0)
    model = fk.fuse(nn.Sequential(nn.Linear(40, 64)).to(device), fk.AdamW(lr=1e-2), state_format="q8")
    model(torch.randn(5, 40, device=device)).square().mean().backward()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    checkpoint = {name: tensor.clone() for name, tensor in before.items()}
    checkpoint[key].view(-1)[0] = value
    with pytest.raises(RuntimeError, match=message):
        model.load_state_dict(checkpoint)
    for name, tensor in model.state_dict().items():
        assert_bitwise_equal(tensor, before[name], name)


@triton.jit
def _encode_tile_kernel(v_ptr, codes_ptr, exp_ptr, seed, SIGNED: tl.constexpr, STOCHASTIC: tl.constexpr,
                        ROWS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    codes, exponents = q8_encode(tl.load(v_ptr + offs), tl.randint(seed, offs.to(tl.uint32)), ROWS, 32,
                                 SIGNED, STOCHASTIC)
    tl.store(codes_ptr + offs, codes)
    tl.store(exp_ptr + tl.arange(0, ROWS), tl.reshape(exponents, (ROWS,)))


def _boundary_values(signed: bool) -> torch.Tensor:
    """Rows of one q8 block each: 1.0 first (so the block's exponent is 0 and the values are
    their own normalized u), then every level, its fp32 neighbours and the midpoints."""
    levels = torch.from_numpy(q8.SIGNED_LEVELS if signed else q8.UNSIGNED_LEVELS)
    up = torch.nextafter(levels, torch.tensor(2.0))
    down = torch.nextafter(levels, torch.tensor(-2.0))
    mids = ((levels[:-1].double() + levels[1:].double()) / 2).float()
    # Below the smallest level: half of it, a tiny normal and a subnormal (whose exponent
    # field is 0), each with both signs.
    tiny = torch.tensor([levels[levels > 0].min() / 2, 1e-30, 1e-40])
    values = torch.cat([levels, up, down, mids, torch.tensor([0.0, -0.0]), tiny, -tiny])
    values = values[(values >= (-1.0 if signed else 0.0)) & (values <= 1.0)]
    rows = -(-values.numel() // 31)
    rows = 1 << (rows - 1).bit_length()                 # a power of two, as tl.arange needs
    padded = torch.zeros(rows * 31)
    padded[:values.numel()] = values
    return torch.cat([torch.ones(rows, 1), padded.reshape(rows, 31)], dim=1)


@pytest.mark.exactness
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_encoding_at_every_level_boundary_equals_the_host(signed, rounding, device):
    """The kernel finds the bracketing levels from the value's fp32 bits (octave from the
    exponent, place in it by mantissa comparisons, which also select the levels' mantissa
    fields); at each level, its fp32 neighbours, the midpoints and below the smallest level
    it must still give the host reference's code (which uses a plain sorted search of the
    256 levels)."""
    values = _boundary_values(signed)
    rows, seed = values.shape[0], 99
    codes = torch.empty(values.shape, dtype=torch.uint8, device=device)
    exponents = torch.empty(rows, dtype=torch.int8, device=device)
    stochastic = rounding == "stochastic"
    _encode_tile_kernel[(1,)](values.to(device), codes, exponents, seed, SIGNED=signed, STOCHASTIC=stochastic,
                              ROWS=rows)
    words = philox_randint(seed, np.arange(values.numel())) if stochastic else None
    expected_codes, expected_exponents = q8.encode(values, signed=signed, random_words=words)
    assert_bitwise_equal(codes.cpu(), expected_codes, "codes")
    assert_bitwise_equal(exponents.cpu(), expected_exponents.reshape(-1), "exponents")


@triton.jit
def _bracket_kernel(u_ptr, code_ptr, lower_ptr, upper_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    code, lower, upper = _bracket(tl.load(u_ptr + offs), SIGNED)
    tl.store(code_ptr + offs, code)
    tl.store(lower_ptr + offs, lower)
    tl.store(upper_ptr + offs, upper)


@pytest.mark.exactness
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_bracket_equals_the_host_levels(signed, device):
    """The bracket built from u's bits (code, the code's level and the next code's) is
    the host's sorted search of the 256 levels, bit for bit: at every level boundary (as
    above) and at 2**17 fp32 values drawn uniformly from the bit patterns of [-1, 1],
    which puts most of them far below the smallest level (the clamps)."""
    gen = np.random.default_rng(3)
    one = int(np.float32(1.0).view(np.uint32))
    drawn = (gen.integers(0, one + 1, 1 << 17, dtype=np.uint32) | (gen.integers(0, 2, 1 << 17, dtype=np.uint32) << 31))
    values = np.concatenate([_boundary_values(signed).numpy().ravel(), -_boundary_values(signed).numpy().ravel(),
                             drawn.view(np.float32)]).astype(np.float32)
    block = 1024
    u = np.zeros(-(-values.size // block) * block, dtype=np.float32)
    u[:values.size] = values
    code = torch.empty(u.size, dtype=torch.int32, device=device)
    lower, upper = torch.empty(u.size, device=device), torch.empty(u.size, device=device)
    _bracket_kernel[(u.size // block,)](torch.from_numpy(u).to(device), code, lower, upper, SIGNED=signed,
                                        BLOCK=block)
    levels = q8.SIGNED_LEVELS if signed else q8.UNSIGNED_LEVELS
    expected = np.clip(np.searchsorted(levels, u, side="right") - 1, 0, 255)
    assert_bitwise_equal(code.cpu(), torch.from_numpy(expected.astype(np.int32)), "codes")
    assert_bitwise_equal(lower.cpu(), torch.from_numpy(levels[expected]), "lower levels")
    assert_bitwise_equal(upper.cpu(), torch.from_numpy(levels[np.minimum(expected + 1, 255)]), "upper levels")


@triton.jit
def _decode_kernel(codes_ptr, exp_ptr, out_ptr, SIGNED: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * 256 + tl.arange(0, 256)[None, :]
    rows = tl.arange(0, ROWS)[:, None] * 8 + (tl.arange(0, 256) // 32)[None, :]
    tl.store(out_ptr + offs, q8_decode(codes_ptr, exp_ptr, offs, rows, offs >= 0, SIGNED))


@pytest.mark.exactness
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_decodes_every_code_as_the_host(signed, device):
    """Every one of the 256 codes under the extreme and middle block exponents decodes in
    the kernel (one octave's fp32 bits, the octave count off their exponent field, times
    the block's power of two) to the host's level table value."""
    exponents = torch.tensor([q8.MIN_EXPONENT, -1, 0, 5, q8.MAX_EXPONENT], dtype=torch.int8)
    rows = 8
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, 1)
    block_exponents = exponents[torch.arange(rows * 8) % exponents.numel()].reshape(rows, 8)
    out = torch.empty(rows, 256, device=device)
    _decode_kernel[(1,)](codes.to(device), block_exponents.to(device), out, SIGNED=signed, ROWS=rows)
    assert_bitwise_equal(out.cpu(), q8.decode(codes, block_exponents, signed=signed), "decoded levels")


@pytest.mark.parametrize("rule", [fk.AdamW(), fk.Adagrad(initial_accumulator_value=0.1)], ids=repr)
def test_initial_state_is_the_host_encoding_of_the_initial_values(rule):
    """init_state fills from one encoded block; it must equal encoding the whole (ragged) weight."""
    shape = (3, 70)
    state = rule.init_state(torch.zeros(shape), "q8")
    for slot in rule.slots:
        codes, exponents = q8.encode(torch.full(shape, rule.initial_value(slot)), signed=slot not in rule.nonnegative)
        assert_bitwise_equal(state[slot], codes, f"{slot} codes")
        assert_bitwise_equal(state[slot + q8.EXPONENT_SUFFIX], exponents, f"{slot} exponents")
