"""Where a bucket's codes are cut for GIFT's reduce-scatter exchange (``hook.py``).

Each tensor is a run of codec *units* (``codecs.py``: an FP8 or fp32 element, an NVFP4
block of 16; NVFP4 pads a tensor to whole blocks, as its payload already does), padded
with zero units to a multiple of the world size and cut into ``world`` equal shards of
``shard_units[t]`` units. Shard boundaries fall on unit boundaries, so no NVFP4 block or
block scale is split between two ranks. Rank j owns shard j of every tensor: it receives
every rank's shard j, sums it and re-quantizes the sum.

Every tensor is cut on its own, not the bucket as one run, so that which elements of a
tensor a rank owns depends on the tensor's size and the world size alone: DDP hands a
model's parameters over in one order at its first step and another after it rebuilds
its buckets, and a resumed hook starts with the first order again; a bucket-wide cut
would move the second quantization's residuals between ranks there (and a resumed run
would differ from an uninterrupted one). The price is padding of up to world − 1 units
per tensor instead of per bucket.

A rank's message to rank j, and its all-gathered shard, is the concatenation over the
bucket's tensors of their shard j, tensor t at ``offsets[t]`` units.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    shard_units: tuple  # units per shard, per tensor
    offsets: tuple      # where each tensor's shard starts in a rank's message, in units
    unit: int           # elements per unit
    world: int

    @classmethod
    def of(cls, codec, numels, world: int) -> "ShardLayout":
        shards = tuple(-(-(-(-numel // codec.unit)) // world) for numel in numels)
        offsets, at = [], 0
        for units in shards:
            offsets.append(at)
            at += units
        return cls(shards, tuple(offsets), codec.unit, world)

    @property
    def message_units(self) -> int:
        """Units a rank sends to each rank (and owns)."""
        return sum(self.shard_units)

    def elements(self, t: int, shard: int):
        """(start, stop): the elements of tensor ``t`` (flattened, padded to whole units) in ``shard``."""
        units = self.shard_units[t]
        return shard * units * self.unit, (shard + 1) * units * self.unit
