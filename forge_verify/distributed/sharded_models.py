"""Model-level sharding claims, as rank jobs: a two-layer MLP (column- then
row-parallel) and a small transformer block with sequence parallelism, trained for
several steps under tensor parallelism.

* Under one layout, fused training equals oracle training bitwise (``fused_equals_oracle``).
* Against the unsharded model, the row-parallel forward's reduction over ranks
  reorders sums, with or without FORGE: ``forward_matches_plain_tp`` shows that the
  fused model's forward and input gradient are bitwise plain PyTorch TP's (FORGE
  changes neither, so the deviation they carry is TP's own), and
  ``deviation_from_unsharded(..., integer=True)`` (the MLP) shows that with exactly
  representable data (every sum exact in fp32, in any order) the TP model equals the
  unsharded one bitwise.
* ``deviation_from_unsharded`` measures the weights' distance (ulp) to the unsharded
  model after several steps, fused and plain (materialized gradient, same rule).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import forge_kernels as fk
from forge_kernels.parallel_linear import ColumnParallelForgeLinear, RowParallelForgeLinear
from forge_kernels.tensor_parallel import local_weight, weight_slice

from ..checks.problems import FP32
from ..numerics.bits import assert_bitwise_equal, ulp_distance
from .sharding import chunk, device

MODELS = ("mlp", "block")


class Block(nn.Module):
    """Pre-norm attention + MLP. Heads are inferred from the local width, so a rank
    holding a column shard of q/k/v runs its own heads. Attention is written out
    (not SDPA) so every backend's backward is deterministic."""

    def __init__(self, dim=16, heads=4, hidden=32):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.norm1(x)
        batch, seq = h.shape[:2]
        q, k, v = (w(h).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        a = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.wo(a.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


def _mlp(dims=(12, 20, 8), seed=0, integer=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(dims[0], dims[1], bias=not integer), nn.ReLU(),
                          nn.Linear(dims[1], dims[2], bias=not integer))
    if integer:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-2, 3, p.shape))
    return model.to(device())


def _block(seed=0):
    torch.manual_seed(seed)
    return Block().to(device())


# The sequence-parallel plan of PyTorch's TP tutorial: norms on token shards, q/k/v and
# w1 gather the tokens, wo and w2 reduce-scatter back onto token shards.
_BLOCK_PLAN = {
    "norm1": SequenceParallel(), "norm2": SequenceParallel(),
    "wq": ColwiseParallel(input_layouts=Shard(1)), "wk": ColwiseParallel(input_layouts=Shard(1)),
    "wv": ColwiseParallel(input_layouts=Shard(1)), "wo": RowwiseParallel(output_layouts=Shard(1)),
    "w1": ColwiseParallel(input_layouts=Shard(1)), "w2": RowwiseParallel(output_layouts=Shard(1)),
}


def _parallel(kind, engine, model, rule, **fuse_options):
    """The model under TP (sequence parallel for the block), fused unless rule is None."""
    if engine == "megatron":
        if kind != "mlp" or rule is None:
            raise ValueError("the Megatron-style layers are fused MLP layers here")
        return nn.Sequential(ColumnParallelForgeLinear(model[0], rule, **fuse_options), nn.ReLU(),
                             RowParallelForgeLinear(model[2], rule, **fuse_options))
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()} if kind == "mlp" else _BLOCK_PLAN
    model = parallelize_module(model, mesh, plan)
    return model if rule is None else fk.fuse(model, rule, **fuse_options)


def _batches(kind, steps, seed, integer=False):
    gen = torch.Generator().manual_seed(seed + 1)
    shape_in, shape_out = ((16, 12), (16, 8)) if kind == "mlp" else ((2, 8, 16), (2, 8, 16))
    if integer:
        draw = lambda shape: torch.randint(-2, 3, shape, generator=gen).float()  # noqa: E731
    else:
        draw = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    return [(draw(shape_in).to(device()), draw(shape_out).to(device())) for _ in range(steps)]


def _local_batch(kind, x, target):
    """The block takes and returns token shards (sequence parallelism); the MLP whole tensors."""
    if kind == "block":
        tokens = chunk(x.shape[1], dist.get_world_size(), dist.get_rank())
        return x[:, tokens].contiguous(), target[:, tokens].contiguous()
    return x, target


def _loss(out, target, total):
    # A sum over this rank's outputs, scaled by the global count: with token shards the
    # ranks' losses add up to the global mean, and each rank's backward is its share.
    return (out - target).square().sum() / total


def _train_step(kind, model, x, target, x_requires_grad=False):
    x, target = _local_batch(kind, x, target)
    x = x.clone().requires_grad_(x_requires_grad)
    out = model(x)
    out = out.to_local() if isinstance(out, DTensor) else out
    _loss(out, target, target.numel() if kind == "mlp" else target.numel() * dist.get_world_size()).backward()
    return out.detach(), x.grad


def _linears(model):
    """name -> the module holding a weight that TP shards, in a fixed order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _local_state(model):
    """name -> this rank's weight shard and state (fused layers), as CPU copies."""
    return {name: {"weight": local_weight(m.weight.detach()).cpu().clone(),
                   **{k: v.cpu().clone() for k, v in m.forge_state.items()}}
            for name, m in _linears(model).items()}


def fused_equals_oracle(kind, engine, rules, steps=3, seed=0, regime=FP32):
    """Job: under one TP layout, fused and oracle training give the same weights and
    state bitwise after every step. In a bf16-weight regime the whole model (hence its
    activations) is bf16."""
    options = dict(state_format=regime.state_format, rounding=regime.rounding, seed=regime.seed)
    for rule in rules:
        models = [(_mlp(seed=seed) if kind == "mlp" else _block(seed)).to(regime.weight) for _ in range(2)]
        fused = _parallel(kind, engine, models[0], rule, **options)
        oracle = _parallel(kind, engine, models[1], rule, oracle=True, **options)
        for step, (x, target) in enumerate(_batches(kind, steps, seed), start=1):
            x, target = x.to(regime.weight), target.to(regime.weight)
            _train_step(kind, fused, x, target)
            _train_step(kind, oracle, x, target)
            a, b = _local_state(fused), _local_state(oracle)
            for name in a:
                for key in a[name]:
                    assert_bitwise_equal(a[name][key], b[name][key],
                                         f"rank {dist.get_rank()}, {kind} {engine}, step {step}, {rule!r}, "
                                         f"{regime.describe()}: {name}.{key}")


def forward_matches_plain_tp(kind, rule, seed=0):
    """Job: at the first step (equal weights) the fused TP model's output and input
    gradient are bitwise those of the same model under plain PyTorch TP."""
    make = (lambda: _mlp(seed=seed)) if kind == "mlp" else (lambda: _block(seed))
    fused = _parallel(kind, "dtensor", make(), rule)
    plain = _parallel(kind, "dtensor", make(), None)
    (x, target), = _batches(kind, 1, seed)
    out_f, dx_f = _train_step(kind, fused, x, target, x_requires_grad=True)
    out_p, dx_p = _train_step(kind, plain, x, target, x_requires_grad=True)
    assert_bitwise_equal(out_f, out_p, f"rank {dist.get_rank()}, {kind}: output")
    assert_bitwise_equal(dx_f, dx_p, f"rank {dist.get_rank()}, {kind}: input gradient")


def _plain_steps(model, rule, states, step, sharded):
    """One step of ``rule`` on each Linear's materialized gradient (the standard pipeline)."""
    for name, m in _linears(model).items():
        grad = m.weight.grad
        place = weight_slice(m.weight) if sharded else None
        if sharded:
            grad = grad.redistribute(placements=m.weight.placements).to_local()
        with torch.no_grad():
            fk.apply_rule(grad.contiguous(), local_weight(m.weight.data), states[name], rule, step,
                          weight_slice=place)
        m.weight.grad = None


def deviation_from_unsharded(kind, rule, steps=3, seed=0, integer=False):
    """Job: after each step, the largest ulp distance between this rank's weight shards
    and the matching slice of the unsharded model's, trained fused and trained plain
    (autograd's materialized gradient, then the same rule by ``fk.apply_rule``).
    Returns {"fused": [max ulp per step], "plain": [...]}. ``integer=True`` (MLP only)
    draws exactly representable data."""
    if integer and kind != "mlp":
        raise ValueError("integer (exactly representable) data is drawn for the MLP only")
    make = (lambda: _mlp(seed=seed, integer=integer)) if kind == "mlp" else (lambda: _block(seed))
    runs = {}
    for path in ("fused", "plain"):
        tp = _parallel(kind, "dtensor", make(), rule if path == "fused" else None)
        whole = make() if path == "plain" else fk.fuse(make(), rule)
        whole_linears = _linears(whole)
        if path == "plain":  # the fused layers keep their own state
            states = {"tp": {n: rule.init_state(local_weight(m.weight.detach())) for n, m in _linears(tp).items()},
                      "whole": {n: rule.init_state(m.weight.detach()) for n, m in whole_linears.items()}}
        distances = []
        for step, (x, target) in enumerate(_batches(kind, steps, seed, integer), start=1):
            _train_step(kind, tp, x, target)
            out = whole(x)
            _loss(out, target, target.numel()).backward()
            if path == "plain":
                _plain_steps(tp, rule, states["tp"], step, sharded=True)
                _plain_steps(whole, rule, states["whole"], step, sharded=False)
            worst = 0
            for name, m in _linears(tp).items():
                place = weight_slice(m.weight)
                local = local_weight(m.weight.detach())
                n, k = local.shape
                expected = whole_linears[name].weight.detach()[place.row_start:place.row_start + n,
                                                                 place.col_start:place.col_start + k]
                worst = max(worst, int(ulp_distance(local.cpu(), expected.cpu()).max()))
            distances.append(worst)
        runs[path] = distances
    return runs
