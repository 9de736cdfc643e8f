"""The fused update on Hopper (sm_90): the portable kernel's function, bit for bit, as a
persistent, warp-specialized Gluon kernel (``TileConfig(kernel="hopper")``), in one of two
structures, picked by ``num_warps``:

- 4: the ping-pong kernel (``hopper_pingpong``): two consumer warpgroups take alternate
  tiles, each running its tile's token loop and then its epilogue, so that one's epilogue
  overlaps the other's token loop;
- 8 or 16: the split kernel (``hopper_split``): a matrix warpgroup per 64 rows of the
  tile (one or two) runs every tile's token loop into gradient slots in shared memory
  (two, or one for a 128 x 128 tile), and eight or sixteen epilogue warps apply the rule.

The portable kernel (``fused_weight_update``) runs each tile's token loop and then its
epilogue in the same warps, so the tensor cores idle during the epilogue and HBM during
the loop, and its weight and state loads wait in registers. Here TMA warps copy the next
dy and x blocks into a ring and the next weight and state parts into staging slots while
the previous tile is still being worked on; the epilogue reads them from shared memory and
writes the results with plain stores, one part of the tile at a time with
``epilogue_split`` > 1 (the portable kernel's split: the same bits, the same flags): a
column part, or in the split kernel a row part (``epilogue_axis="rows"``), whose rows the
TMA copies read and the stores write in runs of the tile's full width.

Same function, same bits: the token loop is the same wgmma instructions over the same
``block_t``-token blocks in the same order as the portable kernel's ``tl.dot`` (bf16
operands, fp32 accumulator); the epilogue calls the same rule, rounding and verdict code
(``RULE``, ``_to_storage``, ``_storable``, ``is_finite``) with the same Philox words (``_words`` is the
portable ``paired_words``). Measured on an H200, fused == portable for every rule, regime
and shape in ``tests/test_hopper_update.py``, in both structures. Written against triton
3.6's Gluon (the GPU runs so far), it also compiles with 3.9's, which renamed two of the
operations it uses (``tests/test_sass_count.py`` builds it for sm_90 offline in CI); this
module is imported only when a hopper config is launched on a GPU.
"""

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.errors import OutOfResources

from .hopper_pingpong import pingpong_kernel
from .hopper_split import split_kernel


def kernel_for(config):
    """The Gluon kernel that runs ``config``: the split kernel for 8 or 16 (epilogue) warps, else ping-pong."""
    return split_kernel if config.num_warps in (8, 16) else pingpong_kernel


def structure_constants(config) -> dict:
    """The compile-time arguments of ``kernel_for(config)`` that only its structure takes:
    the split kernel's staging slots, whether its token loop keeps a wgmma in flight and
    whether it checks its inputs itself."""
    if kernel_for(config) is split_kernel:
        return dict(EPILOGUE_STAGES=config.staging_slots, IN_FLIGHT=config.wgmma_in_flight,
                    IN_KERNEL_CHECK=config.in_kernel_check)
    return {}


def structure_arguments(config, x, dy, tickets) -> dict:
    """The run-time arguments only the split kernel takes: the inputs its in-kernel check
    reads (``in_kernel_check``; unused otherwise) and the counter its programs meet at."""
    if kernel_for(config) is split_kernel:
        return dict(x_ptr=x, dy_ptr=dy, stride_xt=x.stride(0), stride_dt=dy.stride(0), tickets_ptr=tickets)
    return {}


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The shared-memory layouts are immutable and depend on the block and element type only:
# made once, not on every launch (their construction took about a sixth of the launch's
# host time under cProfile: results/tuning/h200-hopper-host-profile.log).
@functools.lru_cache(maxsize=None)
def _operand_layout(block: tuple, bf16: bool):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.float32)


@functools.lru_cache(maxsize=None)
def _tile_layout(element_bits: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bits, rank=2)


def _operand_descriptor(t, block):
    """dy and x blocks: the swizzled layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, block, _operand_layout(tuple(block), t.dtype == torch.bfloat16))


def _tile_descriptor(t, block):
    """Weight and state tiles: unswizzled, read row by row by the epilogue."""
    return TensorDescriptor.from_tensor(t, block, _tile_layout(t.element_size() * 8))


def descriptors(config, x, dy, weight, slot_tensors):
    """The kernel's six TMA descriptors for ``config``: dy and x blocks of ``block_t``
    tokens, and one part (``TileConfig.part_shape``: a column or row slice) of the weight's
    and each slot's tile."""
    part = list(config.part_shape)
    return ([_operand_descriptor(dy, [config.block_t, config.block_n]),
             _operand_descriptor(x, [config.block_t, config.block_k])]
            + [_tile_descriptor(t, part) for t in [weight] + slot_tensors])


def launch(epilogue, x, dy, weight, square_sums=None):
    """Launch the Hopper kernel for an ``_Epilogue`` (arguments checked by
    ``hopper_support.check_hopper_launch``), keeping each tile's Σ dW² in ``square_sums``
    when given; returns the compiled kernel's handle."""
    config = epilogue.config
    T, K = x.shape
    N = weight.shape[0]
    if T == 0:  # a TMA descriptor needs a nonempty tensor; the token loop reads none of it
        x = x.new_zeros((1, K))
        dy = dy.new_zeros((1, N))
    tiles = epilogue.grid[0] * epilogue.grid[1]
    grid = (min(tiles, _multiprocessors(weight.device.index if weight.device.index is not None
                                        else torch.cuda.current_device())),)
    args = epilogue.rule_args
    try:
        return kernel_for(config)[grid](
            *descriptors(config, x, dy, weight, epilogue.slot_tensors), weight, *epilogue.slot_tensors,
            epilogue.flags, epilogue.status, T, N, K, *epilogue.place,
            epilogue.grad_scale, *epilogue.scalars, epilogue.seed, *epilogue.device_scalars, epilogue.grad_scale_ptr,
            weight if square_sums is None else square_sums,  # an unused pointer without sums
            RULE=args["RULE"], VARIANT=args["VARIANT"], HAS_S0=args["HAS_S0"], HAS_S1=args["HAS_S1"],
            HAS_S2=args["HAS_S2"], W_BF16=args["W_BF16"], S_BF16=args["S_BF16"], STOCHASTIC=args["STOCHASTIC"],
            ALIGNED=args["ALIGNED_PAIRS"], DEVICE_SCALARS=args["DEVICE_SCALARS"],
            DEVICE_GRAD_SCALE=args["DEVICE_GRAD_SCALE"], NUM_STAGES=config.num_stages,
            SQUARE_SUMS=square_sums is not None, **structure_arguments(config, x, dy, epilogue.tickets),
            **structure_constants(config), num_warps=config.num_warps, enable_fp_fusion=False,
            # The in-kernel check waits for every program: they must all be resident at once.
            **(dict(launch_cooperative_grid=True) if config.in_kernel_check else {}))
    except OutOfResources as error:  # raised when compiling, before the kernel runs: nothing was written
        staged = (f"{config.staging_slots} slots" if kernel_for(config) is split_kernel
                  else "one slot per consumer, two for a tile of several parts")
        raise ValueError(f"{config} stages its token blocks, weight and state parts ({staged}) and its gradient "
                         f"tiles (two slots in the split kernel, one of a 128 x 128 tile; one per consumer for a "
                         f"tile of several parts in the ping-pong kernel) in shared memory, and with "
                         f"{len([t for t in epilogue.slot_tensors if t is not weight])} state slots of "
                         f"{epilogue.state_format} beside a {weight.dtype} weight they do not fit ({error}); use "
                         "a narrower tile or part, shorter token blocks, fewer stages or fewer epilogue_stages"
                         ) from error
