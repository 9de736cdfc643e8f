"""FP8 E4M3 (``torch.float8_e4m3fn``) on the wire, per-tensor current scaling.

1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN at 0x7F and 0xFF;
largest finite 448, smallest subnormal 2**-9. Encoding saturates out-of-range values at
448 (explicitly: torch's cast saturates on the CPU but gave NaN on an H200), which is
also why input is checked finite first (+inf would become 448). Encoding and decoding: ``_fp8.py``.
"""

import torch

from ._fp8 import PerTensorFP8, QuantizedFP8

FORMAT = PerTensorFP8("e4m3", torch.float8_e4m3fn, 448.0)
MAX = FORMAT.max
tensor_amax, scale_for, values = FORMAT.tensor_amax, FORMAT.scale_for, FORMAT.values
encode, decode = FORMAT.encode, FORMAT.decode
quantize, dequantize, round_trip = FORMAT.quantize, FORMAT.dequantize, FORMAT.round_trip

__all__ = ["FORMAT", "MAX", "QuantizedFP8", "tensor_amax", "scale_for", "encode", "decode", "values",
           "quantize", "dequantize", "round_trip"]
