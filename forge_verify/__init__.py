"""forge_verify: the harness that checks forge_kernels' numerical claims.

References (fp64 torch, rigorous fp64 interval enclosures), bitwise comparison,
ulp distances, the tolerance table, hypothesis strategies and the ``forge-verify``
command. It may import forge_kernels; forge_kernels never imports it.
"""

from .numerics.bits import assert_bitwise_equal, ordered_bits, ulp_distance

__all__ = ["assert_bitwise_equal", "ordered_bits", "ulp_distance"]
