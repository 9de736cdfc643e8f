"""Per-tensor FP8 with current scaling, the shared body of ``e4m3.py`` and ``e5m2.py``.

Encoding: ``scale = min(fl(format_max / amax), FLT_MAX)`` in fp32 (1 when the tensor is
all zeros), then ``code = bits(cast_fp8(fl32(x * scale)))``: the product rounds once to
fp32 and torch's cast rounds it to nearest, ties to even. That double rounding is the
definition (it is what Transformer Engine's current-scaling recipe computes, with the
same FLT_MAX clamp in its ``compute_scale_from_amax``); the straight reference in
``forge_verify/numerics/gift_formats.py`` rounds the same fp32 product on its own code
grid. ``|x * scale| <= format_max`` up to one fp32 rounding of the scale, which both
formats map to the largest finite code, so no code is inf or NaN. The clamp matters for
amax below ``format_max / FLT_MAX`` (about 1.3e-36 for E4M3): the quotient would overflow
to inf and an element 0 would encode as 0 · inf = NaN (an error-feedback residual decays
there when a layer's gradient stays zero); clamped, ``|x * scale| <= amax * FLT_MAX``,
which is below ``format_max``.

Out of range (a caller's shared scale too large): E4M3, which has no infinity,
saturates to +-448; E5M2 overflows to +-inf from 61440, the midpoint above its largest
finite value, as round-to-nearest does. Both are applied here, before the cast, because
torch's own cast differs by device: on an H200 (torch 2.11, CUDA) casting 1e6 to E4M3
gave NaN, where the CPU build saturates.

Decoding: ``fl32(value / scale)``, one correctly rounded division.

Non-finite input is refused before any cast: E4M3's cast would turn +inf into 448 and
NaN into NaN codes silently.
"""

from dataclasses import dataclass

import torch

from ..errors import NonFiniteInputError

FLT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class QuantizedFP8:
    """``codes`` (uint8, the input's shape) and the fp32 ``scale`` (0-d) they were made with."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str


@dataclass(frozen=True)
class PerTensorFP8:
    """``overflow_from``: the magnitude from which a value becomes an infinity (a format
    that has one); None: the format saturates at ``max``."""

    name: str
    dtype: torch.dtype
    max: float
    overflow_from: float | None = None

    def refuse_non_finite(self, x: torch.Tensor) -> None:
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteInputError(f"{self.name}: the tensor holds a NaN or an infinity; nothing was encoded")

    def tensor_amax(self, x: torch.Tensor) -> torch.Tensor:
        """max |x| in fp32 (0-d); refuses non-finite input."""
        self.refuse_non_finite(x)
        return x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)

    def scale_for(self, amax: torch.Tensor, power_of_two: bool = False) -> torch.Tensor:
        """``min(format_max / amax, FLT_MAX)`` in fp32; 1 for amax 0 (an all-zero tensor
        encodes to zeros). ``power_of_two``: rounded down to a power of two, so that decoding
        divides exactly (the largest value may then use only half the range)."""
        amax = torch.as_tensor(amax, dtype=torch.float32)
        if not bool(torch.isfinite(amax)) or float(amax) < 0:
            raise NonFiniteInputError(f"{self.name}: amax {float(amax)} is not a finite magnitude")
        if float(amax) == 0.0:
            return torch.ones((), dtype=torch.float32, device=amax.device)
        scale = torch.clamp(torch.tensor(self.max, dtype=torch.float32, device=amax.device) / amax, max=FLT_MAX)
        if power_of_two:
            _, exponent = torch.frexp(scale)  # scale = m · 2**exponent, m in [0.5, 1)
            scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=amax.device), exponent - 1)
        return scale

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``x`` under ``scale`` (shared scales: the caller agreed it)."""
        self.refuse_non_finite(x)
        scaled = x.to(torch.float32) * scale
        if self.overflow_from is None:
            scaled = scaled.clamp(-self.max, self.max)
        else:
            scaled = torch.where(scaled.abs() >= self.overflow_from, scaled.sign() * torch.inf, scaled)
        return scaled.to(self.dtype).view(torch.uint8)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """The fp32 values the codes stand for, before unscaling (exact)."""
        return codes.view(self.dtype).to(torch.float32)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.values(codes) / scale

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> QuantizedFP8:
        """Codes and scale; ``scale`` defaults to this tensor's own current scale."""
        if scale is None:
            scale = self.scale_for(self.tensor_amax(x))
        return QuantizedFP8(self.encode(x, scale), scale, self.name)

    def dequantize(self, q: QuantizedFP8) -> torch.Tensor:
        return self.decode(q.codes, q.scale)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(x))
