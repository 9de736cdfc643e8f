"""The claims, as functions: each runs the kernels on one problem and raises
AssertionError with a precise message when the claim fails. Properties draw the
problems (``forge-verify check`` runs those properties); the gate reuses
``enclosure_trajectory`` and ``decoded_state``."""

import mpmath
import torch

import forge_kernels as fk

from ..numerics.bits import assert_bitwise_equal
from ..numerics.interval import Interval
from ..numerics.mpref import MPMATH, PRECISION_BITS, exact_weight_grad, to_float64
from ..numerics.reference import ENCLOSURE, POINT, weight_grad, weight_grad_enclosure
from .catalog import reference_step
from .problems import FP32, Inputs, make_inputs, run_rule


def _assert_same_update(a, b, rule, what):
    (w_a, s_a), (w_b, s_b) = a, b
    assert_bitwise_equal(w_a, w_b, f"{what}: weight")
    if set(s_a) != set(s_b):
        raise AssertionError(f"{what}: state entries {sorted(s_a)} != {sorted(s_b)}")
    for key in sorted(s_a):  # every slot, and in q8 each slot's exponents
        assert_bitwise_equal(s_a[key], s_b[key], f"{what}: state[{key!r}]")


def fused_matches_oracle(problem, rule, config, device, *, regime=FP32, oracle_rule=None):
    """Fused and oracle paths give the same bits for weight and every state slot, in
    any storage regime (same rounding streams on both paths).

    ``oracle_rule`` lets a test give the oracle a different rule, to show a change
    of operation order inside a rule is caught.
    """
    inputs = make_inputs(problem, device, regime)
    fused = run_rule(inputs, rule, oracle=False, config=config, regime=regime)
    oracle = run_rule(inputs, oracle_rule or rule, oracle=True, config=config, regime=regime)
    _assert_same_update(fused, oracle, rule,
                        f"fused vs oracle [{rule!r}; {problem.describe()}; {regime.describe()}; {config}]")


def repeatable(problem, rule, config, device, *, regime=FP32, repeats=3, oracle=False):
    """The same call, repeated from the same inputs, gives the same bits."""
    inputs = make_inputs(problem, device, regime)
    first = run_rule(inputs, rule, oracle=oracle, config=config, regime=regime)
    for i in range(1, repeats):
        again = run_rule(inputs, rule, oracle=oracle, config=config, regime=regime)
        _assert_same_update(again, first, rule,
                            f"repeat {i} [{rule!r}; {problem.describe()}; {regime.describe()}; {config}]")


def tiling_invariant(problem, rule, config_a, config_b, device, *, regime=FP32):
    """Two configs give the same bits (stochastic rounding included: its streams are
    keyed on the element's index in the weight, not on the tile)."""
    inputs = make_inputs(problem, device, regime)
    a = run_rule(inputs, rule, config=config_a, regime=regime)
    b = run_rule(inputs, rule, config=config_b, regime=regime)
    _assert_same_update(a, b, rule, f"{config_a} vs {config_b} [{rule!r}; {problem.describe()}; {regime.describe()}]")


def slice_invariant(problem, rule, config_whole, config_slice, rows, cols, device, *, regime=FP32):
    """A block ``[rows, cols]`` of the weight, updated on its own (its rows of dy, its
    columns of x, its ``WeightSlice``) under ``config_slice``, gets the bits of the same
    block of the whole weight's update under ``config_whole``: the weight gradient and
    every step's weight and state. The block may start anywhere inside a tile."""
    inputs = make_inputs(problem, device, regime)
    (r0, r1), (c0, c1) = rows, cols
    what = (f"block [{r0}:{r1}, {c0}:{c1}] alone ({config_slice}) vs the whole's ({config_whole}) "
            f"[{rule!r}; {problem.describe()}; {regime.describe()}]")
    for step, (x, dy) in enumerate(inputs.batches, start=1):
        whole_grad = fk.weight_gradient(x, dy, config=config_whole)
        block_grad = fk.weight_gradient(x[:, c0:c1], dy[:, r0:r1], config=config_slice)
        assert_bitwise_equal(block_grad, whole_grad[r0:r1, c0:c1], f"{what}: weight gradient of step {step}")
    whole_weight, whole_state = run_rule(inputs, rule, config=config_whole, regime=regime)
    block = Inputs(inputs.weight[r0:r1, c0:c1].clone(), [(x[:, c0:c1], dy[:, r0:r1]) for x, dy in inputs.batches])
    place = fk.WeightSlice(r0, c0, tuple(inputs.weight.shape))
    block_weight, block_state = run_rule(block, rule, config=config_slice, regime=regime, weight_slice=place)
    expected = {key: value[r0:r1, c0 // fk.q8.BLOCK:-(-c1 // fk.q8.BLOCK)] if key.endswith(fk.q8.EXPONENT_SUFFIX)
                else value[r0:r1, c0:c1] for key, value in whole_state.items()}
    _assert_same_update((block_weight, block_state), (whole_weight[r0:r1, c0:c1], expected), rule, what)


def epilogue_parts(config, shape):
    """Every part of an (N, K) weight that the config's epilogue verdicts cover (the
    tiles, or their column or row slices), as (r0, r1, c0, c1) in row-major order."""
    (N, K), (height, width) = shape, config.part_shape
    return [(r, min(N, r + height), c, min(K, c + width)) for r in range(0, N, height) for c in range(0, K, width)]


def _element_mask(tensor, mask):
    """``mask`` (per weight element) for a state tensor: itself, or per q8 block for the
    block exponents (a part holds whole blocks: ``strategies.fit_config``)."""
    return mask if tensor.shape == mask.shape else mask[:, ::fk.q8.BLOCK]


def assert_parts_kept(after: dict, before: dict, clean: dict, parts, what: str):
    """The weight and state tensors ``after`` a step that skipped ``parts`` ((r0, r1, c0,
    c1) each) hold ``before``'s bits inside those parts and ``clean``'s (a step that
    skipped none) outside them, tensor by tensor (dicts keyed alike)."""
    weight = next(iter(after.values()))
    skipped = torch.zeros(weight.shape, dtype=torch.bool, device=weight.device)
    for r0, r1, c0, c1 in parts:
        skipped[r0:r1, c0:c1] = True
    for name, got in after.items():
        mask = _element_mask(got, skipped)
        assert_bitwise_equal(got[mask], before[name][mask], f"{what}: {name} in the skipped parts")
        assert_bitwise_equal(got[~mask], clean[name][~mask], f"{what}: {name} outside them, against the clean step")


def non_finite_input_fails_reached_tiles(problem, rule, config, device, bad, *, regime=FP32, oracle=False):
    """``input_check="tiles"`` with one NaN or infinite element ``bad`` = (input, token,
    index, value; and whether the other operand's row at that token is zero, so that its
    products are 0 * inf = NaN): the step raises ``NonFiniteUpdateError`` naming exactly
    the parts whose columns (an element of x) or rows (of dy) hold ``index``; those keep
    their weight and state bits, every other part has the bits of the same step on the
    clean inputs, and nothing non-finite is stored (proofs/input_check_tiles.md)."""
    where, t, index, value, zero_row = bad
    inputs = make_inputs(problem, device, regime)
    x, dy = (v.clone() for v in inputs.batches[0])
    if zero_row:
        (dy if where == "x" else x)[t] = 0
    clean_weight, clean_state = run_rule(Inputs(inputs.weight, [(x, dy)]), rule, oracle=oracle, config=config,
                                         regime=regime)
    (x if where == "x" else dy)[t, index] = value
    weight = inputs.weight.clone()
    state = rule.init_state(weight, state_format=regime.state_format)
    before = {"weight": weight.clone(), **{k: v.clone() for k, v in state.items()}}
    what = (f"{where}[{t}, {index}] = {value}{' (other row zero)' if zero_row else ''}, {config}, oracle={oracle} "
            f"[{rule!r}; {problem.describe()}; {regime.describe()}]")
    try:
        fk.fused_weight_update(x, dy, weight, state, rule, 1, oracle=oracle, config=config, rounding=regime.rounding,
                               seed=regime.seed, input_check="tiles")
    except fk.NonFiniteUpdateError as error:
        named = sorted(error.tiles)
        assert "x and dy were not scanned" in str(error), f"{what}: the error does not say so: {error}"
    else:
        raise AssertionError(f"{what}: the step raised nothing")
    axis = 2 if where == "x" else 0
    reached = [part for part in epilogue_parts(config, weight.shape) if part[axis] <= index < part[axis + 1]]
    assert named == reached, f"{what}: named {named}, reached {reached}"
    assert_parts_kept({"weight": weight, **state}, before, {"weight": clean_weight, **clean_state}, reached, what)
    for name, values in [("weight", weight)] + list(decoded_state(rule, state).items()):
        assert torch.isfinite(values).all(), f"{what}: non-finite {name} stored"


def enclosed_run(inputs, rule, config, regime, backend):
    """The kernel's run on ``inputs`` and, alongside it, the float64 reference and the
    enclosure of the exact steps: (weight, state as stored, reference weight, reference
    state, enclosure of the weight, enclosures of the state slots), the last four after
    the last step."""
    weight, state = run_rule(inputs, rule, config=config, regime=regime)
    w0 = inputs.weight.detach().cpu()
    s0 = decoded_state(rule, rule.init_state(w0, state_format=regime.state_format))
    w_ref, s_ref = POINT.value(w0), {k: POINT.value(v) for k, v in s0.items()}
    for step, x, dy, w_enc, s_enc in enclosure_trajectory(rule, regime, backend, inputs):
        w_ref, s_ref = reference_step(rule, w_ref, weight_grad(x, dy), s_ref, step, POINT)
    return weight, state, w_ref, s_ref, w_enc, s_enc


def within_enclosure(problem, rule, config, device, backend, *, regime=FP32) -> float:
    """The fused result lies inside the rigorous enclosure of the exact step
    (proofs/reference_enclosure.md): fp32 arithmetic, plus one rounding per bf16 store
    (half a bf16 ulp to nearest, under one ulp stochastically). The float64 reference,
    which stores nothing rounded, lies inside too.

    Returns the largest share of the proven radius the kernel's weight and state use
    (``Interval.use``: at most 1, since they lie inside): a measure that stays meaningful
    where an ulp distance is not, at weights near 0 whose ulp is tiny.
    """
    inputs = make_inputs(problem, device, regime)
    weight, state, w_ref, s_ref, w_enc, s_enc = enclosed_run(inputs, rule, config, regime, backend)
    state = decoded_state(rule, state)
    what = f"[{rule!r}; {problem.describe()}; {config}]"
    _assert_inside(w_enc, weight, f"kernel weight {what}")
    _assert_inside(w_enc, w_ref, f"float64 reference weight {what}")
    for slot in rule.slots:
        _assert_inside(s_enc[slot], state[slot], f"kernel state[{slot!r}] {what}")
        _assert_inside(s_enc[slot], s_ref[slot], f"float64 reference state[{slot!r}] {what}")
    return max([w_enc.use(weight), *(s_enc[slot].use(state[slot]) for slot in rule.slots)])


def exact_inside_enclosure(problem, rule, backend, *, regime=FP32) -> None:
    """The exact trajectory (exact gradients, the rule in mpmath at 113 bits) lies inside
    the enclosure at every step: the enclosure bounds the real-number step, not merely
    the float64 one."""
    inputs = make_inputs(problem, torch.device("cpu"), regime)
    s0 = decoded_state(rule, rule.init_state(inputs.weight, state_format=regime.state_format))
    with mpmath.workprec(PRECISION_BITS):
        w_mp, s_mp = MPMATH.value(inputs.weight), {k: MPMATH.value(v) for k, v in s0.items()}
        for step, x, dy, w_enc, s_enc in enclosure_trajectory(rule, regime, backend, inputs):
            w_mp, s_mp = reference_step(rule, w_mp, exact_weight_grad(x, dy), s_mp, step, MPMATH)
            what = f"exact trajectory at step {step} [{rule!r}; {problem.describe()}; {regime.describe()}]"
            # to_float64 rounds the 113-bit value to the nearest float64; the enclosure's
            # slack (an fp32 rounding per operation) is far wider than that.
            _assert_inside(w_enc, torch.from_numpy(to_float64(w_mp)), what)
            for slot in rule.slots:
                _assert_inside(s_enc[slot], torch.from_numpy(to_float64(s_mp[slot])), f"{what}: state[{slot!r}]")


def enclosure_trajectory(rule, regime, backend, inputs):
    """(step, x, dy, weight enclosure, state enclosures) after each step of ``inputs``."""
    w0 = inputs.weight.detach().cpu()
    s0 = decoded_state(rule, rule.init_state(w0, state_format=regime.state_format))
    w_enc, s_enc = ENCLOSURE.value(w0), {k: ENCLOSURE.value(v) for k, v in s0.items()}
    for step, (x, dy) in enumerate(inputs.batches, start=1):
        w_enc, s_enc = reference_step(rule, w_enc, weight_grad_enclosure(x, dy, backend), s_enc, step, ENCLOSURE)
        w_enc, s_enc = _stored(rule, regime, w0.dtype, w_enc, s_enc)
        yield step, x, dy, w_enc, s_enc


def decoded_state(rule, state) -> dict:
    """The state's values as fp32 tensors by slot (q8 codes decoded)."""
    if rule.state_format(state) != "q8":
        return {slot: state[slot] for slot in rule.slots}
    return {slot: fk.q8.decode(state[slot], state[slot + fk.q8.EXPONENT_SUFFIX], slot not in rule.nonnegative)
            for slot in rule.slots}


def _stored(rule, regime, weight_dtype, w_enc, s_enc):
    """The enclosures after the step's stores in the regime's formats."""
    w_enc = w_enc.stored(weight_dtype, regime.rounding)
    if regime.state_format == "q8":
        s_enc = {k: v.stored_q8(k not in rule.nonnegative, regime.rounding) for k, v in s_enc.items()}
    else:
        dtype = torch.bfloat16 if regime.state_format == "bf16" else torch.float32
        s_enc = {k: v.stored(dtype, regime.rounding) for k, v in s_enc.items()}
    return w_enc, s_enc


def _assert_inside(enclosure: Interval, value: torch.Tensor, what: str):
    value = value.detach().cpu()
    inside = enclosure.contains(value)
    if bool(inside.all()):
        return
    index = tuple(int(i) for i in torch.nonzero(~inside)[0])
    raise AssertionError(f"{what}: {int((~inside).sum())} element(s) outside the proven enclosure; first at "
                         f"{index}: {value[index].item()!r} not in [{enclosure.lo[index].item()!r}, "
                         f"{enclosure.hi[index].item()!r}]")
