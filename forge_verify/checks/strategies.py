"""Hypothesis strategies, all in one place.

Tile sizes come from small power-of-two sets so that GPU compiles stay bounded;
problem sizes mix random values with edges (1, one less and one more than a tile,
+17-style misalignment) so ragged tiles are always exercised.
"""

import dataclasses

import torch
from hypothesis import strategies as st

import forge_kernels as fk
from forge_kernels.config import OPERAND_LOADS
from forge_kernels.ops.hopper_support import TMA_ALIGNMENT, tma_available

from .catalog import CATALOG
from .problems import Problem, Regime

TILE_SIZES = (16, 32, 64)
EDGE_SIZES = (1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 81)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def tile_configs(block_t=None):
    """Tile configs, with every epilogue split, in column or row slices, their block_k or
    block_n allows; pass ``block_t`` to pin the token block."""
    configs = st.builds(fk.TileConfig,
                        block_n=st.sampled_from(TILE_SIZES),
                        block_k=st.sampled_from(TILE_SIZES),
                        block_t=st.just(block_t) if block_t is not None else st.sampled_from(TILE_SIZES))
    return configs.flatmap(lambda config: st.sampled_from(
        [(axis, split) for axis, sliced in (("columns", config.block_k), ("rows", config.block_n))
         for split in (1, 2, 4) if sliced // split >= TILE_SIZES[0]]).map(
        lambda slices: dataclasses.replace(config, epilogue_axis=slices[0], epilogue_split=slices[1])))


def sizes(max_size=81):
    return st.one_of(st.sampled_from([s for s in EDGE_SIZES if s <= max_size]), st.integers(1, max_size))


# Features in multiples of this: rows of bf16 (and so fp32) activations a multiple of the
# TMA alignment apart, which TMA operand loads (TileConfig.operand_loads="tma") need.
TMA_FEATURE_UNIT = TMA_ALIGNMENT // (torch.finfo(torch.bfloat16).bits // 8)


def feature_sizes(max_size=81, unit=1):
    """Feature counts; with ``unit`` > 1, multiples of it (still ragged against every tile)."""
    if unit == 1:
        return sizes(max_size)
    return st.integers(1, max_size // unit).map(lambda v: v * unit)


def operand_loads():
    """How the portable kernel reads its operands: TMA where this backend has it (the
    interpreter, sm_90 and later GPUs), else pointers alone."""
    return st.sampled_from(OPERAND_LOADS) if tma_available() else st.just("pointers")


def problems(max_tokens=96, max_features=81, max_steps=3, dtypes=ACTIVATION_DTYPES, allow_no_tokens=True,
             feature_unit=1):
    tokens = sizes(max_tokens)
    if allow_no_tokens:
        tokens = st.one_of(st.just(0), tokens)
    return st.builds(Problem, tokens=tokens, out_features=feature_sizes(max_features, feature_unit),
                     in_features=feature_sizes(max_features, feature_unit), dtype=st.sampled_from(dtypes),
                     steps=st.integers(1, max_steps), seed=st.integers(0, 2**31 - 1),
                     scale=st.sampled_from((1e-3, 1.0, 30.0)), sparse=st.booleans())


def regimes():
    """Storage regimes: fp32 or bf16 weight, fp32, bf16 or q8 state, stochastic or nearest bf16 stores."""
    return st.builds(Regime, weight=st.sampled_from((torch.float32, torch.bfloat16)),
                     state_format=st.sampled_from(("fp32", "bf16", "q8")),
                     rounding=st.sampled_from(("stochastic", "nearest")), seed=st.integers(0, 2**63 - 1))


def fit_config(config, regime):
    """``config``, widened to whole q8 blocks per epilogue slice where the regime keeps q8 state."""
    if regime.state_format == "q8" and config.part_shape[1] < fk.q8.BLOCK:
        slices = 1 if config.epilogue_axis == "rows" else config.epilogue_split
        return dataclasses.replace(config, block_k=max(config.block_k, fk.q8.BLOCK * slices))
    return config


RULES = {entry.name: entry.strategy for entry in CATALOG}
"""One strategy per rule family, keyed by the family's name."""


@st.composite
def sharded_problems(draw, world_size, *, max_steps=3, dtypes=ACTIVATION_DTYPES, q8_state=False):
    """Problems every layout can shard over ``world_size`` ranks: tokens a multiple of the
    ranks (sequence parallelism splits them evenly, as Megatron requires), input features
    a multiple too (PyTorch's row-wise input hook assumes even shards), and with q8 state
    whole q8 blocks per rank. Output features any size >= the ranks (uneven row shards)."""
    feature_unit = world_size * (fk.q8.BLOCK if q8_state else 1)
    return Problem(tokens=world_size * draw(st.integers(1, 12)),
                   out_features=draw(st.integers(world_size, 40)),
                   in_features=feature_unit * draw(st.integers(1, max(1, 40 // feature_unit))),
                   dtype=draw(st.sampled_from(dtypes)), steps=draw(st.integers(1, max_steps)),
                   seed=draw(st.integers(0, 2**31 - 1)), scale=draw(st.sampled_from((1e-3, 1.0, 30.0))),
                   sparse=draw(st.booleans()))
