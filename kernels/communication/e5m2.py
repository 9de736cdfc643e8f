"""FP8 E5M2 (``torch.float8_e5m2``) on the wire, per-tensor current scaling.

1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: ±inf at 0x7C/0xFC, six NaN
codes; largest finite 57344, smallest subnormal 2**-16. The cast rounds to nearest and
overflows to inf from 61440; current scaling keeps |x * scale| at most one fp32 rounding
above 57344, which rounds back to 57344. Encoding and decoding: ``_fp8.py``.
"""

import torch

from ._fp8 import PerTensorFP8, QuantizedFP8

FORMAT = PerTensorFP8("e5m2", torch.float8_e5m2, 57344.0, overflow_from=61440.0)
MAX = FORMAT.max
tensor_amax, scale_for, values = FORMAT.tensor_amax, FORMAT.scale_for, FORMAT.values
encode, decode = FORMAT.encode, FORMAT.decode
quantize, dequantize, round_trip = FORMAT.quantize, FORMAT.dequantize, FORMAT.round_trip

__all__ = ["FORMAT", "MAX", "QuantizedFP8", "tensor_amax", "scale_for", "encode", "decode", "values",
           "quantize", "dequantize", "round_trip"]
