"""ChunkFT's claims, as functions (properties/test_chunkft_*.py draw the problems).

* ``plan_covers``: the chunks are disjoint, cover every trainable element exactly once,
  and each boundary sits within half a cut of its byte budget's position (so each chunk
  is within one row/column, one q8 block of columns for q8 column cuts, of its budget).
* ``chunk_step_matches_dense``: one step of chunk c gives, on chunk c's slices, the bits
  of the dense step (every parameter stepped whole, ``chunks=1``) on the same slices,
  weight and state, and leaves every other element bitwise untouched.
* ``schedule_and_resume``: the active chunk at step t is (t // switch_every) mod chunks,
  each chunk counts its visits and each of its slices the same steps (every module runs
  in every step), and a run resumed from a checkpoint taken at any step (mid-cycle
  included) continues bit for bit.
* ``sgd_chunk_step_descends``: on a convex quadratic, each SGD chunk step with lr = 1/L_c
  satisfies the descent lemma f(θ⁺) ≤ f(θ) − ‖∇_c f‖²/(2L_c), up to a slack bounding
  the fp32 step's rounding (proofs/chunkft.md).
"""

import copy
import io
from dataclasses import dataclass

import torch
from torch import nn

import forge_kernels as fk
from forge_kernels.chunkft import Slice, plan_chunks, tensor_costs
from forge_kernels.chunkft.plan import UNITS_PER_BYTE

from ..numerics.bits import assert_bitwise_equal
from ..numerics.tolerances import UNIT_ROUNDOFF, gamma

_U32 = UNIT_ROUNDOFF[torch.float32]
_U64 = UNIT_ROUNDOFF[torch.float64]


class TinyChunkModel(nn.Module):
    """Every module kind ChunkFT slices: Embedding (padding row 0) → LayerNorm without bias
    → Linear with bias → RMSNorm → Linear without bias (the logits)."""

    def __init__(self, vocab, width, hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width, bias=False)
        self.up = nn.Linear(width, hidden)
        self.rms = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():  # non-trivial norm parameters, so their updates are not symmetric
            self.norm.weight.add_(torch.randn(width) * 0.1)
            self.rms.weight.add_(torch.randn(hidden) * 0.1)

    def forward(self, tokens):
        return self.head(self.rms(self.up(self.norm(self.embed(tokens)))))


@dataclass(frozen=True)
class ChunkProblem:
    vocab: int
    width: int
    hidden: int
    batch: int
    length: int
    seed: int

    def describe(self) -> str:
        return (f"vocab={self.vocab} width={self.width} hidden={self.hidden} tokens={self.batch}x{self.length} "
                f"seed={self.seed}")

    def model(self, dtype=torch.float32):
        """Built on the CPU (the same initial bits everywhere), then moved to where the
        kernels run."""
        return TinyChunkModel(self.vocab, self.width, self.hidden, self.seed).to(fk.kernel_device(), dtype)

    def batches(self, steps):
        gen = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for _ in range(steps):
            tokens = torch.randint(0, self.vocab, (self.batch, self.length), generator=gen)
            tokens[0, 0] = 0  # the padding row is always looked up
            targets = torch.randint(0, self.vocab, (self.batch, self.length), generator=gen)
            out.append((tokens.to(fk.kernel_device()), targets.to(fk.kernel_device())))
        return out


def _loss(model, tokens, targets):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _controller(model, rule, chunks, regime, split, **kwargs):
    return fk.ChunkFT(model, copy.deepcopy(rule), chunks, split=split, seed=regime.seed,
                      state_format=regime.state_format, rounding=regime.rounding, **kwargs)


# ----- planning -------------------------------------------------------------------------
def plan_covers(named_shapes, rule, state_format, split, chunks, along_rows=()):
    """The plan's chunks are disjoint and cover each element of every tensor once; each
    inner boundary is within half a cut granule (bytes) of i·total/chunks. Returns the
    plan. ``named_shapes``: (name, shape, dtype) triples."""
    tensors = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in named_shapes]
    costs = tensor_costs(tensors, rule, state_format, split, along_rows=along_rows)
    plan = plan_chunks(costs, chunks)
    what = f"[{rule!r}; {state_format}; split={split}; chunks={chunks}; {named_shapes}]"
    by_name = {c.name: c for c in costs}
    cover = {name: torch.zeros(shape, dtype=torch.int64) for name, shape, _ in named_shapes}
    for i, pieces in enumerate(plan):
        for piece in pieces:
            cost = by_name[piece.name]
            if piece.dim != cost.dim:
                raise AssertionError(f"{what}: chunk {i} cuts {piece.name!r} along dim {piece.dim}, "
                                     f"expected {cost.dim}")
            cover[piece.name][_index(piece, cover[piece.name].shape)] += 1
            granule = cost.granule
            for end in (piece.start, piece.stop):
                if end % granule and end != cost.length:
                    raise AssertionError(f"{what}: chunk {i} cuts {piece.name!r} at {end}, not a multiple of "
                                         f"{granule}")
    for name, counts in cover.items():
        if counts.numel() and not bool((counts == 1).all()):
            bad = int((counts != 1).sum())
            found = sorted(set(counts.flatten().tolist()))
            raise AssertionError(f"{what}: {bad} element(s) of {name!r} are in {found} chunks, not exactly one")
    total = sum(c.units for c in costs)
    position = 0
    for i, pieces in enumerate(plan[:-1], start=1):
        position += sum((p.stop - p.start) * by_name[p.name].units_per_index for p in pieces)
        # the granule of the tensor the budget position falls in (the boundary may land on
        # that tensor's start, after the chunk's last piece)
        target = next(c for c in _with_starts(costs) if c[0] * chunks <= i * total < (c[0] + c[1].units) * chunks)[1]
        granule_units = target.units_per_index * target.granule
        # |position − i·total/chunks| ≤ granule/2, in exact integers (scaled by 2·chunks)
        if abs(2 * chunks * position - 2 * i * total) > chunks * granule_units:
            raise AssertionError(f"{what}: boundary {i} at {position / UNITS_PER_BYTE} bytes, budget position "
                                 f"{i * total / chunks / UNITS_PER_BYTE}: more than half a cut "
                                 f"({granule_units / UNITS_PER_BYTE / 2} bytes) away")
    return plan


def _with_starts(costs):
    start = 0
    for cost in costs:
        yield start, cost
        start += cost.units


# ----- one chunk step against the dense step ---------------------------------------------
def _state_slice(tensor, key, piece, shape):
    """The part of a dense (chunks=1) state tensor that belongs to ``piece``: rows, or
    columns (q8 exponents: the 32-column blocks), a 1-D range as columns of one row."""
    if len(shape) == 2 and piece.dim == 0:
        return tensor[piece.start:piece.stop]
    if key.endswith(fk.q8.EXPONENT_SUFFIX):
        return tensor[:, piece.start // fk.q8.BLOCK:-(-piece.stop // fk.q8.BLOCK)]
    return tensor[:, piece.start:piece.stop]


def chunk_step_matches_dense(problem, rule, regime, chunks, split, cycles=2):
    """Over ``cycles`` cycles of ``chunks`` steps, each chunk step equals, on the chunk's
    slices, the dense step (``chunks=1``) taken from the same weights with the chunk's
    state pasted into the dense state and each tensor's dense step count set to its
    slice's own: bitwise, weight and every state tensor. Nothing outside the slices
    moves. A later visit's bits therefore show the slice's own step count (bias
    corrections) at work."""
    batches = problem.batches(cycles * chunks)
    model = problem.model(regime.weight)
    ctl = _controller(model, rule, chunks, regime, split)
    for t, (tokens, targets) in enumerate(batches):
        c = ctl.active_chunk
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        pieces = {s[0]: Slice(*s) for s in ctl.chunk_slices(c)}
        dense_model = copy.deepcopy(model)
        dense = _controller(dense_model, rule, 1, regime, split)
        checkpoint = dense.state_dict()
        checkpoint["steps"] = {f"{name}@0": count for name, count in ctl.slice_steps(c).items()}
        checkpoint["state"] = _dense_state(rule, regime, model, pieces, ctl.chunk_state(c))
        dense.load_state_dict(checkpoint)
        dense.step(lambda: _loss(dense_model, tokens, targets))
        ctl.step(lambda: _loss(model, tokens, targets))
        what = (f"step {t}: chunk {c} of {chunks} ({split}), its slices' steps {ctl.slice_steps(c)}, vs dense "
                f"[{rule!r}; {problem.describe()}; {regime.describe()}]")
        state, dense_state = ctl.chunk_state(c), dense.chunk_state(0)
        dense_params = dict(dense_model.named_parameters())
        for name, param in model.named_parameters():
            expected = before[name]
            piece = pieces.get(name)
            if piece is not None:
                index = _index(piece, param.shape)
                expected[index] = dense_params[name].detach()[index]
                for key, tensor in state[name].items():
                    assert_bitwise_equal(tensor, _state_slice(dense_state[name][key], key, piece, param.shape),
                                         f"{what}: state[{key!r}] of {name!r} {piece.as_tuple()}")
            assert_bitwise_equal(param.detach(), expected,
                                 f"{what}: {name!r} (chunk slice {piece.as_tuple() if piece else None}; "
                                 "the dense step inside it, the bits before the step outside)")


def _dense_state(rule, regime, model, pieces, chunk_state):
    """A dense (chunks=1) checkpoint's state: fresh whole-tensor state with the chunk's
    slices pasted in (the rule is element-wise, so the rest never reaches the slices)."""
    out = {}
    for name, param in model.named_parameters():
        shape2d = (1, param.shape[0]) if param.dim() == 1 else tuple(param.shape)
        state = rule.init_state(torch.empty(shape2d, dtype=param.dtype), state_format=regime.state_format)
        if name in chunk_state:
            for key, tensor in chunk_state[name].items():
                _state_slice(state[key], key, pieces[name], param.shape).copy_(tensor)
        out[f"{name}@0"] = state
    return out


def _index(piece, shape):
    if len(shape) == 1 or piece.dim == 0:
        return (slice(piece.start, piece.stop),)
    return (slice(None), slice(piece.start, piece.stop))


# ----- schedule and resume ---------------------------------------------------------------
def _snapshot(model, ctl):
    return {name: p.detach().clone() for name, p in model.named_parameters()}, ctl.state_dict()


def schedule_and_resume(problem, rule, regime, chunks, switch_every, split, steps, resume_at, order="cyclic"):
    """Runs ``steps`` steps straight; checks the schedule, each chunk's visits and its
    slices' step counts at every step; then resumes a fresh model and controller from a
    checkpoint (through ``torch.save``) taken after ``resume_at`` steps and checks that the
    remaining steps give the same bits, weights and state."""
    batches = problem.batches(steps)
    what = (f"[{rule!r}; chunks={chunks} switch_every={switch_every} {split} {order}; {problem.describe()}; "
            f"{regime.describe()}]")
    model = problem.model(regime.weight)
    ctl = _controller(model, rule, chunks, regime, split, switch_every=switch_every, order=order)
    visits = [0] * chunks
    saved = None
    for t, (tokens, targets) in enumerate(batches):
        if t == resume_at:
            saved = (copy.deepcopy(model.state_dict()), _through_bytes(ctl.state_dict()))
        expected = (t // switch_every) % chunks if order == "cyclic" else ctl.chunk_at(t)
        if ctl.active_chunk != expected:
            raise AssertionError(f"{what}: step {t} activates chunk {ctl.active_chunk}, expected {expected}")
        ctl.step(lambda: _loss(model, tokens, targets))
        visits[expected] += 1
        if list(ctl.chunk_steps) != visits:
            raise AssertionError(f"{what}: after step {t} chunk step counts {list(ctl.chunk_steps)}, "
                                 f"expected {visits}")
        if set(ctl.slice_steps(expected).values()) != {visits[expected]}:
            raise AssertionError(f"{what}: after step {t} chunk {expected}'s slices counted "
                                 f"{ctl.slice_steps(expected)}, expected {visits[expected]} each")
    if order == "random":
        for cycle in range(-(-steps // (switch_every * chunks))):
            seen = sorted({ctl.chunk_at((cycle * chunks + p) * switch_every) for p in range(chunks)})
            if seen != list(range(chunks)):
                raise AssertionError(f"{what}: cycle {cycle} visits chunks {seen}, not each once")
    if saved is None:
        return
    resumed = problem.model(regime.weight)
    resumed.load_state_dict(saved[0])
    again = _controller(resumed, rule, chunks, regime, split, switch_every=switch_every, order=order)
    again.load_state_dict(saved[1])
    for tokens, targets in batches[resume_at:]:
        again.step(lambda: _loss(resumed, tokens, targets))
    (w_a, s_a), (w_b, s_b) = _snapshot(model, ctl), _snapshot(resumed, again)
    for name in w_a:
        assert_bitwise_equal(w_b[name], w_a[name], f"resumed at step {resume_at} {what}: {name!r}")
    schedule = ("position", "chunk_steps", "steps")
    if any(s_a[key] != s_b[key] for key in schedule):
        raise AssertionError(f"resumed at step {resume_at} {what}: schedule {[s_b[key] for key in schedule]} vs "
                             f"{[s_a[key] for key in schedule]}")
    if set(s_a["state"]) != set(s_b["state"]):
        raise AssertionError(f"resumed at step {resume_at} {what}: state keys differ")
    for key, state in s_a["state"].items():
        for slot, tensor in state.items():
            assert_bitwise_equal(s_b["state"][key][slot], tensor, f"resumed at step {resume_at} {what}: {key} {slot}")


def _through_bytes(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ----- descent on a convex quadratic -------------------------------------------------------
def quadratic_objective(weight, x, y):
    """f(W) = ½ Σ_t ‖W x_t − y_t‖², in float64 (W: (N, K), x: (T, K), y: (T, N))."""
    residual = x @ weight.T - y
    return 0.5 * float((residual * residual).sum())


def quadratic_gradient(weight, x, y):
    return (x @ weight.T - y).T @ x


def chunk_smoothness(x, dim, start, stop) -> float:
    """L_c: the largest eigenvalue of f's Hessian restricted to the chunk. f separates over
    the rows of W, each row's Hessian is XᵀX; a column range C sees X_CᵀX_C. Computed in
    float64 and raised by a relative 1e-10, far above eigvalsh's error at these sizes, so
    that it bounds the true value from above."""
    xc = x if dim == 0 else x[:, start:stop]
    return float(torch.linalg.eigvalsh(xc.T @ xc).max()) * (1 + 1e-10) + 1e-300


def descent_slack(w, w_new, x, y, lr, dim, start, stop) -> float:
    """How far rounding can lift f(W̃⁺) above f(W⁺), the exact step's value
    (proofs/chunkft.md): Σ over the chunk of |∇f(W̃⁺)|·Δ, Δ bounding |W̃⁺ − W⁺| per element
    from the fp32 forward (dY), the fp32 weight gradient (token sum), lr rounded to fp32 and
    the rounded update; plus the float64 evaluation error of the three quantities compared."""
    T, K = x.shape
    index = (slice(start, stop), slice(None)) if dim == 0 else (slice(None), slice(start, stop))
    magnitude = x.abs() @ w.abs().T + y.abs()                          # Σ_k |W_ik x_tk| + |y_ti|
    dy_error = gamma(K + 1, _U32) * magnitude                       # fp32 forward and residual
    dy_bound = (x @ w.T - y).abs() + dy_error
    grad_error = gamma(T, _U32) * (dy_bound.T @ x.abs()) + dy_error.T @ x.abs()
    grad = quadratic_gradient(w, x, y)
    grad_bound = grad.abs() + grad_error
    delta = (lr * grad_error + lr * grad_bound * (2 * _U32 + _U32 ** 2)
             + _U32 / (1 - _U32) * w_new.abs())[index]
    lift = float((quadratic_gradient(w_new, x, y).abs()[index] * delta).sum()) * (1 + 1e-6)
    scale = 0.5 * float((x.abs() @ torch.maximum(w.abs(), w_new.abs()).T + y.abs()).square().sum())
    evaluation = 4 * (K + T + 4) * _U64 * (scale + float(grad_bound.square().sum()) / (2 * (1 / lr)))
    return lift + evaluation


def sgd_chunk_step_descends(x, y, w0, chunks, split, steps, lr_factor=1.0):
    """ChunkFT with the plain SGD rule on f(W) = ½Σ‖Wx_t − y_t‖² (one nn.Linear, no bias,
    loss ½‖XWᵀ − Y‖²): every chunk step, with lr = lr_factor / L_c set through the
    controller's param group, satisfies f(W̃⁺) ≤ f(W) − ‖∇_c f(W)‖²/(2L_c) + slack.
    Returns the largest share, over the steps, of the achieved decrease f(W) − f(W̃⁺) that
    the lemma guarantees (its ‖∇_c f‖²/(2L_c) less the slack): at most 1 when it holds,
    about 1 where the lemma is tight."""
    T, K = x.shape
    N = y.shape[1]
    model = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    model.to(fk.kernel_device())
    ctl = fk.ChunkFT(model, fk.SGD(lr=1.0), chunks, split=split)
    x64, y64 = x.double().cpu(), y.double().cpu()  # the float64 bound is computed on the CPU
    x, y = x.to(fk.kernel_device()), y.to(fk.kernel_device())
    worst = 0.0
    for t in range(steps):
        ((_, dim, start, stop),) = ctl.chunk_slices(ctl.active_chunk)
        L = chunk_smoothness(x64, dim, start, stop)
        lr = lr_factor / L
        ctl.param_groups[0]["lr"] = lr
        w = model.weight.detach().double().cpu().clone()
        index = (slice(start, stop), slice(None)) if dim == 0 else (slice(None), slice(start, stop))
        f0 = quadratic_objective(w, x64, y64)
        g = quadratic_gradient(w, x64, y64)[index]
        ctl.step(lambda: 0.5 * (model(x) - y).square().sum())
        w_new = model.weight.detach().double().cpu()
        f1 = quadratic_objective(w_new, x64, y64)
        bound = f0 - float(g.square().sum()) / (2 * L) + descent_slack(w, w_new, x64, y64, lr, dim, start, stop)
        if f1 > bound:
            raise AssertionError(f"step {t}, chunk {ctl.chunk_at(t)} ({split}, rows/cols {start}:{stop}), "
                                 f"lr={lr_factor}/L_c: f went {f0!r} -> {f1!r}, above the descent bound "
                                 f"{bound!r} (by {f1 - bound:.3e})")
        guaranteed, achieved = f0 - bound, f0 - f1
        share = guaranteed / achieved if achieved > 0 else (0.0 if guaranteed <= 0 else float("inf"))
        worst = max(worst, share)
    return worst


# ----- bounds of the norm and bias gradient tests -----------------------------------------
def norm_weight_grad_bound(x, dy, kind, eps, u):
    """Element-wise bound on |ĝ − g| for a LayerNorm ("layer_norm") or RMSNorm
    ("rms_norm") weight gradient g = Σ_t dy_t·x̂_t over the last dim, ĝ computed in a
    format of unit roundoff ``u`` from the same x and dy in any order of summation, g
    exact (proofs/chunkft.md §8): twice the first-order bound, which covers the
    second-order terms and the bound's own float64 evaluation."""
    x = x.double().reshape(-1, x.shape[-1])
    dy = dy.double().reshape(-1, dy.shape[-1])
    T, D = x.shape
    if kind == "rms_norm":
        rstd = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        x_hat = x * rstd
        x_hat_error = gamma(D + 7, u) * x_hat.abs()
    elif kind == "layer_norm":
        centered = x - x.mean(-1, keepdim=True)
        variance = (centered * centered).mean(-1, keepdim=True)
        reach = x.abs() + x.abs().mean(-1, keepdim=True)  # |x_j| + mean|x|, above |x_j − μ|
        cancellation = (variance + 2 * (reach * reach).mean(-1, keepdim=True) + eps) / (variance + eps)
        rstd = torch.rsqrt(variance + eps)
        x_hat = centered * rstd
        x_hat_error = rstd * (gamma(D + 2, u) * reach + gamma(D + 7, u) * cancellation * centered.abs())
    else:
        raise ValueError(f"kind must be 'layer_norm' or 'rms_norm', got {kind!r}")
    return 2 * token_sum_bound(dy.abs() * (x_hat.abs() + x_hat_error), u) + 2 * (dy.abs() * x_hat_error).sum(0)


def token_sum_bound(magnitudes, u):
    """γ_T·Σ_t m_t per column: the error of a length-T dot product (or sum) over the tokens
    (dim 0) in any order, its terms' magnitudes m (proofs/chunkft.md §8)."""
    magnitudes = magnitudes.double().reshape(-1, magnitudes.shape[-1])
    return gamma(max(magnitudes.shape[0], 1), u) * magnitudes.sum(0)


def sgd_step_bound(weight, lr, grad, u):
    """Bound on |(w − w⁺)/lr − ĝ| for a plain SGD step w⁺ = fl(w − fl(lr·ĝ)) (no momentum,
    no decay, lr exact in the format): u·(|w|/lr + 2|ĝ|), to first order, doubled
    (proofs/chunkft.md §8). ``grad`` bounds |ĝ| element-wise."""
    return 2 * u * (weight.double().abs() / lr + 2 * grad.double().abs())
