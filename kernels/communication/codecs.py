"""The wire codecs of GIFT's hook (``hook.py``): per format, how a tensor becomes a uint8
payload under an agreed amax, what each payload's values are before unscaling, and how
many bytes it takes. ``CODECS`` maps (format, scaling) to one.

FP8: one shared scale (format max / agreed amax), payload = the codes. NVFP4: the
flattened tensor in blocks of 16, payload = packed codes then E4M3 block scales.
"fp32": the identity codec, the fp32 bytes themselves, for checking the path.

For the reduce-scatter exchange a payload is also seen as rows of *units*, the smallest
pieces that decode on their own: ``unit`` elements in ``unit_bytes`` bytes (FP8: one
element, one byte; NVFP4: one block of 16, its 8 code bytes then its scale byte; fp32:
one element, four bytes). ``units`` turns a payload into those rows, ``unit_values``
decodes rows (before unscaling), ``context_for`` is the unscaling context of an agreed
amax. Zero bytes decode to zero in every codec, so rows of zeros pad a bucket.
"""

from dataclasses import dataclass

import torch

from . import e4m3, e5m2, nvfp4


@dataclass(frozen=True)
class _FP8Codec:
    fmt: object
    power_of_two: bool = False

    def amax(self, y):
        return self.fmt.tensor_amax(y)

    def encode(self, y, amax):
        """(uint8 payload, the locally decoded tensor, the unscaling context)."""
        scale = self.fmt.scale_for(amax, self.power_of_two)
        codes = self.fmt.encode(y, scale)
        return codes.reshape(-1), self.fmt.decode(codes, scale), scale

    def payload_bytes(self, numel):
        return numel

    def values(self, payload, numel):
        return self.fmt.values(payload)

    def unscale(self, total, scale):
        return total / scale

    unit, unit_bytes = 1, 1

    def context_for(self, amax):
        return self.fmt.scale_for(amax, self.power_of_two)

    def units(self, payload, numel):
        return payload.reshape(numel, 1)

    def unit_values(self, rows):
        return self.fmt.values(rows)


class _NVFP4Codec:
    """Blocks of 16 consecutive elements of the flattened tensor (the last dimension's
    blocks when it is a multiple of 16), zero-padded at the end."""

    @staticmethod
    def _padded(y):
        flat = y.reshape(-1).to(torch.float32)
        pad = -flat.numel() % nvfp4.BLOCK
        return torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, nvfp4.BLOCK) if pad else flat.reshape(-1, nvfp4.BLOCK)

    def amax(self, y):
        return nvfp4.tensor_amax(self._padded(y))

    def encode(self, y, amax):
        q = nvfp4.quantize(self._padded(y), amax)
        local = nvfp4.dequantize(q).reshape(-1)[:y.numel()].reshape(y.shape)
        return torch.cat([q.codes.reshape(-1), q.block_scales.reshape(-1)]), local, nvfp4.tensor_scales(amax)[1]

    def payload_bytes(self, numel):
        blocks = -(-numel // nvfp4.BLOCK)
        return blocks * (nvfp4.BLOCK // 2) + blocks

    def values(self, payload, numel):
        blocks = -(-numel // nvfp4.BLOCK)
        codes = payload[:blocks * nvfp4.BLOCK // 2].reshape(blocks, nvfp4.BLOCK // 2)
        scales = payload[blocks * nvfp4.BLOCK // 2:].reshape(blocks, 1)
        products = nvfp4.block_products(nvfp4.QuantizedNVFP4(codes, scales, torch.zeros((), device=codes.device)))
        return products.reshape(-1)[:numel]

    def unscale(self, total, s_dec):
        return total * s_dec

    unit, unit_bytes = nvfp4.BLOCK, nvfp4.BLOCK // 2 + 1

    def context_for(self, amax):
        return nvfp4.tensor_scales(amax)[1]

    def units(self, payload, numel):
        blocks = -(-numel // nvfp4.BLOCK)
        codes = payload[:blocks * nvfp4.BLOCK // 2].reshape(blocks, nvfp4.BLOCK // 2)
        return torch.cat([codes, payload[blocks * nvfp4.BLOCK // 2:].reshape(blocks, 1)], dim=1)

    def unit_values(self, rows):
        """(blocks, 16) products ``q · s_b``."""
        q = nvfp4.QuantizedNVFP4(rows[:, :nvfp4.BLOCK // 2], rows[:, nvfp4.BLOCK // 2:],
                                 torch.zeros((), device=rows.device))
        return nvfp4.block_products(q).reshape(rows.shape[0], nvfp4.BLOCK)


class _IdentityCodec:
    def amax(self, y):
        return torch.zeros((), dtype=torch.float32, device=y.device)

    def encode(self, y, amax):
        y = y.to(torch.float32).contiguous()
        return y.reshape(-1).view(torch.uint8), y, None

    def payload_bytes(self, numel):
        return 4 * numel

    def values(self, payload, numel):
        return payload.view(torch.float32)

    def unscale(self, total, context):
        return total

    unit, unit_bytes = 1, 4

    def context_for(self, amax):
        return None

    def units(self, payload, numel):
        return payload.reshape(numel, 4)

    def unit_values(self, rows):
        return rows.contiguous().view(torch.float32)


CODECS = {("e4m3", "current"): _FP8Codec(e4m3), ("e5m2", "current"): _FP8Codec(e5m2),
          ("e4m3", "power_of_two"): _FP8Codec(e4m3, True), ("e5m2", "power_of_two"): _FP8Codec(e5m2, True),
          ("nvfp4", "current"): _NVFP4Codec(), ("fp32", "current"): _IdentityCodec()}
