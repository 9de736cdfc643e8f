"""The ChunkFT controller: which chunk is active, the sliced updates, per-chunk state.

Each supported module's forward is replaced (an instance attribute, removed by
``ChunkFT.remove()``) by the same functional op inside an autograd Function whose
backward computes the full dX exactly as torch does, then steps the active chunk's
slice of the module's parameters in place and returns no parameter gradient
(``.grad`` stays None). nn.Linear weights step through the fused kernel on their row
or column range (``WeightSlice``), so their gradient never exists; Embedding, norm and
bias slices get their slice's gradient (``sliced``) and the same epilogue
(``apply_rule``). Stochastic rounding is keyed on each element's index in its whole
parameter, so a slice rounds as the dense update would.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .._collectives import refused_together
from ..config import PINNED, TileConfig
from ..ops.fused_weight_update import ROUNDINGS, apply_rule, fused_weight_update
from ..ops.stochastic_round import check_seed
from ..ops.weight_gradient import weight_gradient
from ..rules.base import Rule, recorded_hyperparameters, shown_hyperparameters
from . import data_parallel, sliced
from . import shards as shard_plan
from .plan import SPLITS, plan_chunks, tensor_costs
from .state_store import ChunkStates

ORDERS = ("cyclic", "random")
STATE_STORES = ("device", "host")
_SUPPORTED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)
_SUPPORTED_NAMES = "nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm and transformers' LlamaRMSNorm"
#: the parameters each supported module's forward uses (and ChunkFT steps)
_ATTRIBUTES = {nn.Linear: ("weight", "bias"), nn.Embedding: ("weight",), nn.LayerNorm: ("weight", "bias"),
               nn.RMSNorm: ("weight",)}
# Per-tensor rounding streams: tensor i of the stream draws from seed + i * this (mod 2**63).
_SEED_STRIDE = 0x9E3779B97F4A7C15


def tensor_seed(seed: int, index: int) -> int:
    """The stochastic-rounding key of trainable tensor ``index`` (stream order) under ``seed``."""
    return (seed + index * _SEED_STRIDE) % 2**63


def _autocast_dtype(device_type):
    """The dtype torch.autocast runs matmuls in on ``device_type``, or None outside it."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ctl, module):
        # Under autocast, cast as autocast's linear does and keep the cast operands: the
        # output and dX are then autocast's, and the kernel steps the slice from the same
        # bf16 activations that autocast's own weight gradient would use.
        ctx.input_dtype = x.dtype
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.ctl, ctx.module = ctl, module
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = (dy @ weight).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        ctx.ctl._linear_step(ctx.module, x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))
        return dx, None, None, None, None


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, ctl, module):
        ctx.save_for_backward(indices)
        ctx.ctl, ctx.module = ctl, module
        return F.embedding(indices, weight, module.padding_idx, None, module.norm_type,
                           module.scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx, dy):
        (indices,) = ctx.saved_tensors
        ctx.ctl._embedding_step(ctx.module, indices, dy)
        return None, None, None, None


def _is_llama_rms_norm(module) -> bool:
    """Hugging Face's LlamaRMSNorm, recognised by name (transformers need not be installed)."""
    kind = type(module)
    return kind.__name__ == "LlamaRMSNorm" and kind.__module__.startswith("transformers")


def _norm(module, x, weight, bias):
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)
    if _is_llama_rms_norm(module):
        return sliced.llama_rms_norm(x, weight, module.variance_epsilon)
    return F.rms_norm(x, module.normalized_shape, weight, module.eps)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ctl, module):
        ctx.save_for_backward(x, weight, bias)
        ctx.ctl, ctx.module = ctl, module
        ctx.autocast = _autocast_dtype(x.device.type)  # dX is recomputed under the same casts
        return _norm(module, x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            # torch's own backward of the same op, with the parameters as constants: dX bit
            # for bit as the unmodified module's (tests/test_chunkft.py).
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=ctx.autocast or torch.bfloat16,
                                                      enabled=ctx.autocast is not None):
                leaf = x.detach().requires_grad_()
                out = _norm(ctx.module, leaf, weight.detach() if weight is not None else None,
                            bias.detach() if bias is not None else None)
                (dx,) = torch.autograd.grad(out, leaf, dy)
        ctx.ctl._norm_step(ctx.module, x, dy)
        return dx, None, None, None, None


class ChunkFT(torch.optim.Optimizer):
    """Full-parameter fine-tuning over a rotating working set of sub-tensors.

    Every trainable parameter of ``model`` (``named_parameters()`` order) joins one byte
    stream (its bytes plus its optimizer state's in ``state_format``), cut into
    ``chunks`` equal budgets (``plan.plan_chunks``); ``split`` cuts nn.Linear weights
    into row ("rows") or column ("cols") ranges, 1-D tensors and embeddings always along
    dim 0. At optimizer step t (0-based) the active chunk is ``(t // switch_every) mod
    chunks`` (``order="cyclic"``), or that position of a permutation of the chunks drawn
    per cycle from ``seed`` (``"random"``). Only the active chunk's slices are stepped.

    Optimizer state is kept per (tensor, chunk), created (zero, the rule's initial
    value) on the chunk's first visit and kept across cycles, with its own step count:
    the steps in which that slice was stepped (``slice_steps``), so bias corrections are
    right for every slice, one whose module did not run in a step (a branch not taken,
    an expert given no tokens) included, as torch.optim skips a parameter whose ``.grad``
    is None. ``state_store="host"`` moves an
    inactive chunk's state to host memory (pinned when CUDA is available) in its own
    format, losslessly; ``prefetch=True`` copies the next chunk's state back to the device
    as soon as a step ends (``state_store.ChunkStates``).

    ``process_group``: data parallelism. Each rank runs the same model on its own batch;
    the active slices' fp32 gradients are averaged over the group (as DDP averages) and
    stepped by the rule's epilogue (``data_parallel``). ``shards``: tensor parallelism,
    {parameter name: WeightSlice} placing this rank's local nn.Linear weight (or bias,
    as one row) in the global tensor; the chunks are planned on the global shapes and
    each rank steps their intersection with its shard (``shards``).

    The learning rate is ``param_groups[0]["lr"]`` (initially ``rule.lr``), copied into
    ``rule.lr`` at every step, so a torch LR scheduler built on this object and stepped
    once per ``step()`` drives it per optimizer step.

    Not supported: gradient clipping (no ``.grad`` is ever filled, so
    ``torch.nn.utils.clip_grad_norm_`` finds no gradient, returns 0 and clips nothing;
    each slice is stepped inside the backward, before any norm over the model could be
    known) and gradient accumulation over micro-batches (every ``step()`` steps the
    active chunk on its own closure's batch; a backward outside ``step()`` is refused).
    """

    def __init__(self, model, rule, chunks, switch_every=1, split="rows", order="cyclic", state_store="device",
                 seed=0, *, state_format="fp32", rounding=None, config=None, process_group=None, shards=None,
                 prefetch=False):
        if process_group is not None:
            data_parallel.check_group(process_group)
        self._group = process_group
        # A refusal on one rank is a refusal on every rank, before the collectives below.
        with refused_together(process_group, "ChunkFT"):
            _check_arguments(model, rule, switch_every, split, order, state_store, rounding, config, prefetch)
            self.model, self.rule, self.chunks, self.switch_every = model, rule, chunks, switch_every
            self.split, self.order, self.state_store, self.seed = split, order, state_store, check_seed(seed)
            self.state_format, self.rounding, self.config = state_format, rounding, config
            self._plan_for(shards)
        self._seeds = {name: tensor_seed(self.seed, i) for i, name in enumerate(self._params)}
        self._module_params = {}
        for name, (module, attr) in self._owner.items():
            self._module_params.setdefault(module, {})[attr] = name
        self._t = 0
        self._visits = [0] * chunks
        self._steps = {}  # (name, chunk) -> the steps that slice was stepped in
        self._stepped = set()  # the keys stepped in the running backward
        self._states = ChunkStates(prefetch)
        self._phase = None
        self._forwarded = set()
        self._removed = False
        if process_group is not None:  # before the model is touched: a refusal leaves it as it was
            # The initial learning rate too: ranks stepping at other rates would drift apart.
            data_parallel.check_same_on_every_rank(self._describe() | {"lr": rule.lr}, process_group)
            data_parallel.check_same_weights(self._params, process_group)
        super().__init__(list(self._params.values()), {"lr": rule.lr})
        self._hooks = [param.register_hook(self._outside_gradient(name)) for name, param in self._params.items()]
        for module in self._module_params:
            module.forward = _forward_of(self, module)

    def _plan_for(self, shards):
        """The trainable parameters, their shards' placements, the global plan and this
        rank's part of it."""
        self._params, self._owner = _trainable(self.model)
        self._placements = shard_plan.placements(self._params, {} if shards is None else shards,
                                                 self.state_format == "q8")
        sharded = sorted(name for name in (shards or {}) if not isinstance(self._owner[name][0], nn.Linear))
        if sharded:
            raise ValueError(f"shards names {sharded}: ChunkFT steps shards of nn.Linear weights and biases only "
                             "(a vocabulary-parallel embedding or a sharded norm is not supported)")
        embeddings = {name for name, (module, _) in self._owner.items() if isinstance(module, nn.Embedding)}
        global_tensors = [(name, shard_plan.global_tensor(p, self._placements[name]))
                          for name, p in self._params.items()]
        self._costs = tensor_costs(global_tensors, self.rule, self.state_format, self.split, along_rows=embeddings)
        self._plan = plan_chunks(self._costs, self.chunks)
        # The plan is global; what this rank steps is each piece's part inside its shard.
        self._by_name = []
        for pieces in self._plan:
            local = {}
            for piece in pieces:
                part = shard_plan.local_piece(piece, self._params[piece.name], self._placements[piece.name])
                if part is not None:
                    local[piece.name] = part
            self._by_name.append(local)

    # ----- the schedule -------------------------------------------------------------
    def chunk_at(self, t: int) -> int:
        """The chunk active at optimizer step ``t`` (0-based)."""
        block = t // self.switch_every
        position, cycle = block % self.chunks, block // self.chunks
        if self.order == "cyclic":
            return position
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + cycle) % 2**63)
        return int(torch.randperm(self.chunks, generator=generator)[position])

    @property
    def active_chunk(self) -> int:
        return self.chunk_at(self._t)

    @property
    def steps_taken(self) -> int:
        return self._t

    @property
    def chunk_steps(self) -> tuple:
        """Steps taken while each chunk was active (its visits). The rule's step counts are
        per slice: ``slice_steps``."""
        return tuple(self._visits)

    def slice_steps(self, index: int) -> dict:
        """{parameter name: steps} of chunk ``index``'s slices: the rule's step count of
        each, the steps in which its module ran and stepped it."""
        self._check_index(index)
        return {name: self._steps.get((name, index), 0) for name in self._by_name[index]}

    def _check_index(self, index):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.chunks:
            raise ValueError(f"chunk index must be in [0, {self.chunks}), got {index!r}")

    def chunk_slices(self, index: int) -> list:
        """Chunk ``index`` as a list of (parameter name, dim, start, stop), in global
        indices (under tensor parallelism: of the unsharded tensors)."""
        self._check_index(index)
        return [piece.as_tuple() for piece in self._plan[index]]

    def local_slices(self, index: int) -> list:
        """The part of chunk ``index`` this rank steps, in its local tensors' indices (the
        same as ``chunk_slices`` without ``shards``)."""
        self._check_index(index)
        return [piece.as_tuple() for piece in self._by_name[index].values()]

    def chunk_state(self, index: int) -> dict:
        """{parameter name: state dict} of chunk ``index`` (empty before its first visit)."""
        self._check_index(index)
        states = self._states.readable()
        return {name: states[(name, index)] for name in self._by_name[index] if (name, index) in states}

    def state_bytes(self) -> dict:
        """{"device": bytes, "host": bytes}: the optimizer state held, by where it lives."""
        return self._states.nbytes()

    def reduced_bytes(self, index: int) -> int:
        """Bytes this rank all-reduces when chunk ``index`` steps under data parallelism:
        its local slices' elements, as fp32 (0 without a process group)."""
        self._check_index(index)
        if self._group is None:
            return 0
        return 4 * sum(_numel(self._params[name].shape, piece) for name, piece in self._by_name[index].items())

    @property
    def prefetched_chunk(self):
        """The chunk whose state was copied to the device ahead of its step (None: none)."""
        return self._states.prefetched

    # ----- stepping -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: ``closure()`` runs the forward and returns the loss (it must
        not call backward); the backward then runs here and steps the active chunk."""
        if closure is None:
            raise TypeError("ChunkFT.step needs a closure that runs the forward and returns the loss: the "
                            "active chunk is stepped inside the backward")
        if self._removed:
            raise RuntimeError("ChunkFT.step after remove(): the model runs its own forwards again, so no "
                               "backward would step a chunk; build a new ChunkFT to train with it")
        self.rule.lr = self.param_groups[0]["lr"]
        chunk = self.active_chunk
        self._activate(chunk)
        self._phase, self._forwarded = "forward", set()
        try:
            with torch.enable_grad():
                loss = closure()
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise TypeError("the closure must return the loss as a tensor that requires grad (run the "
                                "forward under grad mode; do not call backward in it)")
            self._phase = "backward"
            with torch.enable_grad():
                loss.backward()
            for key in self._stepped:  # counted once the whole backward has run
                self._steps[key] = self._steps.get(key, 0) + 1
        finally:
            self._phase, self._forwarded, self._stepped = None, set(), set()
        self._visits[chunk] += 1
        self._t += 1
        following = self.active_chunk
        if self.state_store == "host" and following != chunk:
            self._states.offload(self._keys(chunk))
            if self._states.prefetch:
                self._states.prefetch_chunk(following, self._keys(following), self._device_of)
        return loss.detach()

    def _keys(self, chunk):
        return [(name, chunk) for name in self._by_name[chunk]]

    def _device_of(self, key):
        return self._params[key[0]].device

    def _activate(self, chunk):
        for name, piece in self._by_name[chunk].items():
            param = self._params[name]
            key = (name, chunk)
            if key not in self._states:
                self._states.put(key, self.rule.init_state(
                    torch.empty(_state_shape(param.shape, piece), dtype=param.dtype, device=param.device),
                    state_format=self.state_format))
        self._states.to_device(self._keys(chunk), self._device_of)
        self._states.prefetched = None

    def _active_piece(self, module, attr):
        name = self._module_params[module].get(attr)
        if name is None:
            return None, None
        if self._phase != "backward":
            raise RuntimeError(f"a backward reached ChunkFT parameter {name!r} outside ChunkFT.step: ChunkFT "
                               "steps the active chunk inside the backward that step() runs")
        return name, self._by_name[self.active_chunk].get(name)

    def _kernel_args(self, name, piece):
        key = (name, self.active_chunk)
        self._stepped.add(key)
        place = shard_plan.kernel_slice(piece, self._params[name], self._placements[name])
        return dict(rule=self.rule, step=self._steps.get(key, 0) + 1, config=self.config, rounding=self.rounding,
                    seed=self._seeds[name], weight_slice=place), self._states.get(key)

    def _reduced(self, grad):
        """The slice's gradient as the rule must see it: averaged over the data-parallel group."""
        return grad if self._group is None else data_parallel.average_over_ranks(grad, self._group)

    def _linear_step(self, module, x, dy):
        name, piece = self._active_piece(module, "weight")
        if piece is not None:
            weight = self._params[name].detach()
            kwargs, state = self._kernel_args(name, piece)
            s, e = piece.start, piece.stop
            rows = piece.dim == 0
            operands = (x, dy[:, s:e]) if rows else (x[:, s:e], dy)
            target = weight[s:e] if rows else weight[:, s:e].contiguous()
            if self._group is None:
                fused_weight_update(*operands, target, state, **kwargs)
            else:  # the oracle path on the averaged gradient: the fused step's bits on one rank's gradient
                apply_rule(self._reduced(weight_gradient(*operands, config=self.config)), target, state, **kwargs)
            if not rows:
                weight[:, s:e].copy_(target)
        self._vector_step(module, "bias", lambda s, e: sliced.bias_grad(dy.float(), s, e))

    def _embedding_step(self, module, indices, dy):
        name, piece = self._active_piece(module, "weight")
        if piece is None:
            return
        weight = self._params[name].detach()
        s, e = piece.start, piece.stop
        grad = sliced.embedding_weight_grad(indices, dy.float(), s, e, padding_idx=module.padding_idx,
                                            scale_grad_by_freq=module.scale_grad_by_freq)
        kwargs, state = self._kernel_args(name, piece)
        apply_rule(self._reduced(grad.contiguous()), weight[s:e], state, **kwargs)

    def _norm_step(self, module, x, dy):
        dy32 = dy.float()
        if _is_llama_rms_norm(module):  # x̂ is rounded to the input's dtype before the weight multiplies it
            self._vector_step(module, "weight", lambda s, e: sliced.norm_weight_grad(
                x, dy32, s, e, "llama_rms_norm", module.variance_epsilon))
            return
        kind = "layer_norm" if isinstance(module, nn.LayerNorm) else "rms_norm"
        # ε from the input's dtype before the float32 copy: torch's default depends on it.
        eps = module.eps if kind == "layer_norm" else sliced.rms_norm_eps(module.eps, x.dtype)
        x32 = x.float()
        self._vector_step(module, "weight", lambda s, e: sliced.norm_weight_grad(x32, dy32, s, e, kind, eps))
        self._vector_step(module, "bias", lambda s, e: sliced.bias_grad(dy32, s, e))

    def _vector_step(self, module, attr, gradient):
        """Step the active slice of a 1-D parameter, stepped as one row: (1, n) at column start."""
        name, piece = self._active_piece(module, attr)
        if piece is None:
            return
        param = self._params[name].detach()
        s, e = piece.start, piece.stop
        kwargs, state = self._kernel_args(name, piece)
        apply_rule(self._reduced(gradient(s, e).reshape(1, e - s).contiguous()), param[s:e].view(1, e - s), state,
                   **kwargs)

    def _outside_gradient(self, name):
        def refuse(grad):
            if grad is None:  # the module's own backward reports "no gradient" to the hook
                return None
            raise RuntimeError(f"a gradient reached ChunkFT parameter {name!r} from a use outside its module; "
                               "ChunkFT steps parameters only through their own module's backward")
        return refuse

    def _on_forward(self, module):
        if self._phase == "forward":
            if module in self._forwarded:
                names = sorted(self._module_params[module].values())
                raise RuntimeError(f"module owning {names} ran twice in one ChunkFT step: its slice would be "
                                   "stepped twice (reused modules are not supported)")
            self._forwarded.add(module)

    # ----- checkpoints --------------------------------------------------------------
    def _describe(self) -> dict:
        """What a checkpoint must match to resume bit for bit: the rule and its settings but
        its learning rate (a scheduler's; the checkpoint restores its own), the rounding
        and the tile config (None named as what it means), the plan and the schedule."""
        settings = shown_hyperparameters(recorded_hyperparameters(self.rule))  # as fused checkpoints: 0 is 0.0
        described = {"rule": f"{type(self.rule).__name__}({settings})", "chunks": self.chunks,
                     "switch_every": self.switch_every, "split": self.split, "order": self.order, "seed": self.seed,
                     "state_format": self.state_format, "rounding": self.rounding or "stochastic",
                     "config": repr(self.config or PINNED),
                     "plan": [[list(piece.as_tuple()) for piece in pieces] for pieces in self._plan]}
        placed = {name: [p.row_start, p.col_start, list(p.global_shape)] for name, p in self._placements.items()
                  if p.global_shape != _as_row(self._params[name])}
        return described | ({"shards": placed} if placed else {})

    def state_dict(self) -> dict:
        """Schedule position, each chunk's visits, each (tensor, chunk) slice's step count
        and state (copies), the learning rate, with the configuration they belong to."""
        return {"config": self._describe(), "position": self._t, "chunk_steps": list(self._visits),
                "steps": {f"{name}@{chunk}": count for (name, chunk), count in self._steps.items()},
                "lr": self.param_groups[0]["lr"],
                "state": {f"{name}@{chunk}": {slot: t.clone() for slot, t in state.items()}
                          for (name, chunk), state in self._states.readable().items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict()``: the next step is the one the saved run took next, bit
        for bit (with the model's own ``load_state_dict`` for the weights). A checkpoint of
        another configuration (the rule or its settings, its lr excepted; rounding, tile
        config, chunks, plan, schedule, seed, format) is refused, naming what differs, and
        so is one saved before per-slice step counts (its per-chunk counts cannot say
        which slices a step skipped)."""
        if "steps" not in state_dict:
            raise ValueError("ChunkFT checkpoint without per-slice step counts ('steps'): saved before ChunkFT "
                             "counted each (tensor, chunk) slice's steps, its counts are per chunk and cannot be "
                             "resumed exactly; refused")
        ours, theirs = self._describe(), state_dict.get("config", {})
        differing = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differing:
            # the plan and the shards are long: their names say enough
            shown = "; ".join(f"{k}: checkpoint {theirs.get(k)!r}, here {ours.get(k)!r}" for k in differing
                              if k not in ("plan", "shards"))
            raise ValueError(f"ChunkFT checkpoint of another configuration: {differing} differ"
                             f"{' (' + shown + ')' if shown else ''}; refused")
        states = {self._slice_key(key): {slot: t.clone() for slot, t in state.items()}
                  for key, state in state_dict["state"].items()}
        steps = {self._slice_key(key): int(count) for key, count in state_dict["steps"].items()}
        self._states.replace(states)
        self._steps = steps
        self._t = int(state_dict["position"])
        self._visits = [int(s) for s in state_dict["chunk_steps"]]
        self.param_groups[0]["lr"] = state_dict["lr"]
        for chunk in range(self.chunks):
            if self.state_store == "host":
                self._states.offload(self._keys(chunk))
            else:
                self._states.to_device(self._keys(chunk), self._device_of)

    def _slice_key(self, key: str) -> tuple:
        """A checkpoint's "name@chunk" as (name, chunk); refused unless it is a slice here."""
        name, _, chunk = key.rpartition("@")
        if name not in self._params or not chunk.isdigit() or int(chunk) >= self.chunks \
                or name not in self._by_name[int(chunk)]:
            raise ValueError(f"ChunkFT checkpoint has state or a step count for {key!r}, which is no (tensor, "
                             "chunk) here")
        return name, int(chunk)

    def remove(self) -> None:
        """Give the model back its own forwards and drop ChunkFT's gradient hooks; ``step`` is then
        refused."""
        for module in self._module_params:
            module.__dict__.pop("forward", None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._removed = True


def _check_arguments(model, rule, switch_every, split, order, state_store, rounding, config, prefetch):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("ChunkFT reduces the active chunk's gradients itself: pass the unwrapped module "
                         "(ddp.module) with process_group=<the data-parallel group>, not a "
                         "DistributedDataParallel wrapper (its hooks wait for .grad, which ChunkFT never fills)")
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a forge_kernels Rule, got {type(rule).__name__}")
    if isinstance(switch_every, bool) or not isinstance(switch_every, int) or switch_every < 1:
        raise ValueError(f"switch_every must be a positive integer, got {switch_every!r}")
    for name, value, allowed in (("split", split, SPLITS), ("order", order, ORDERS),
                                 ("state_store", state_store, STATE_STORES),
                                 ("rounding", rounding, (None, *ROUNDINGS))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if config is not None and not isinstance(config, TileConfig):
        raise TypeError(f"config must be a forge_kernels.TileConfig, got {type(config).__name__}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
    if prefetch and state_store != "host":
        raise ValueError("prefetch=True copies the next chunk's state from the host: it needs state_store='host'")


def _forward_of(ctl, module):
    params = ctl._module_params[module]

    def forward(input):
        active = torch.is_grad_enabled() and any(ctl._params[n].requires_grad for n in params.values())
        if active:
            ctl._on_forward(module)
        if isinstance(module, nn.Linear):
            if not active:
                return F.linear(input, module.weight, module.bias)
            return _LinearFunction.apply(input, module.weight, module.bias, ctl, module)
        if isinstance(module, nn.Embedding):
            if not active:
                return F.embedding(input, module.weight, module.padding_idx, None, module.norm_type,
                                   module.scale_grad_by_freq, False)
            return _EmbeddingFunction.apply(input, module.weight, ctl, module)
        bias = getattr(module, "bias", None)
        if not active:
            return _norm(module, input, module.weight, bias)
        return _NormFunction.apply(input, module.weight, bias, ctl, module)
    return forward


def _as_row(param) -> tuple:
    return (1, param.shape[0]) if param.dim() == 1 else tuple(param.shape)


def _numel(shape, piece) -> int:
    return (piece.stop - piece.start) * (shape[1 - piece.dim] if len(shape) == 2 else 1)


def _state_shape(shape, piece) -> tuple:
    """The 2-D shape a slice is stepped as: its rows or columns, a 1-D range as one row."""
    if len(shape) == 1:
        return (1, piece.stop - piece.start)
    if piece.dim == 0:
        return (piece.stop - piece.start, shape[1])
    return (shape[0], piece.stop - piece.start)


def _trainable(model):
    """(name → Parameter, name → (module, attribute)) of the trainable parameters, in
    ``named_parameters()`` order; raises naming every one ChunkFT cannot slice."""
    owner = {}
    problems = []
    seen = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad and id(param) in seen:
            problems.append(f"{name!r} (the same tensor as {seen[id(param)]!r}: tied parameters are not supported)")
        seen.setdefault(id(param), name)
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            kind = type(module)
            llama_norm = _is_llama_rms_norm(module)
            if kind not in _SUPPORTED and not llama_norm:
                problems.append(f"{name!r} ({kind.__name__}: ChunkFT slices parameters of {_SUPPORTED_NAMES} "
                                "only, not subclasses)")
                continue
            attributes = ("weight",) if llama_norm else _ATTRIBUTES[kind]
            if attr not in attributes:
                problems.append(f"{name!r} (a parameter {kind.__name__} does not have of its own: ChunkFT steps "
                                f"{' and '.join(attributes)} only)")
                continue
            if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
                problems.append(f"{name!r} (Embedding with max_norm or sparse=True)")
                continue
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and len(module.normalized_shape) != 1:
                problems.append(f"{name!r} ({kind.__name__} over {len(module.normalized_shape)} dims: "
                                "one normalized dim only)")
                continue
            if param.dtype not in (torch.float32, torch.bfloat16):
                problems.append(f"{name!r} ({param.dtype}: the kernels step float32 or bfloat16 parameters)")
                continue
            if not param.is_contiguous():
                problems.append(f"{name!r} (not contiguous: it is written in place)")
                continue
            owner[name] = (module, attr)
    if problems:
        raise ValueError("ChunkFT cannot train these parameters: " + "; ".join(problems))
    params = {name: param for name, param in model.named_parameters() if param.requires_grad}
    return params, owner
