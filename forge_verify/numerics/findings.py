"""Findings about the kernels measured on each backend, kept as data so that a
property asserts them and a change of behaviour fails loudly.

BLOCK_T_CHANGES_BITS[(backend, activation dtype)]: whether two configs that differ
only in BLOCK_T give different gradient bits on a 512-token problem
(properties/test_tile_invariance.py::test_block_t_finding). Where it is True, only
configs with equal BLOCK_T are exactness-equivalent; BLOCK_N and BLOCK_K never
matter (test_exactness_equivalent_configs_give_same_bits).
"""

import torch

BLOCK_T_CHANGES_BITS = {
    # The interpreter's tile loop sums each token block on its own, in token order,
    # and adds the block's sum to the accumulator (proofs/interpreter_reduction.md):
    # the block size sets the grouping of the sum, nothing else does (no BLAS).
    ("interpreter", torch.float32): True,
    ("interpreter", torch.bfloat16): True,
    # Compiled (H200, triton 3.6): the accumulator threaded through tl.dot is updated
    # in token order by FMAs (fp32, "ieee") or by k=16 MMA steps (bf16) whatever the
    # block, so BLOCK_T does not change the bits. Measured, not guaranteed by Triton.
    ("gpu", torch.float32): False,
    ("gpu", torch.bfloat16): False,
}
