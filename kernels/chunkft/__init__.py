"""ChunkFT: full-parameter fine-tuning over a rotating working set of sub-tensors."""

from .controller import ChunkFT, tensor_seed
from .plan import Slice, plan_chunks, tensor_costs

__all__ = ["ChunkFT", "Slice", "plan_chunks", "tensor_costs", "tensor_seed"]
