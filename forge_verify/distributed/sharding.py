"""The sharding claims, as jobs that run on every rank of a ``RankPool``.

Each job builds the same seeded problem on every rank, runs the sharded layer (PyTorch
tensor parallelism on DTensors, or the Megatron-style explicit-collective layers) and
the unsharded one. ``layers_match_slice`` raises AssertionError on a rank whose shard
differs bitwise from the matching slice of the unsharded result;
``per_shard_config_changes_bits`` returns whether a config keyed on the shard's shape
changed the shard's bits.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import forge_kernels as fk
from forge_kernels.ops.stochastic_round import stream_seed
from forge_kernels.parallel_linear import ColumnParallelForgeLinear, RowParallelForgeLinear
from forge_kernels.tensor_parallel import local_weight

from ..checks.problems import FP32, Problem, Regime, make_inputs
from ..numerics.bits import assert_bitwise_equal, first_difference

#: how the layer is sharded: weight rows (column-parallel) or columns (row-parallel),
#: with or without sequence parallelism (activations sharded on tokens between layers)
LAYOUTS = ("column", "row", "column_sp", "row_sp")
#: who implements it: PyTorch's parallelize_module on DTensors, or explicit collectives
ENGINES = ("dtensor", "megatron")


SHARDINGS = tuple((engine, layout) for engine in ENGINES for layout in LAYOUTS)


@dataclass(frozen=True)
class LayerCase:
    """One layer problem: the same on every rank."""

    problem: Problem
    regime: Regime = FP32
    config: fk.TileConfig | None = None

    def describe(self) -> str:
        return f"[{self.problem.describe()}; {self.regime.describe()}; {self.config}]"


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def chunk(size: int, world: int, rank: int) -> slice:
    """Rank ``rank``'s part of ``size`` as torch.chunk (and DTensor's Shard) splits it,
    taken from torch.chunk itself: the expected slice must not come from the library's
    own arithmetic (``weight_slice.chunk_bounds``), which it checks."""
    parts = torch.arange(size).chunk(world) if size else ()
    if rank >= len(parts):  # torch.chunk gives fewer parts than ranks when size is small
        return slice(size, size)
    return slice(int(parts[rank][0]), int(parts[rank][-1]) + 1)


def _linear(weight):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def _fuse_options(regime, config, seed):
    return dict(config=config, state_format=regime.state_format, rounding=regime.rounding, seed=seed)


def _sharded_layer(case: LayerCase, engine, layout, rule, weight, layer_seed):
    """(module, operands, rows, cols) for this rank: ``operands(x, dy)`` gives the
    module's input and output gradient for the unsharded layer's (x, dy); ``rows`` and
    ``cols`` the slice of the whole weight its shard must equal (from the layout, not
    from the layer under test)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    options = _fuse_options(case.regime, case.config, layer_seed)
    column = layout.startswith("column")
    sequence_parallel = layout.endswith("_sp")
    if engine == "dtensor":
        mesh = init_device_mesh(device().type, (world,))
        if column:
            style = ColwiseParallel(input_layouts=Shard(0)) if sequence_parallel else ColwiseParallel()
        else:
            style = RowwiseParallel(output_layouts=Shard(0)) if sequence_parallel else RowwiseParallel()
        # fuse seeds its first layer with stream_seed(seed, 1, 0): the reference layer's seed.
        model = parallelize_module(nn.Sequential(_linear(weight)), mesh, {"0": style})
        fk.fuse(model, rule, **{**options, "seed": case.regime.seed})
        module = model
    elif engine == "megatron":
        parallel = ColumnParallelForgeLinear if column else RowParallelForgeLinear
        module = parallel(_linear(weight), rule, sequence_parallel=sequence_parallel, **options)
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    rows, cols = _shard_slices(weight.shape, column, world, rank)

    def operands(x, dy):
        tokens = chunk(x.shape[0], world, rank)
        if column:
            return (x[tokens] if sequence_parallel else x), dy[:, rows].contiguous()
        return x[:, cols].contiguous(), (dy[tokens] if sequence_parallel else dy)

    return module, operands, rows, cols


def _fused_layer(module) -> fk.ForgeLinear:
    return next(m for m in module.modules() if isinstance(m, fk.ForgeLinear))


def expected_slices(whole: dict, rows: slice, cols: slice) -> dict:
    """The part of each of the whole layer's tensors (weight and state) a shard holding
    weight[rows, cols] must equal."""
    columns = range(whole["weight"].shape[1])[cols]
    # q8 exponents: one per block of q8.BLOCK columns (shards hold whole blocks)
    blocks = slice(columns.start // fk.q8.BLOCK, -(-columns.stop // fk.q8.BLOCK))
    return {key: value[rows, blocks if key.endswith(fk.q8.EXPONENT_SUFFIX) else cols]
            for key, value in whole.items()}


def _snapshot(layer: fk.ForgeLinear) -> dict:
    return {"weight": local_weight(layer.weight.detach()).cpu().clone(),
            **{k: v.cpu().clone() for k, v in layer.forge_state.items()}}


def train_step(module, x, dy, weight_dtype):
    """One forward and backward of ``module`` on (x, dy) as a training step feeds a layer
    of ``weight_dtype``: a fused layer, like nn.Linear, takes activations of its weight's
    dtype, or bf16 activations into fp32 weights under autocast (which then computes the
    forward exactly as the layer's own cast would). fp32 activations into bf16 weights are
    cast to bf16 first, as a user must."""
    if x.dtype == torch.bfloat16 and weight_dtype == torch.float32:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = module(x)
    else:
        y = module(x.to(weight_dtype))
    y.backward(dy.to(y.dtype))


def sharded_steps(case: LayerCase, rule, shardings=SHARDINGS, *, allow_refusal=False):
    """Step the unsharded fused layer and each (engine, layout) sharded one on the same
    (x, dy) per step; yields ``(engine, layout, step, local, expected)`` after every step,
    ``local`` the shard's weight and state and ``expected`` the matching slices of the
    unsharded layer's (``sharding.expected_slices``). With ``allow_refusal`` a layout the
    library refuses for this regime (a ValueError at construction, alike on every rank)
    yields once with ``local = expected = None`` instead of raising. Every rank runs every
    step of every layout, so no rank leaves its peers waiting in a collective."""
    world = dist.get_world_size()
    if any(layout.endswith("_sp") for _, layout in shardings) and case.problem.tokens % world:
        raise ValueError(f"sequence parallelism needs the {case.problem.tokens} tokens divisible by {world} ranks")
    inputs = make_inputs(case.problem, device(), case.regime)
    weight = inputs.weight
    layer_seed = stream_seed(case.regime.seed, 1, 0)
    whole = fk.ForgeLinear.from_linear(_linear(weight), rule, **_fuse_options(case.regime, case.config, layer_seed))
    sharded = []
    for engine, layout in shardings:
        try:
            sharded.append((engine, layout, *_sharded_layer(case, engine, layout, rule, weight, layer_seed)))
        except ValueError:
            if not allow_refusal:
                raise
            yield engine, layout, 0, None, None
    for step, (x, dy) in enumerate(inputs.batches, start=1):
        train_step(whole, x, dy, weight.dtype)
        whole_now = _snapshot(whole)
        for engine, layout, module, operands, rows, cols in sharded:
            train_step(module, *operands(x, dy), weight.dtype)
            yield engine, layout, step, _snapshot(_fused_layer(module)), expected_slices(whole_now, rows, cols)


def layers_match_slice(case: LayerCase, rules: list, shardings=SHARDINGS) -> None:
    """Job: for each rule and each (engine, layout), the sharded layer's local weight and
    state after every step equal the matching slice of the unsharded fused layer's,
    bitwise. The layers all see the same (x, dy) per step."""
    for rule in rules:
        for engine, layout, step, local, expected in sharded_steps(case, rule, shardings):
            what = (f"rank {dist.get_rank()} of {dist.get_world_size()}, {engine} {layout}, step {step}, "
                    f"{rule!r}, {case.describe()}")
            if set(local) != set(expected):
                raise AssertionError(f"{what}: state entries {sorted(local)} != {sorted(expected)}")
            for key in sorted(expected):
                assert_bitwise_equal(local[key], expected[key], f"{what}: {key}")


def shape_keyed_config(rows: int, cols: int) -> fk.TileConfig:
    """A config chosen from the weight's shape, as a shape-keyed autotuner might: a
    longer token block for larger weights. The library never does this (it pins one
    config); the shard-shape property uses it to show what it would break."""
    return fk.TileConfig(block_t=64 if rows * cols >= 1024 else 16)


def _shard_slices(shape, column: bool, world: int, rank: int):
    """(rows, cols) of this rank's shard of a weight: its chunk of rows (column-parallel)
    or of columns (row-parallel)."""
    if column:
        return chunk(shape[0], world, rank), slice(None)
    return slice(None), chunk(shape[1], world, rank)


def per_shard_config_changes_bits(problem: Problem, rule, layout: str) -> bool:
    """Job: does a column- or row-parallel shard stepped with ``shape_keyed_config`` of
    its own (local) shape differ from the slice of the whole weight stepped with the
    config of the whole shape? (False where the backend's BLOCK_T does not change bits.)"""
    inputs = make_inputs(problem, device())
    weight, batches = inputs.weight, inputs.batches
    whole = fk.ForgeLinear.from_linear(_linear(weight), rule, config=shape_keyed_config(*weight.shape))
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, cols = _shard_slices(weight.shape, layout == "column", world, rank)
    local_shape = weight[rows, cols].shape
    parallel = ColumnParallelForgeLinear if layout == "column" else RowParallelForgeLinear
    module = parallel(_linear(weight), rule, config=shape_keyed_config(*local_shape))
    for x, dy in batches:
        train_step(whole, x, dy, weight.dtype)
        train_step(module, x[:, cols].contiguous(), dy[:, rows].contiguous(), weight.dtype)
    expected, local = _snapshot(whole)["weight"][rows, cols], _snapshot(module.linear)["weight"]
    return first_difference(local, expected) is not None
