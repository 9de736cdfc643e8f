"""Jobs for GIFT's DDP communication hook (``fk.gift.gift_hook``) on a rank pool
(``ranks.RankPool``): each is a module-level function run on every rank, returning
what the properties in ``properties/test_gift_hook.py`` compare."""

import copy
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import forge_kernels as fk

from .sharding import device as rank_device

#: bytes of E4M3 codes that are finite (all but 0x7F and 0xFF)
E4M3_FINITE = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)


def _integer_mlp(seed: int) -> nn.Sequential:
    """Small integer weights and biases: with integer inputs every gradient is an integer
    far below 2**24, and every sum and power-of-two average of them is exact."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).to(p.dtype))
    return model


def hook_versus_all_reduce(seed: int, unselected: str, bucket_cap_mb: float, steps: int = 2):
    """GIFT's hook with the identity transform and the identity ("fp32") codec against
    DDP's own all-reduce averaging, on integer data: [(hook gradient, DDP gradient)] per
    parameter and step."""
    rank = dist.get_rank()
    model = _integer_mlp(seed)
    twin = copy.deepcopy(model)
    gift = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = fk.gift.GiftState(None, "fp32", 4, 1, layers=[model[0], model[2]], transform="identity",
                              unselected=unselected)
    gift.register_comm_hook(state, fk.gift.gift_hook)
    plain = DistributedDataParallel(twin, bucket_cap_mb=bucket_cap_mb)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    pairs = []
    for _ in range(steps):
        x = torch.randint(-3, 4, (8, 16), generator=g).float()
        target = torch.randint(-2, 3, (8, 8), generator=g).float()
        for net in (gift, plain):
            net.zero_grad(set_to_none=True)
            (net(x) * target).sum().backward()
        pairs += [(a.grad.clone(), b.grad.clone()) for a, b in zip(model.parameters(), twin.parameters())]
    return pairs


def e4m3_exchange_versus_all_reduce(seed: int, route: str):
    """The hook's exchange of E4M3 values with the shared amax 448 (scale 1), on the
    plain or the GIFT route (identity transform), against all_reduce / world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    codes = E4M3_FINITE[torch.randint(0, E4M3_FINITE.numel(), (6, 32), generator=g)]
    if rank == world - 1:
        codes[0, 0] = 0x7E  # 448: the agreed amax, so the scale is 1
    codes[codes == 0xFE] = 0x7E  # and no -448 elsewhere to confuse the reading
    x = fk.gift.e4m3.values(codes)
    state = fk.gift.GiftState(None, "e4m3", layers=(), error_feedback=False, exchange="all_gather")
    whitening = fk.gift.Whitening.identity(32) if route == "gift" else None
    out = state.exchange([("g", x, whitening)])[0]
    expected = x.clone()
    dist.all_reduce(expected)
    return out, expected / world


def exchange_versus_local_decodes(seed: int, fmt: str, route: str, shape: tuple, exchange: str = "all_gather"):
    """The hook's exchange of rank-specific data (amaxes differing across ranks): its
    result and, from every rank, what that rank decoded locally (``last_sent``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(shape, generator=g) * 2.0 ** (3 * rank) * torch.logspace(-3, 0, shape[-1], base=2.0)
    state = fk.gift.GiftState(None, fmt, layers=(), error_feedback=False, exchange=exchange)
    whitening = fk.gift.Whitening.identity(shape[-1]) if route == "gift" else None
    out = state.exchange([("g", x, whitening), ("h", x[..., :1].clone(), None)])
    sent = [state.last_sent["g"], state.last_sent["h"]]
    everyone = [[torch.empty_like(t) for _ in range(world)] for t in sent]
    for gathered, t in zip(everyone, sent):
        dist.all_gather(gathered, t)
    return out, everyone


def hook_gain(seed: int, fmt: str, route: str, exchange: str, features: int = 1024, subspace: int = 32):
    """RelL2 of the hook's averaged result for one layer gradient against the exact
    (float64) mean over ranks. Every rank's activations lie in one shared rank-32
    subspace (scales 1 to 0.1); the transform comes from a 4096-token window recorded by
    the state's own forward hooks, all-reduced and broadcast by ``refresh``; each rank's
    gradient is Δᵀ X from 512 tokens of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    basis = torch.linalg.qr(torch.randn(features, subspace, generator=torch.Generator().manual_seed(seed)))[0]
    g = torch.Generator().manual_seed(seed * 1000 + rank)

    def activations(rows):
        return (torch.randn(rows, subspace, generator=g) * torch.logspace(0, -1, subspace)) @ basis.T

    layer = nn.Linear(features, 256, bias=False)
    state = fk.gift.GiftState(None, fmt, subspace, 50, layers=[layer] if route == "gift" else [],
                              error_feedback=False, exchange=exchange)
    if route == "gift":
        layer(activations(4096))  # recorded by the state's forward pre-hook
        state.refresh(0)
    G = torch.randn(512, 256, generator=g).T @ activations(512)
    whitening = state.whitenings[0] if route == "gift" else None
    out = state.exchange([("w", G, whitening)])[0]
    exact = G.double()
    dist.all_reduce(exact)
    exact /= world
    return float((out.double() - exact).norm() / exact.norm())


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gift_training_digests(seed: int, fmt: str, steps: int, refresh_every: int):
    """DDP training with the GIFT hook (whitening, rank 8) on rank-specific data: the
    factor digests after every refresh and the parameters' digest after every step. Each
    rank's damping differs (1e-3 · (rank + 1)), so factors computed from the all-reduced
    covariance on each rank would differ: equal digests show that every rank holds the
    first rank's factors, which only the broadcast gives it."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    ddp = DistributedDataParallel(model)
    state = fk.gift.GiftState(None, fmt, 8, refresh_every, layers=[model[0], model[2]], damping=1e-3 * (rank + 1))
    ddp.register_comm_hook(state, fk.gift.gift_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    mix = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0, -2, 32)
    parameter_digests = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g) @ mix
        optimizer.zero_grad(set_to_none=True)
        ((ddp(x) - x) ** 2).mean().backward()
        optimizer.step()
        parameter_digests.append(_digest(model.parameters()))
    return state.digests, parameter_digests


class _GatedBranches(nn.Module):
    """Two linear branches summed; ``gate`` scales the second one's output (0 turns its
    gradients to exact zeros)."""

    def __init__(self, features: int = 16):
        super().__init__()
        self.a, self.b = nn.Linear(features, features), nn.Linear(features, features)
        self.register_buffer("gate", torch.ones(()))

    def forward(self, x):
        return self.a(x) + self.gate * self.b(x)


def gated_branch_training(seed: int, fmt: str, exchange: str, route: str, steps: int):
    """DDP with the GIFT hook (error feedback on), the second branch gated off after step
    0, so that its gradients are exactly zero from then on and their residuals decay
    step by step towards fp32's smallest values (``route`` "gift": that branch whitened).
    (the first step at which a parameter or the hook's result was not finite, or None;
    the error raised, or None; the largest |residual| of the gated weight at the end)."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = _GatedBranches()
    ddp = DistributedDataParallel(model)
    state = fk.gift.GiftState(None, fmt, 4, 10, layers=[model.b] if route == "gift" else [], exchange=exchange,
                              overlap=False)
    ddp.register_comm_hook(state, fk.gift.gift_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for step in range(steps):
        if step == 1:
            model.gate.zero_()
        optimizer.zero_grad(set_to_none=True)
        try:
            (ddp(torch.randn(8, 16, generator=g)) ** 2).mean().backward()
        except Exception as error:  # noqa: BLE001 - reported to the property, which fails on it
            return step, f"{type(error).__name__}: {error}", None
        tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return step, None, None
        optimizer.step()
    return None, None, float(state.residuals[id(model.b.weight)].abs().max())


def factor_computations(seed: int, features: int = 24, rank: int = 4):
    """``agreed_whitening`` of a rank-specific covariance: (how many times this rank ran
    ``Whitening.from_covariance``, the factors' digest)."""
    from unittest import mock

    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    x = torch.randn(64, features, generator=g)
    with mock.patch.object(fk.gift.Whitening, "from_covariance", wraps=fk.gift.Whitening.from_covariance) as spy:
        whitening, _ = fk.gift.agreed_whitening(x.T @ x / 64, features, rank, 1e-3)
    return spy.call_count, whitening.digest()


def singular_transform(features: int = 8):
    """``agreed_whitening`` of a rank-one covariance without damping, whose discarded
    eigenvalues are all zero, so the first rank cannot compute the transform: the error
    each rank raised (every rank must raise, none wait)."""
    A = torch.zeros(features, features)
    A[0, 0] = 1.0
    try:
        fk.gift.agreed_whitening(A, features, 2, 0.0)
    except ValueError as error:
        return str(error)
    return None


def _ledger_state(layer, exchange: str):
    """The ledgers' hook state: E4M3 with power-of-two scales and no damping, so that
    with power-of-two transforms and dyadic gradients every step is exact in float64;
    no automatic refresh (the ledgers refresh by hand)."""
    return fk.gift.GiftState(None, "e4m3", 0, 10**9, layers=[layer], damping=0.0, scaling="power_of_two",
                             exchange=exchange)


def _dyadic_gradient(g: torch.Generator) -> torch.Tensor:
    """An (8, 16) gradient of multiples of 2**-6 in [-1, 1]."""
    return torch.randint(-64, 65, (8, 16), generator=g).float() * 2.0 ** -6


def error_feedback_ledger(seed: int, steps: int, refreshes: dict):
    """Error feedback across refreshes with power-of-two transforms (rank 0 on 4**(k-2)·I,
    from inputs 2**k·I) and power-of-two scales, dyadic gradients: (Σ sent + residual,
    Σ input) in real coordinates as float64, and the σ of each transform used."""
    rank = dist.get_rank()
    layer = nn.Linear(16, 8, bias=False)
    state = _ledger_state(layer, "all_gather")  # the per-rank ledger: no shard residual folds in
    key = id(layer.weight)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    sent = torch.zeros(8, 16, dtype=torch.float64)
    given = torch.zeros(8, 16, dtype=torch.float64)
    sigmas = []
    for t in range(steps):
        if t in refreshes:
            layer(2.0 ** refreshes[t] * torch.eye(16))
            state.refresh(0)
        whitening = state.whitenings[0]
        G = _dyadic_gradient(g)
        state.exchange([(key, G, whitening)])
        sent += whitening.invert(state.last_sent[key]).double()
        given += G.double()
        sigmas.append(float(whitening.sigma))
    return sent + state.whitenings[0].invert(state.residuals[key]).double(), given, sigmas


def tiny_gpt_losses(seed: int, fmt: str, selection: str, steps: int, error_feedback: bool = True,
                    batch: int = 8, lr: float = 3e-3, refresh_every: int = 50, rank: int = 32,
                    exchange: str = "reduce_scatter"):
    """DDP training of the tiny GPT (``forge_verify.models.tiny_gpt``) on the shipped tales,
    each rank its own batches, AdamW. ``fmt`` "fp32-allreduce" is DDP's own averaging;
    otherwise every gradient crosses as ``fmt`` through ``gift_hook``, the MLP output
    layers (fc2) whitened when ``selection`` is "fc2", none when "none". The training
    losses, rank 0's view (DDP keeps the ranks' parameters equal)."""
    from ..models import corpus
    from ..models.tiny_gpt import GPT, GPTConfig

    text = corpus.load()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=len(vocab))
    model = GPT(config)
    ddp = DistributedDataParallel(model)
    if fmt != "fp32-allreduce":
        layers = [block.out for block in model.blocks] if selection == "fc2" else []
        state = fk.gift.GiftState(None, fmt, rank, refresh_every, layers=layers, error_feedback=error_feedback,
                                  exchange=exchange)
        ddp.register_comm_hook(state, fk.gift.gift_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - config.block_size - 1, (batch,), generator=g)
        x = torch.stack([ids[s:s + config.block_size] for s in starts])
        y = torch.stack([ids[s + 1:s + config.block_size + 1] for s in starts])
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _everyone(t: torch.Tensor):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return gathered


def identity_reduce_scatter_versus_rank_order_sum(seed: int, route: str, shapes):
    """The identity codec ("fp32") through the reduce-scatter exchange on Gaussian data
    (sums round), against every rank's inputs all-gathered and summed in fp32 left to
    right in rank order, divided by the world size (T = I on the GIFT route): (outs,
    references), and the exchange repeated on a fresh state (its outs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    xs = [torch.randn(shape, generator=g) * 2.0 ** rank for shape in shapes]
    runs = []
    for _ in range(2):
        state = fk.gift.GiftState(None, "fp32", layers=(), exchange="reduce_scatter")
        entries = [(i, x, fk.gift.Whitening.identity(x.shape[-1]) if route == "gift" else None)
                   for i, x in enumerate(xs)]
        runs.append(state.exchange(entries))
    references = []
    for x in xs:
        everyone = _everyone(x)
        total = everyone[0].clone()
        for other in everyone[1:]:
            total += other
        references.append(total / world)
    return runs[0], references, runs[1]


def exchange_bytes(fmt: str, exchange: str, numels):
    """One exchange of tensors of ``numels`` elements: (wire_bytes, received_bytes)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    state = fk.gift.GiftState(None, fmt, layers=(), exchange=exchange)
    state.exchange([(i, torch.randn(n, generator=g), None) for i, n in enumerate(numels)])
    return dict(state.wire_bytes), dict(state.received_bytes)


def reduce_scatter_ledger(seed: int, steps: int, refreshes: dict, switch_at: int = None):
    """``error_feedback_ledger`` on the reduce-scatter exchange, where the second
    quantization's residual sits with the shard's owner: over all ranks, in real
    coordinates as float64, (Σ_t world · out_t + Σ_r (first residual_r + shard
    residual_r), Σ_t Σ_r G_r), and whether some rank held a nonzero shard residual at
    the end and before the refresh. ``switch_at``: at that step the state is saved and
    loaded into an all-gather hook, which goes on from there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = nn.Linear(16, 8, bias=False)
    state = _ledger_state(layer, "reduce_scatter")
    key = id(layer.weight)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out_total = torch.zeros(8, 16, dtype=torch.float64)
    given = torch.zeros(8, 16, dtype=torch.float64)
    held = []
    for t in range(steps):
        if t == switch_at:
            saved = state.state_dict([layer.weight])
            state = _ledger_state(layer, "all_gather")
            state.load_state_dict(saved, [layer.weight])
        if t in refreshes:
            held.append(bool(key in state.shard_residuals and state.shard_residuals[key][2].abs().max() > 0))
            layer(2.0 ** refreshes[t] * torch.eye(16))
            state.refresh(0)
        G = _dyadic_gradient(g)
        out_total += world * state.exchange([(key, G, state.whitenings[0])])[0].double()
        given += G.double()
    residual = state.residuals[key].clone()
    if key in state.shard_residuals:
        start, stop, r = state.shard_residuals[key]
        residual.view(-1)[start:stop] += r
        held.append(bool(r.abs().max() > 0))
    accounted = state.whitenings[0].invert(residual).double()
    dist.all_reduce(accounted)
    dist.all_reduce(given)
    flags = torch.tensor(held, dtype=torch.float32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return out_total + accounted, given, flags.bool().tolist()


def overflowing_shard_sum(seed: int):
    """Every rank sends 3e38 in one element (finite; the shared amax is 3e38), so the
    shard sum overflows fp32: every rank's reduce-scatter exchange raises, and no
    residual was written. (error message, residual keys, shard residual keys)."""
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    x = torch.randn(4, 16, generator=g)
    x[1, 5] = 3e38
    state = fk.gift.GiftState(None, "e4m3", layers=(), exchange="reduce_scatter")
    try:
        state.exchange([("x", x, None)])
    except fk.NonFiniteInputError as error:
        return str(error), sorted(state.residuals), sorted(state.shard_residuals)
    return None, sorted(state.residuals), sorted(state.shard_residuals)


def identity_overflow_then_finite(seed: int):
    """The identity ("fp32") codec on the reduce-scatter: a step whose shard sum overflows
    (3e38 from every rank: inf in the result, as an fp32 all-reduce gives), then a finite
    step. (whether the second result is finite, the shard residual keys held)."""
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    x = torch.randn(4, 16, generator=g)
    x[1, 5] = 3e38
    state = fk.gift.GiftState(None, "fp32", layers=(), exchange="reduce_scatter")
    state.exchange([("x", x, None)])
    (second,) = state.exchange([("x", torch.randn(4, 16, generator=g), None)])
    return bool(torch.isfinite(second).all()), sorted(state.shard_residuals)


def power_of_two_requantization(values_by_rank):
    """Each rank sends its row of ``values_by_rank`` on the reduce-scatter exchange under
    power-of-two scaling, without error feedback: (result, every rank's local decode)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor(values_by_rank[rank], dtype=torch.float32)
    state = fk.gift.GiftState(None, "e4m3", layers=(), error_feedback=False, exchange="reduce_scatter",
                              scaling="power_of_two")
    (out,) = state.exchange([("g", x, None)])
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, state.last_sent["g"])
    return out, everyone


def hook_on_the_pools_device(seed: int, fmt: str, exchange: str, route: str = "plain"):
    """The hook on the pool's device: CUDA gradients through NCCL (``overlap=False``: the
    communication thread carries no CUDA stream), or the host's through gloo. ``route``
    "plain": every parameter on the plain route; "gift": the first Linear's weight on the
    GIFT route (its whitening computed from the step's own inputs: the covariance
    all-reduced, the factors broadcast). [(hook gradient, DDP's own averaged gradient, the
    codec's round trip of it, through the layer's transform on the GIFT route)] per
    parameter, on the host."""
    device = rank_device()
    on_gpu = device.type == "cuda"
    model = _integer_mlp(seed).to(device)
    twin = copy.deepcopy(model)
    device_ids = [device.index] if on_gpu else None
    hooked = DistributedDataParallel(model, device_ids=device_ids)
    layers = [model[0]] if route == "gift" else ()
    state = fk.gift.GiftState(None, fmt, 4, 1, layers=layers, exchange=exchange, overlap=False)
    hooked.register_comm_hook(state, fk.gift.gift_hook)
    plain = DistributedDataParallel(twin, device_ids=device_ids)
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    x = torch.randint(-3, 4, (8, 16), generator=g).float().to(device)
    target = torch.randint(-2, 3, (8, 8), generator=g).float().to(device)
    for net in (hooked, plain):
        (net(x) * target).sum().backward()
    state.close()
    out = []
    for i, (a, b) in enumerate(zip(model.parameters(), twin.parameters())):
        if route == "gift" and i == 0:
            whitening = state.whitenings[0]
            expected = whitening.invert(_flat_round_trip(whitening.apply(b.grad), fmt, exchange))
        else:
            expected = _flat_round_trip(b.grad, fmt, exchange)
        out.append((a.grad.cpu(), b.grad.cpu(), expected.cpu()))
    return out


def _flat_round_trip(x: torch.Tensor, fmt: str, exchange: str) -> torch.Tensor:
    """``fk.gift.round_trip`` of a tensor as the hook codes it: flattened, and for NVFP4
    zero-padded to whole 16-element blocks (the hook's padding); the identity for fp32.
    NVFP4 on the reduce-scatter: its second quantization re-encodes a decoded -0.0 (a
    negative value that rounded to zero) as Transformer Engine does, code 0, so +0.0."""
    if fmt == "fp32":
        return x.clone()
    flat = x.reshape(1, -1)
    if fmt == "nvfp4":
        flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % 16))
    out = fk.gift.round_trip(flat, fmt)[0, :x.numel()].reshape(x.shape)
    return out + 0.0 if (fmt, exchange) == ("nvfp4", "reduce_scatter") else out
