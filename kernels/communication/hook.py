"""GIFT as a DDP communication hook, in the shape of torch's PowerSGD hook: a state
object and ``gift_hook(state, bucket) -> Future``, registered with
``ddp.register_comm_hook(state, gift_hook)``.

Per bucket, for each gradient:

* a selected layer's weight (``layers=``: a list, or a ``RangeHitSelection`` that picks
  them after a warm-up window) goes the GIFT route: transformed to G T with its layer's
  ``Whitening`` (computed at the step the layer joins, then every ``refresh_every``
  steps, from the window's input covariance: A all-reduced, the factors computed on the
  group's first rank and broadcast, so every rank holds the same bits);
* other gradients go the "plain" route (the wire format, no transform) or, with
  ``unselected="fp32"``, a plain fp32 all-reduce average.

Low-precision tensors: error feedback adds the previous step's residual (in the
coordinates sent: transformed ones on the GIFT route, re-based through T_old^{-1} T_new
when the transform refreshes); one MAX all-reduce of every tensor's amax (and of a flag
that some rank's tensor is not finite, so that every rank refuses together instead of
one rank raising while the others wait) agrees the scales, so all ranks' codes share
them. Codes travel as uint8 (gloo cannot reduce float8), in one of two exchanges
(``exchange=``):

* ``"all_gather"``: one all-gather of every rank's codes; each rank sums the decoded
  values in fp32 in rank order and unscales. Every rank receives (world − 1) payloads.
* ``"reduce_scatter"`` (the default): every tensor's codes are cut into world shards on
  codec-unit boundaries (``shards.py``; NVFP4 blocks are never split) and one
  all-to-all sends every tensor's shard j to rank j; rank j decodes and sums its shard in fp32 in rank
  order, unscales, and re-quantizes that shard sum under a second scale, agreed by a
  second MAX all-reduce (of the shard sums' amax per tensor, with a flag for a sum that
  overflowed); one all-gather of the re-quantized shards gives every rank the same
  codes, which it decodes. Every rank receives 2 (world − 1) / world payloads, at the
  cost of the second quantization's error (proofs/gift.md, section 7).

Either way the result is then divided by the world size and (GIFT route) T^{-1} applied.
Error feedback on the reduce-scatter exchange keeps two residuals: each rank's own first
quantization residual, as on the all-gather exchange, and the second quantization's
error of a shard, which is common to all ranks (they all decode the same codes) and
known only to the shard's owner; the owner alone keeps it (``shard_residuals``, in the
sent coordinates, in units of the sum) and adds it to that shard's sum before the next
re-quantization, so it is fed back once, not once per rank. When the tensor's transform
refreshes (or a state is loaded at another world size, so its shard moves) the owner
folds the shard residual into its own first residual, which carries it into the sum all
the same.

Asynchrony (``overlap=True``; the default, None, chooses it where it is supported, CPU
gradients in a group that reduces CPU tensors by gloo, whether it was made with that name
or without one, and reduces inline elsewhere): the hook returns at once; the
bucket's whole reduction (refreshes, collectives, codec) runs on the state's one
communication thread, buckets in the order DDP hands them over, and completes the
returned future. One thread
and not PowerSGD's chain of ``.then`` callbacks: gloo completes a future on one of its
worker threads, so collectives issued from callbacks of several buckets in flight would
be issued in an order that can differ between ranks, and gloo pairs collectives by their
order. The same thread keeps every GIFT collective in bucket order on every rank; DDP
options that issue collectives of their own during backward (``find_unused_parameters``)
are not supported with it, and it has run on gloo with CPU tensors only: the thread does
not carry the caller's CUDA device, stream or events (its current device is cuda:0 on
every rank), so ``overlap=True`` is refused (ValueError) for a group that reduces CPU
tensors by another backend or none, at
construction when the process group exists by then, else at the first bucket, and for
gradients that are not on the CPU. ``overlap=False`` reduces inside the hook (the bits are
the same: the same code runs on the same data).

The wire format ``"fp32"`` is the identity codec: the fp32 bytes travel the same
path as codes would (either exchange), for checking the path itself.
"""

import concurrent.futures
from collections import Counter

import torch
import torch.distributed as dist

from .._collectives import serving_backend
from ..errors import NonFiniteInputError
from .codecs import CODECS
from .selection import RangeHitSelection
from .shards import ShardLayout
from .whitening import CovarianceTracker, Whitening, agreed_whitening, check_rank_and_damping

WIRE_FORMATS = ("e4m3", "e5m2", "nvfp4", "fp32")
EXCHANGES = ("reduce_scatter", "all_gather")


class GiftState:
    """What ``gift_hook`` keeps between buckets and steps.

    ``process_group`` (None: the default group); ``fmt`` the wire format (``WIRE_FORMATS``);
    ``rank`` the transform's rank; ``refresh_every`` steps between transform refreshes;
    ``layers`` the ``nn.Linear`` modules whose weight gradients go the GIFT route (their
    inputs are tracked by forward pre-hooks from construction on), or a
    ``RangeHitSelection`` (``selection.py``); ``damping`` relative to A's mean eigenvalue
    (``Whitening.from_covariance``); ``unselected`` "plain" or "fp32"; ``error_feedback``;
    ``transform`` "whitening" or "identity" (the GIFT route's machinery with T = I, for
    checking it); ``scaling`` "current" (format max / amax) or, for the FP8 formats,
    "power_of_two" (rounded down to a power of two: decoding is then exact, at up to one
    bit of range); ``exchange`` "reduce_scatter" or "all_gather" and ``overlap`` True, False
    or None (the module docstring). The default exchange is the reduce-scatter: it never receives more
    code bytes than the all-gather (as many at 2 ranks, up to padding; fewer from 3 on,
    (n − 1) against 2 (n − 1)/n payloads), and only it saves bytes at scale; the
    all-gather quantizes once, so it is the exact one (shared-scale E4M3 sums, proofs
    section 2) and costs one MAX all-reduce less.

    ``last_sent`` holds, per gradient, what this rank put on the wire at its last
    exchange, decoded, in the coordinates sent (for measuring the wire's error; on the
    reduce-scatter exchange the first quantization's).
    ``state_dict(parameters)``/``load_state_dict(state, parameters)`` resume it bit for
    bit. ``wire_bytes`` counts the bytes this rank passed into collectives, by kind
    ("gradients": codes or fp32 values, "scales": the amax vectors, "refresh": A, the
    flags and the factors). ``received_bytes`` counts, by kind, what the code exchanges
    deliver to this rank from the others, which does not depend on the collective's
    algorithm: (world − 1) payloads per all-gather, (world − 1)/world of the input per
    all-to-all. All-reduces (scales, ``unselected="fp32"``, refresh) are counted in
    ``wire_bytes`` only: what they deliver depends on the algorithm (a ring: 2 (world −
    1)/world of the input)."""

    def __init__(self, process_group, fmt: str, rank: int = 32, refresh_every: int = 50, layers=(), *,
                 damping: float = 1e-3, unselected: str = "plain", error_feedback: bool = True,
                 transform: str = "whitening", scaling: str = "current", exchange: str = "reduce_scatter",
                 overlap: bool | None = None):
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"unknown wire format {fmt!r}; one of {WIRE_FORMATS}")
        if unselected not in ("plain", "fp32"):
            raise ValueError(f"unselected must be 'plain' or 'fp32', got {unselected!r}")
        if transform not in ("whitening", "identity"):
            raise ValueError(f"transform must be 'whitening' or 'identity', got {transform!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if (fmt, scaling) not in CODECS:
            raise ValueError(f"scaling {scaling!r} is not available for {fmt!r}")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
            raise ValueError(f"refresh_every must be a positive integer, got {refresh_every!r}")
        check_rank_and_damping(rank, damping)  # here, not in DDP's backward at the first refresh
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be True, False or None (where supported), got {overlap!r}")
        if overlap and dist.is_initialized():
            self._check_overlap(process_group, None)
        self.process_group = process_group
        self.fmt, self.rank, self.refresh_every, self.damping = fmt, rank, refresh_every, damping
        self.unselected, self.error_feedback, self.transform = unselected, error_feedback, transform
        self.scaling, self.exchange_kind, self.overlap = scaling, exchange, overlap
        #: whether buckets reduce on the communication thread, settled at the first bucket
        self._overlapping = None
        self.selection = layers if isinstance(layers, RangeHitSelection) else None
        self.layers = []
        self._layer_of_weight = {}
        self._joined = {}
        self.tracker = CovarianceTracker() if transform == "whitening" else None
        self.whitenings = {}
        self.residuals = {}
        #: key -> (start, stop, the second quantization's residual of elements [start, stop)
        #: of that tensor, flattened), for the shards this rank owns (reduce-scatter exchange)
        self.shard_residuals = {}
        self.last_sent = {}
        self.step = 0
        self._refreshed_at = {}
        #: (step, layer index, digest of the factors) after every refresh
        self.digests = []
        self.wire_bytes = Counter()
        self.received_bytes = Counter()
        self._worker = None
        if self.selection is None:
            self._add_layers(list(layers))
        else:
            self.selection.bind(fmt)
            if self.selection.frozen:  # resumed from a state_dict: the selection stands
                self._add_layers([self.selection.candidates[i] for i in self.selection.selected])

    def _add_layers(self, layers) -> None:
        for layer in layers:
            if not isinstance(layer, torch.nn.Linear):
                raise TypeError(f"GIFT layers must be nn.Linear, got {type(layer).__name__}")
            index = len(self.layers)
            self.layers.append(layer)
            self._layer_of_weight[id(layer.weight)] = index
            self._joined[index] = self.step
            self.whitenings[index] = Whitening.identity(layer.in_features)
        if self.tracker is not None:
            self.tracker.add(layers)

    @staticmethod
    def _thread_works(group, device) -> bool:
        """Whether the communication thread is known to work: the group reduces CPU tensors
        by gloo and the gradients (``device``; None: not known yet) are on the CPU."""
        return serving_backend("cpu", group) == "gloo" and (device is None or device.type == "cpu")

    @classmethod
    def _check_overlap(cls, group, device) -> None:
        """Refuse ``overlap=True`` where the thread is not known to work."""
        if not cls._thread_works(group, device):
            where = (f"{device.type} gradients" if serving_backend("cpu", group) == "gloo"
                     else f"a group of {dist.get_backend_config(group)}")
            raise ValueError(f"overlap=True reduces on a thread that does not carry the caller's CUDA device, stream "
                             f"or events; it runs on gloo with CPU gradients only, not {where}: pass overlap=False "
                             "(or None, which reduces inline there)")

    def overlapping(self, device) -> bool:
        """Whether buckets reduce on the communication thread, settled at the first bucket
        (``device``: its gradients') and kept, so that every bucket goes the same way."""
        if self._overlapping is None:
            if self.overlap:
                self._check_overlap(self.process_group, device)
            self._overlapping = self._thread_works(self.process_group, device) if self.overlap is None \
                else self.overlap
        return self._overlapping

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def refresh(self, index: int) -> None:
        """New factors for layer ``index`` from the window's covariance, identical on every
        rank; its residual re-based into the new coordinates; a new window opened."""
        layer = self.layers[index]
        if self.transform == "identity":
            new = Whitening.identity(layer.in_features)
        else:
            A = self.tracker.covariance(layer) if self.tracker.rows(layer) else None
            new, sent = agreed_whitening(A, layer.in_features, self.rank, self.damping, self.process_group,
                                         device=layer.weight.device)
            self.wire_bytes["refresh"] += sent
            if new is None:
                return  # nothing recorded anywhere: keep the transform
            self.tracker.reset(layer)
        key = id(layer.weight)
        if key in self.shard_residuals:  # a part of the sum's residual cannot be re-based: whole rows can
            self._fold(key, self.shard_residuals.pop(key))
        if key in self.residuals:
            old = self.whitenings[index]
            self.residuals[key] = new.apply(old.invert(self.residuals[key]))
        self.whitenings[index] = new
        self.digests.append((self.step, index, new.digest()))

    def route(self, parameter) -> str:
        if id(parameter) in self._layer_of_weight:
            return "gift"
        return "fp32" if self.unselected == "fp32" else "plain"

    def exchange(self, entries, *, average: bool = True):
        """The low-precision path for ``entries`` = [(key, tensor, Whitening or None)]:
        the tensors averaged over the ranks (``average=False``: summed), transformed
        back. Residuals are kept under ``key``; they change only once the exchange has
        succeeded (a refusal leaves them as they were)."""
        if not entries:
            return []  # every rank holds the same buckets, so every rank skips alike
        sent, amax = self.prepare(entries)
        if self.fmt != "fp32":
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.process_group)
            self.wire_bytes["scales"] += amax.numel() * 4
            self.refuse_non_finite(entries, amax)
        payloads, decoded, contexts = self.encode(entries, sent, amax)
        if self.exchange_kind == "all_gather":
            mine = torch.cat(payloads)
            gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=self.process_group)
            self.wire_bytes["gradients"] += mine.numel()
            self.received_bytes["gradients"] += (self.world_size - 1) * mine.numel()
            out, shard_updates = self.combine(entries, gathered, contexts, average), None
        else:
            out, shard_updates = self.reduce_scatter(entries, payloads, contexts, average)
        self.commit(entries, sent, decoded, shard_updates)
        return out

    def prepare(self, entries):
        """(the tensors to send, in their coordinates with the residual added; the amax
        vector: one amax per tensor, 0 where it is not finite, then the non-finite flag)."""
        codec = CODECS[self.fmt, self.scaling]
        sent = []
        for key, x, whitening in entries:
            y = whitening.apply(x) if whitening is not None else x.to(torch.float32)
            if self.error_feedback and key in self.residuals:
                y = y + self.residuals[key]
            sent.append(y)
        finite = [bool(torch.isfinite(y).all()) for y in sent]
        zero = torch.zeros((), dtype=torch.float32, device=sent[0].device)
        amax = [codec.amax(y) if ok else zero for y, ok in zip(sent, finite)]
        return sent, torch.stack(amax + [zero if all(finite) else zero + 1])

    def refuse_non_finite(self, entries, amax) -> None:
        if float(amax[-1]) != 0:
            raise NonFiniteInputError(f"gift_hook: a gradient of this bucket ({len(entries)} tensors) is not finite "
                                      "on at least one rank; nothing was sent and no residual changed")

    def encode(self, entries, sent, amax):
        """(this rank's payloads, one per tensor; what each decodes to; the unscaling contexts)."""
        codec = CODECS[self.fmt, self.scaling]
        payloads, decoded, contexts = [], [], []
        for y, m in zip(sent, amax):
            payload, local, context = codec.encode(y, m)
            payloads.append(payload)
            decoded.append(local)
            contexts.append(context)
        return payloads, decoded, contexts

    def commit(self, entries, sent, decoded, shard_updates=None) -> None:
        """After a successful exchange: the first residuals (sent − decoded), ``last_sent``,
        and (reduce-scatter) the owned shards' second residuals ``shard_updates`` = {key:
        (start, stop, residual)}; a held shard residual that was not used because this
        rank's shard of the tensor moved is folded into the first residual."""
        for (key, _, _), y, local in zip(entries, sent, decoded):
            if self.error_feedback:
                self.residuals[key] = y - local
            self.last_sent[key] = local
        if not self.error_feedback:
            return
        if shard_updates is None:
            # The all-gather exchange keeps no shard residuals; one held from a reduce-scatter
            # state (loaded, or this hook's before a switch) joins the first residual, so it is
            # sent once rather than kept unsent for ever.
            for key, _, _ in entries:
                held = self.shard_residuals.pop(key, None)
                if held is not None:
                    self._fold(key, held)
            return
        for key, _, _ in entries:
            held = self.shard_residuals.pop(key, None)
            update = shard_updates.get(key)
            if held is not None and (update is None or update[:2] != held[:2]):
                self._fold(key, held)
            if update is not None:
                self.shard_residuals[key] = update

    def _fold(self, key, held) -> None:
        """A shard residual added to this rank's first residual of the same tensor: both are
        in the sent coordinates, and whatever one rank's residual holds enters the sum once."""
        start, stop, residual = held
        flat = self.residuals[key].reshape(-1)
        count = min(stop, flat.numel()) - start  # NVFP4's padding elements are not the tensor's
        if count > 0:
            flat[start:start + count] += residual[:count]

    def fold_shard_residuals(self) -> None:
        """Every held shard residual folded into the first residuals (before re-basing them)."""
        for key in list(self.shard_residuals):
            self._fold(key, self.shard_residuals.pop(key))

    def reduce_scatter(self, entries, payloads, contexts, average: bool = True):
        """The reduce-scatter exchange of this rank's ``payloads`` (module docstring):
        (the results, as ``combine``'s; the owned shards' second residuals)."""
        codec = CODECS[self.fmt, self.scaling]
        group, world = self.process_group, self.world_size
        me = dist.get_rank(group)  # this rank's shard of every tensor
        layout = ShardLayout.of(codec, [x.numel() for _, x, _ in entries], world)
        messages = payloads[0].new_zeros(world, layout.message_units, codec.unit_bytes)
        for t, ((_, x, _), payload) in enumerate(zip(entries, payloads)):
            units, offset = layout.shard_units[t], layout.offsets[t]
            rows = codec.units(payload, x.numel())
            padded = rows.new_zeros(world * units, codec.unit_bytes)
            padded[:rows.shape[0]] = rows
            messages[:, offset:offset + units] = padded.view(world, units, codec.unit_bytes)
        received = torch.empty_like(messages)
        dist.all_to_all_single(received.view(-1), messages.view(-1), group=group)
        self.wire_bytes["gradients"] += messages.numel()
        self.received_bytes["gradients"] += (world - 1) * messages[0].numel()
        total = codec.unit_values(received[0]).clone()
        for r in range(1, world):  # rank order, as the all-gather exchange sums
            total += codec.unit_values(received[r])
        sums = []
        for t, (key, _, _) in enumerate(entries):
            offset, units = layout.offsets[t], layout.shard_units[t]
            z = codec.unscale(total[offset:offset + units].reshape(-1), contexts[t])
            held = self.shard_residuals.get(key) if self.error_feedback else None
            if held is not None and held[:2] == layout.elements(t, me):
                z = z + held[2]
            sums.append(z)
        second = total.new_zeros(len(entries) + 1)
        if self.fmt != "fp32":
            finite = [bool(torch.isfinite(z).all()) for z in sums]
            for t, (z, ok) in enumerate(zip(sums, finite)):
                if ok and z.numel():
                    second[t] = codec.amax(z)
            second[-1] = 0 if all(finite) else 1
            dist.all_reduce(second, op=dist.ReduceOp.MAX, group=group)
            self.wire_bytes["scales"] += second.numel() * 4
            if float(second[-1]) != 0:
                raise NonFiniteInputError(f"gift_hook: a shard sum of this bucket ({len(entries)} tensors) overflowed "
                                          "fp32 on at least one rank; no result was returned and no residual changed")
        requantized = messages.new_zeros(layout.message_units, codec.unit_bytes)
        shard_updates = {}
        for t, ((key, _, _), z) in enumerate(zip(entries, sums)):
            if not z.numel():
                continue
            offset, units = layout.offsets[t], layout.shard_units[t]
            payload, local, _ = codec.encode(z, second[t])
            requantized[offset:offset + units] = codec.units(payload, z.numel())
            if self.fmt != "fp32":  # the identity codec's second step is exact: nothing to feed back
                shard_updates[key] = (*layout.elements(t, me), z - local)
        gathered = [torch.empty_like(requantized) for _ in range(world)]
        dist.all_gather(gathered, requantized, group=group)
        self.wire_bytes["gradients"] += requantized.numel()
        self.received_bytes["gradients"] += (world - 1) * requantized.numel()
        everyone = torch.stack(gathered)  # (world, message units, unit bytes)
        out = []
        for t, (_, x, whitening) in enumerate(entries):
            offset, units = layout.offsets[t], layout.shard_units[t]
            rows = everyone[:, offset:offset + units].reshape(world * units, codec.unit_bytes)
            values = codec.unit_values(rows).reshape(-1)[:x.numel()]
            result = codec.unscale(values, codec.context_for(second[t])).reshape(x.shape)
            if average:
                result = result / world
            out.append(whitening.invert(result) if whitening is not None else result)
        return out, shard_updates

    def combine(self, entries, gathered, contexts, average: bool = True):
        """Every rank's payloads (``gathered``, in rank order) decoded, summed in fp32,
        unscaled, averaged and transformed back."""
        codec = CODECS[self.fmt, self.scaling]
        out, offset = [], 0
        for (key, x, whitening), context in zip(entries, contexts):
            size = codec.payload_bytes(x.numel())
            total = codec.values(gathered[0][offset:offset + size], x.numel()).clone()
            for payload in gathered[1:]:
                total += codec.values(payload[offset:offset + size], x.numel())
            offset += size
            result = codec.unscale(total, context).reshape(x.shape)
            if average:
                result = result / len(gathered)
            out.append(whitening.invert(result) if whitening is not None else result)
        return out

    def reduce_bucket(self, buffer: torch.Tensor, params, is_last: bool) -> torch.Tensor:
        """One bucket's reduction: ``buffer`` (the bucket's flat gradients of ``params``)
        averaged over the ranks in place, and returned."""
        for p in params:
            index = self._layer_of_weight.get(id(p))
            if (index is not None and (self.step - self._joined[index]) % self.refresh_every == 0
                    and self._refreshed_at.get(index) != self.step):
                self._refreshed_at[index] = self.step
                self.refresh(index)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        low, full = [], []
        for p, g in zip(params, views):
            if self.selection is not None:
                self.selection.observe(p, g)
            route = self.route(p)
            if route == "fp32":
                full.append(g)
            else:
                whitening = self.whitenings[self._layer_of_weight[id(p)]] if route == "gift" else None
                low.append((id(p), g, whitening))
        if full:
            flat = torch.cat([g.reshape(-1) for g in full])
            dist.all_reduce(flat, group=self.process_group)
            self.wire_bytes["gradients"] += flat.numel() * 4
            flat /= self.world_size
            start = 0
            for g in full:
                g.copy_(flat[start:start + g.numel()].view(g.shape))
                start += g.numel()
        for (_, g, _), result in zip(low, self.exchange(low)):
            g.copy_(result)
        if is_last:
            self.step += 1
            if self.selection is not None and not self.selection.frozen and self.step == self.selection.warmup_steps:
                self._add_layers(self.selection.freeze(self.process_group))
        return buffer

    def configuration(self) -> dict:
        """The arguments that give a saved state its meaning (``state_dict`` keeps them and
        ``load_state_dict`` refuses another): the format and scaling its residuals were
        made by, the transform, rank and damping of its factors, whether it feeds back, the
        unselected route (under "fp32" the plain route's residuals would be kept unsent),
        and the selection its counts belong to (its count, warm-up and counted format; a
        state past another warm-up would never freeze). The exchange and ``refresh_every``
        are left out: a state moves between the exchanges (shard residuals fold in), and
        goes on at another refresh interval from the steps its layers joined."""
        selection = None if self.selection is None else {
            "count": self.selection.count, "warmup_steps": self.selection.warmup_steps, "fmt": self.selection.fmt}
        return {"fmt": self.fmt, "scaling": self.scaling, "transform": self.transform, "rank": self.rank,
                "damping": self.damping, "error_feedback": self.error_feedback, "unselected": self.unselected,
                "selection": selection}

    def check_configuration(self, saved, holder: str = "state") -> None:
        """Refuse a state saved under another ``configuration()``, or one that records none
        of it or not all of it (saved before it was kept), which cannot be checked: that
        error gives the line that vouches for it, naming this state ``holder``, as the
        fused layers' refusal of a checkpoint without its rule's record does."""
        mine = self.configuration()
        if saved is None or any(key not in saved for key in mine):
            shown = ", ".join(f"{key}={value!r}" for key, value in mine.items())
            raise ValueError("the GIFT state records no configuration, or not all of it (it was saved before it was "
                             f"kept), so it cannot be checked against this state's ({shown}); refused, this state is left as "
                             "it was. If it was saved with these arguments, give it their record: "
                             f"saved['config'] = {holder}.configuration()")
        if saved != mine:
            differ = ", ".join(f"{key} {saved.get(key)!r} (this state: {mine.get(key)!r})"
                               for key in {**mine, **saved} if saved.get(key) != mine.get(key))
            raise ValueError(f"the GIFT state was saved with {differ}: load it into a state made with the same "
                             "arguments (the exchange and refresh_every may differ)")

    def state_dict(self, parameters) -> dict:
        """What resumes the hook bit for bit (with the model's and optimizer's own state):
        step, transforms, residuals, covariance windows, digests, the selection, and the
        ``configuration()``. Parameters are named by their index in ``parameters`` (the
        model's, in a fixed order)."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()  # the reductions in flight first
        index = {id(p): i for i, p in enumerate(parameters)}
        unknown = [key for key in [*self.residuals, *self.shard_residuals] if key not in index]
        if unknown or any(id(layer.weight) not in index for layer in self.layers):
            raise ValueError("a residual or layer of this state belongs to no parameter given")
        windows = {}
        for i, layer in enumerate(self.layers):
            window = self.tracker.window(layer) if self.tracker is not None else None
            if window is not None:
                windows[i] = (window[0].clone(), window[1])
        return {"step": self.step, "layers": [index[id(layer.weight)] for layer in self.layers],
                "joined": dict(self._joined), "refreshed_at": dict(self._refreshed_at),
                "whitenings": {i: [t.clone() for t in w.tensors()] for i, w in self.whitenings.items()},
                "residuals": {index[key]: r.clone() for key, r in self.residuals.items()},
                "shard_residuals": {index[key]: (start, stop, r.clone())
                                    for key, (start, stop, r) in self.shard_residuals.items()},
                "windows": windows, "digests": list(self.digests), "wire_bytes": dict(self.wire_bytes),
                "received_bytes": dict(self.received_bytes),
                "selection": self.selection.state_dict() if self.selection is not None else None,
                "config": self.configuration()}

    def load_state_dict(self, state: dict, parameters) -> None:
        """Resume from ``state_dict(parameters)``; this state must have been made with the
        same layers (or the same selection's candidates) of a model with the same parameters,
        and the same ``configuration()`` (``check_configuration``: a state that records none
        is refused until vouched for)."""
        self.check_configuration(state.get("config"))
        parameters = list(parameters)
        if self.selection is not None:
            self.selection.load_state_dict(state["selection"])
            if self.selection.frozen and not self.layers:
                self._add_layers([self.selection.candidates[i] for i in self.selection.selected])
        index = {id(p): i for i, p in enumerate(parameters)}
        if [index.get(id(layer.weight)) for layer in self.layers] != state["layers"]:
            raise ValueError(f"the saved state's GIFT layers are parameters {state['layers']}; this state's are "
                             f"{[index.get(id(layer.weight)) for layer in self.layers]}")
        self.step = state["step"]
        self._joined, self._refreshed_at = dict(state["joined"]), dict(state["refreshed_at"])
        self.whitenings = {i: Whitening(*[t.clone() for t in tensors]) for i, tensors in state["whitenings"].items()}
        self.residuals = {id(parameters[i]): r.clone() for i, r in state["residuals"].items()}
        # states saved before the reduce-scatter exchange existed hold no shard residuals
        self.shard_residuals = {id(parameters[i]): (start, stop, r.clone())
                                for i, (start, stop, r) in state.get("shard_residuals", {}).items()}
        if self.tracker is not None:
            self.tracker.reset()
            for i, (total, rows) in state["windows"].items():
                self.tracker.set_window(self.layers[i], total, rows)
        self.digests = list(state["digests"])
        self.wire_bytes = Counter(state["wire_bytes"])
        self.received_bytes = Counter(state.get("received_bytes", {}))

    def submit(self, buffer: torch.Tensor, params, is_last: bool) -> torch.futures.Future:
        """``reduce_bucket`` on the communication thread; its future."""
        if self._worker is None:
            # The thread takes the caller's intra-op thread count. Without this, the tiny
            # GPT's steps on 2 gloo ranks of a 2-core machine were 4-14x slower than inline,
            # with it 0.9-1.9x (measured; why a fresh thread oversubscribes is not pinned
            # down, and no test catches it: it shows only in time)
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="gift-comm", initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),))
        future = torch.futures.Future()

        def run():
            try:
                future.set_result(self.reduce_bucket(buffer, params, is_last))
            except BaseException as error:  # handed to whoever waits on the future (DDP's backward)
                future.set_exception(error)

        self._worker.submit(run)
        return future

    def close(self) -> None:
        """Stop the communication thread (after the reductions already submitted)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def gift_hook(state: GiftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer, params, is_last = bucket.buffer(), bucket.parameters(), bucket.is_last()
    if state.overlapping(buffer.device):
        return state.submit(buffer, params, is_last)
    fut = torch.futures.Future()
    fut.set_result(state.reduce_bucket(buffer, params, is_last))
    return fut
