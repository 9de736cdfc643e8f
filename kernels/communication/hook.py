"""GIFT as a DDP communication hook, in the shape of torch's PowerSGD hook: a state
object and ``gift_hook(state, bucket) -> Future``, registered with
``ddp.register_comm_hook(state, gift_hook)``.

Per bucket, for each gradient:

* a selected layer's weight (``layers=``) goes the GIFT route: transformed to G T with
  its layer's ``Whitening`` (refreshed every ``refresh_every`` steps from the window's
  input covariance: A all-reduced, the factors computed on the group's first rank and
  broadcast, so every rank holds the same bits);
* other gradients go the "plain" route (the wire format, no transform) or, with
  ``unselected="fp32"``, a plain fp32 all-reduce average.

Low-precision tensors: error feedback adds the previous step's residual (in the
coordinates sent: transformed ones on the GIFT route, re-based through T_old^{-1} T_new
when the transform refreshes); one MAX all-reduce of every tensor's amax agrees the
scales, so all ranks' codes share them; codes travel as uint8 in one all-gather (gloo
cannot reduce float8); each rank sums the decoded values in fp32 in rank order,
unscales, divides by the world size and (GIFT route) applies T^{-1}.

The wire format ``"fp32"`` is the identity codec: the fp32 bytes travel the same
all-gather path, for checking the path itself. The collectives run synchronously; the
returned future is already complete.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import e4m3, e5m2, nvfp4
from .whitening import CovarianceTracker, Whitening

WIRE_FORMATS = ("e4m3", "e5m2", "nvfp4", "fp32")


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
        products = nvfp4.block_products(nvfp4.QuantizedNVFP4(codes, scales, torch.zeros(())))
        return products.reshape(-1)[:numel]

    def unscale(self, total, s_dec):
        return total * s_dec


class _IdentityCodec:
    def amax(self, y):
        return torch.zeros((), dtype=torch.float32)

    def encode(self, y, amax):
        y = y.to(torch.float32).contiguous()
        return y.reshape(-1).view(torch.uint8), y, None

    def payload_bytes(self, numel):
        return 4 * numel

    def values(self, payload, numel):
        return payload.view(torch.float32)

    def unscale(self, total, context):
        return total


CODECS = {("e4m3", "current"): _FP8Codec(e4m3), ("e5m2", "current"): _FP8Codec(e5m2),
          ("e4m3", "power_of_two"): _FP8Codec(e4m3, True), ("e5m2", "power_of_two"): _FP8Codec(e5m2, True),
          ("nvfp4", "current"): _NVFP4Codec(), ("fp32", "current"): _IdentityCodec()}


class GiftState:
    """What ``gift_hook`` keeps between buckets and steps.

    ``process_group`` (None: the default group); ``fmt`` the wire format (``WIRE_FORMATS``);
    ``rank`` the transform's rank; ``refresh_every`` steps between transform refreshes;
    ``layers`` the ``nn.Linear`` modules whose weight gradients go the GIFT route (their
    inputs are tracked by forward pre-hooks from construction on); ``damping`` relative to
    A's mean eigenvalue (``Whitening.from_covariance``); ``unselected`` "plain" or "fp32";
    ``error_feedback``; ``transform`` "whitening" or "identity" (the GIFT route's
    machinery with T = I, for checking it); ``scaling`` "current" (format max / amax) or,
    for the FP8 formats, "power_of_two" (rounded down to a power of two: decoding is then
    exact, at up to one bit of range).

    ``last_sent`` holds, per gradient, what this rank put on the wire at its last
    exchange, decoded, in the coordinates sent (for measuring the wire's error)."""

    def __init__(self, process_group, fmt: str, rank: int = 32, refresh_every: int = 50, layers=(), *,
                 damping: float = 1e-3, unselected: str = "plain", error_feedback: bool = True,
                 transform: str = "whitening", scaling: str = "current"):
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"unknown wire format {fmt!r}; one of {WIRE_FORMATS}")
        if unselected not in ("plain", "fp32"):
            raise ValueError(f"unselected must be 'plain' or 'fp32', got {unselected!r}")
        if transform not in ("whitening", "identity"):
            raise ValueError(f"transform must be 'whitening' or 'identity', got {transform!r}")
        if (fmt, scaling) not in CODECS:
            raise ValueError(f"scaling {scaling!r} is not available for {fmt!r}")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
            raise ValueError(f"refresh_every must be a positive integer, got {refresh_every!r}")
        self.process_group = process_group
        self.fmt, self.rank, self.refresh_every, self.damping = fmt, rank, refresh_every, damping
        self.unselected, self.error_feedback, self.transform = unselected, error_feedback, transform
        self.scaling = scaling
        self.layers = list(layers)
        for layer in self.layers:
            if not isinstance(layer, torch.nn.Linear):
                raise TypeError(f"GIFT layers must be nn.Linear, got {type(layer).__name__}")
        self._layer_of_weight = {id(layer.weight): i for i, layer in enumerate(self.layers)}
        self.tracker = CovarianceTracker(self.layers) if transform == "whitening" else None
        self.whitenings = {i: Whitening.identity(layer.in_features) for i, layer in enumerate(self.layers)}
        self.residuals = {}
        self.last_sent = {}
        self.step = 0
        self._refreshed_at = {}
        #: (step, layer index, digest of the factors) after every refresh
        self.digests = []

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _source_rank(self) -> int:
        group = dist.group.WORLD if self.process_group is None else self.process_group
        return dist.get_process_group_ranks(group)[0]

    def refresh(self, index: int) -> None:
        """New factors for layer ``index`` from the window's covariance, identical on every
        rank; its residual re-based into the new coordinates; a new window opened."""
        layer = self.layers[index]
        if self.transform == "identity":
            new = Whitening.identity(layer.in_features)
        else:
            rows = torch.tensor([self.tracker.rows(layer)], dtype=torch.int64)
            dist.all_reduce(rows, group=self.process_group)
            if int(rows) == 0:
                return  # nothing recorded anywhere: keep the transform
            A = (self.tracker.covariance(layer) if self.tracker.rows(layer)
                 else torch.zeros(layer.in_features, layer.in_features))
            dist.all_reduce(A, group=self.process_group)
            A /= self.world_size
            new = Whitening.from_covariance(A, self.rank, self.damping)
            new.broadcast(self._source_rank(), self.process_group)
            self.tracker.reset(layer)
        key = id(layer.weight)
        if key in self.residuals:
            old = self.whitenings[index]
            self.residuals[key] = new.apply(old.invert(self.residuals[key]))
        self.whitenings[index] = new
        self.digests.append((self.step, index, new.digest()))

    def route(self, parameter) -> str:
        if id(parameter) in self._layer_of_weight:
            return "gift"
        return "fp32" if self.unselected == "fp32" else "plain"

    def exchange(self, entries):
        """The low-precision path for ``entries`` = [(key, tensor, Whitening or None)]:
        the averaged tensors, transformed back. Residuals are kept under ``key``."""
        if not entries:
            return []  # every rank holds the same buckets, so every rank skips alike
        codec = CODECS[self.fmt, self.scaling]
        world = self.world_size
        sent_coordinates = []
        for key, x, whitening in entries:
            y = whitening.apply(x) if whitening is not None else x.to(torch.float32)
            if self.error_feedback and key in self.residuals:
                y = y + self.residuals[key]
            sent_coordinates.append(y)
        amax = torch.stack([codec.amax(y) for y in sent_coordinates])
        if self.fmt != "fp32":
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.process_group)
        payloads, contexts = [], []
        for (key, _, _), y, m in zip(entries, sent_coordinates, amax):
            payload, local, context = codec.encode(y, m)
            if self.error_feedback:
                self.residuals[key] = y - local
            self.last_sent[key] = local
            payloads.append(payload)
            contexts.append(context)
        mine = torch.cat(payloads)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.process_group)
        out, offset = [], 0
        for (key, x, whitening), context in zip(entries, contexts):
            size = codec.payload_bytes(x.numel())
            total = codec.values(gathered[0][offset:offset + size], x.numel()).clone()
            for r in range(1, world):
                total += codec.values(gathered[r][offset:offset + size], x.numel())
            offset += size
            mean = codec.unscale(total, context).reshape(x.shape) / world
            out.append(whitening.invert(mean) if whitening is not None else mean)
        return out


def gift_hook(state: GiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    params = bucket.parameters()
    if state.step % state.refresh_every == 0:
        for p in params:
            index = state._layer_of_weight.get(id(p))
            if index is not None and state._refreshed_at.get(index) != state.step:
                state._refreshed_at[index] = state.step
                state.refresh(index)
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    low, full = [], []
    for p, g in zip(params, views):
        route = state.route(p)
        if route == "fp32":
            full.append(g)
        else:
            whitening = state.whitenings[state._layer_of_weight[id(p)]] if route == "gift" else None
            low.append((id(p), g, whitening))
    if full:
        flat = torch.cat([g.reshape(-1) for g in full])
        dist.all_reduce(flat, group=state.process_group)
        flat /= state.world_size
        start = 0
        for g in full:
            g.copy_(flat[start:start + g.numel()].view(g.shape))
            start += g.numel()
    for (_, g, _), result in zip(low, state.exchange(low)):
        g.copy_(result)
    if bucket.is_last():
        state.step += 1
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
