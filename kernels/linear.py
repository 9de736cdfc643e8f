"""Model integration: ``ForgeLinear`` and ``fuse``.

A ForgeLinear's backward computes dX (and db) as usual, then updates its own weight
in place through the fused kernel: one optimizer step per backward, counted in the
layer's ``forge_step`` buffer. No weight gradient is returned (``weight.grad`` stays
None), so an ordinary optimizer over ``model.parameters()`` skips fused weights;
biases get ordinary gradients and are left to that optimizer.

A backward makes no device-to-host synchronization to launch its step: the step
number and rounding seed come from host-side copies of the buffers, and the
non-finite checks run on the device. With ``report="raise"`` (default) the backward
then reads the step's outcome once and raises as ``fused_weight_update`` does; with
``report="defer"`` it does not wait at all, and the outcome is checked at the layer's
next step, at ``layer.forge_check()`` / ``fk.check_updates(model)``, or when the
layer's ``state_dict()`` is taken or the layer is deep-copied.

Tensor parallelism: a layer whose weight is a DTensor (``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``, applied *before* ``fuse``) runs its forward
and dX on DTensors as plain PyTorch TP does, and steps its local shard with local
operands that cover every token (``tensor_parallel``). Explicit-collective
(Megatron-style) layers are in ``parallel_linear``.
"""

import json
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import q8
from .config import TileConfig
from .errors import NonFiniteUpdateError, reword
from .hf import is_conv1d
from .ops.fused_weight_update import ROUNDINGS, apply_rule, check_input_check, check_report, fused_weight_update
from .ops.stochastic_round import check_seed, stream_seed
from .rules.base import STATE_FORMATS, Rule, recorded_hyperparameters, shown_hyperparameters
from .tensor_parallel import check_input_layout, is_dtensor, local_operands, local_weight
from .tensor_parallel import weight_slice as weight_slice_of
from .weight_slice import WeightSlice

_STATE_PREFIX = "forge_state_"
# nn.Module's key for get_extra_state (torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX).
_EXTRA_STATE_KEY = "_extra_state"
# What from_linear carries over besides the parameters, so that hooks installed on the
# Linear (parallelize_module's layout hooks above all) keep acting on the fused layer.
_MODULE_HOOK_REGISTRIES = tuple(name for name in vars(nn.Module()) if "hook" in name)


class _PendingUse:
    """Marks one forward whose backward has not run; dies with the autograd graph.
    ``weight_version``: the weight's version counter at the forward. ``replay``: a
    forward run again by activation checkpointing for its saved tensors, which takes no
    step."""

    __slots__ = ("__weakref__", "consumed", "weight_version", "replay")

    def __init__(self, weight_version, replay=False):
        self.consumed = False
        self.weight_version = weight_version
        self.replay = replay


# Why a layer whose own update failed is stopped (forge_stop).
MIXED_STEPS = "a non-finite update left some tiles unstepped: weight and state at mixed steps"


def _bad_counter_or_exponents(entries) -> str:
    """What is wrong with the values of a checkpoint's step count and q8 block exponents
    (``entries``: a layer's own entries by name), or "": a negative or fractional
    ``forge_step``, exponents outside the q8 format's [MIN_EXPONENT, MAX_EXPONENT] (the
    kernel would decode -127 as 0 and -128 as -inf, where the host decodes 2**-127·m)."""
    problems = []
    step = entries.get("forge_step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and (step.is_floating_point() or int(step) < 0):
        problems.append(f"forge_step {step.item()} is not a step count (an integer >= 0)")
    for name, tensor in sorted(entries.items()):
        if name.endswith(q8.EXPONENT_SUFFIX) and isinstance(tensor, torch.Tensor) and tensor.numel():
            if tensor.is_floating_point():
                problems.append(f"{name} is {tensor.dtype}; q8 block exponents are int8")
                continue
            low, high = int(tensor.min()), int(tensor.max())
            if low < q8.MIN_EXPONENT or high > q8.MAX_EXPONENT:
                problems.append(f"{name} holds exponents in [{low}, {high}], outside the q8 format's "
                                f"[{q8.MIN_EXPONENT}, {q8.MAX_EXPONENT}]")
    return "; ".join(problems)


class ForgeLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, use):
        y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        # Under autocast y (and so dY) can differ in dtype from x: keep x as the matmul
        # saw it, so the kernel gets activations and output gradients of one dtype.
        ctx.save_for_backward(x.to(y.dtype), weight)
        ctx.layer = layer
        ctx.use = use
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.use.replay:
            # Only a backward inside the checkpointed function reaches a replayed forward's graph.
            raise RuntimeError(f"a backward ran through fused layer {ctx.layer.forge_name!r} as activation "
                               "checkpointing recomputed it (a backward inside the checkpointed function, or a "
                               "layer called both inside a use_reentrant=True region and outside it?): its weight "
                               "would be stepped a second time")
        # Checked before unpacking: the weight's bumped version would otherwise raise a
        # less helpful autograd error for the same mistake.
        if ctx.use.consumed:
            raise RuntimeError(f"backward ran twice through fused layer {ctx.layer.forge_name!r} "
                               "(retain_graph?): its weight would be stepped twice")
        # Unpacked while the use is still pending, so that the forward replay this may start
        # (torch.utils.checkpoint with use_reentrant=False) knows it for one.
        x, weight = ctx.saved_tensors
        ctx.use.consumed = True
        ctx.layer._pending.discard(ctx.use)
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        # dX is computed above, from the weights this forward used; only now step them.
        layer = ctx.layer
        try:
            (layer.forge_backward or ForgeLinear._apply_step)(layer, x.reshape(-1, x.shape[-1]), dy2)
        except (TypeError, ValueError) as error:
            # The launchers' argument checks ("x is torch.float64; ...") know no layer; the
            # non-finite errors are named in _apply_step already, with their step.
            named = f"fused layer {layer.forge_name!r}"
            if not (error.args and isinstance(error.args[0], str) and named in error.args[0]):
                reword(error, f"{named}, in its backward: ", "")
            raise
        return dx, None, db, None, None


class ForgeLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is updated by ``rule`` inside its backward.

    ``rule`` is shared by reference: ``rule.lr = 3e-4`` takes effect at the next
    backward. The rule's state, the step count and the rounding seed are buffers
    (``forge_state_<slot>``, with ``forge_state_<slot>_exponent`` for q8 state;
    ``forge_step``; ``forge_seed``) so they travel with ``state_dict()``.

    ``forge_step`` and ``forge_seed`` are written by the layer; a step launches from
    host-side copies of them (reading a GPU buffer would synchronize), which are read
    back from the buffers only when a buffer has been replaced (``.to()``,
    ``load_state_dict(assign=True)``) or written in place (``load_state_dict``,
    ``fill_``), as the buffer's autograd version counter shows. A write the counter
    does not see (through ``.data``, or into the storage) is not picked up.

    The input's dtype must be the weight's, as for ``nn.Linear`` (a RuntimeError naming
    the layer otherwise), unless ``torch.autocast`` is on for its device.

    Activation checkpointing (``torch.utils.checkpoint``, reentrant or not) works: a
    forward with grad inside a backward is its replay. A non-reentrant replay of a call
    whose backward is pending only recomputes the saved tensors (its graph steps nothing);
    a reentrant one is the call that steps. Either is refused when the weight has changed
    since the forward it replays (a layer in two checkpointed regions, or a region
    backwarded in parts), since its activations would not be that forward's.

    A checkpoint (``state_dict()``) of the layer holds ``weight`` and ``bias``, the
    state buffers, ``forge_step``, ``forge_seed`` and ``_extra_state``: the rule's class
    name and its hyperparameters but the learning rate, as UTF-8 JSON in a uint8 tensor
    (``{"rule": "AdamW", "hyperparameters": {"betas": [0.9, 0.999], "eps": 1e-08,
    "weight_decay": 0.01}}``), so that checkpoints stay all tensors
    (``torch.load(weights_only=True)``, bitwise comparisons). The learning rate is left
    out because schedulers own it (``fk.Trainer`` keeps it in its optimizer's state). The
    state format is the state tensors' own dtype (fp32, bf16, q8 codes).
    ``load_state_dict`` refuses a checkpoint of this layer whose state format, slots,
    rule or hyperparameters are not the layer's (a bf16 layer loading fp32 state would
    round it in silence, an Adam layer would take AdamW's state, an AdamW layer would go
    on from other betas' moments), with a RuntimeError naming the layer and both, the
    differing hyperparameters by name; the layer is then left as it was. A checkpoint
    without the hyperparameters (written before they were recorded) cannot be checked
    and is refused too, its format and slots checked first; the error says how to give it
    the layer's record (``checkpoint[key] = layer.get_extra_state()``), which is also how
    to go on with other hyperparameters on purpose. A checkpoint without any of the
    layer's fused entries (a plain ``nn.Linear`` checkpoint, ``strict=False``) loads its
    weight and bias.

    ``report``: ``"raise"`` (default) checks each step at the end of its backward, one
    device-to-host synchronization, and raises there; ``"defer"`` takes the step with
    no synchronization and checks it later (``forge_check``). A deferred step counts in
    ``forge_step`` once it is checked and found clean; one whose inputs were
    non-finite wrote nothing and does not count; one with non-finite tiles stops the
    layer as in ``"raise"`` mode (``forge_accept_partial_step``).

    ``input_check``: ``"step"`` (default) scans x and dY before each fused step, and a
    non-finite element skips the whole step (``NonFiniteInputError``); ``"tiles"`` skips
    that scan, a read of x and dY, and leaves such an element to the tiles whose sums it
    makes non-finite: they are not written, the others step, the step raises
    ``NonFiniteUpdateError`` and the layer stops as for any failed tile
    (``fused_weight_update``'s ``input_check``). It applies to the fused steps of plain
    backwards, ``fk.Trainer`` without clipping or with previous-norm clipping by tile
    sums, and ``fk.CapturedStep`` likewise (read when the graph is recorded); steps that
    scan anyway keep their scan: exact clipping's norm pass, a materialized gradient
    (``gradients="materialized"``, ``norm="gradient"``, the data-parallel bucket path).
    ``fk.Trainer`` refuses it with fused gradient accumulation.
    """

    def __init__(self, in_features, out_features, bias=True, *, rule, oracle=False, config=None,
                 state_format="fp32", rounding=None, seed=0, weight_slice=None, report="raise", device=None,
                 dtype=None, input_check="step"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_forge(rule, oracle, config, state_format, rounding, seed, weight_slice=weight_slice,
                         report=report, input_check=input_check)
        self._hook_weight()

    @classmethod
    def from_linear(cls, linear: nn.Linear, rule, *, oracle=False, config=None, state_format="fp32",
                    rounding=None, seed=0, name=None, weight_slice=None, report="raise", input_check="step"):
        """A ForgeLinear that takes over ``linear``'s own Parameter objects (no copy) and
        its module hooks (e.g. the input/output layout hooks of ``parallelize_module``)."""
        layer = cls._unhooked_from_linear(linear, rule, oracle=oracle, config=config, state_format=state_format,
                                          rounding=rounding, seed=seed, name=name, weight_slice=weight_slice,
                                          report=report, input_check=input_check)
        layer._hook_weight()
        return layer

    @classmethod
    def _unhooked_from_linear(cls, linear: nn.Linear, rule, **options):
        """``from_linear`` without the hook on the weight (``_hook_weight``): ``fuse`` adds
        the hooks once every layer is built, so that a refused layer leaves none behind on
        the model's weights."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        for attr in _MODULE_HOOK_REGISTRIES:
            setattr(layer, attr, getattr(linear, attr))
        layer._init_forge(rule, **options)
        return layer

    def _init_forge(self, rule, oracle=False, config=None, state_format="fp32", rounding=None, seed=0, name=None,
                    weight_slice=None, report="raise", input_check="step"):
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a forge_kernels Rule, got {type(rule).__name__}")
        if config is not None and not isinstance(config, TileConfig):
            raise TypeError(f"config must be a TileConfig, got {type(config).__name__}")
        if self.weight.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"fused layers keep float32 or bfloat16 weights; got {self.weight.dtype}")
        if rounding not in (None, *ROUNDINGS):
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if weight_slice is not None and not isinstance(weight_slice, WeightSlice):
            raise TypeError(f"weight_slice must be a WeightSlice, got {type(weight_slice).__name__}")
        if weight_slice is not None and is_dtensor(self.weight):
            raise ValueError("a DTensor weight knows its place in the global weight; pass no weight_slice")
        self.rule, self.oracle, self.config, self.rounding = rule, bool(oracle), config, rounding
        self.report = check_report(report)
        self.input_check = check_input_check(input_check, config)
        self.weight_slice = weight_slice if weight_slice is not None else (
            weight_slice_of(self.weight) if is_dtensor(self.weight) else None)
        self.forge_name = name or "ForgeLinear"
        self._pending = weakref.WeakSet()
        # The weight's version counter at the last forward: a checkpointed forward's replay
        # must find the weight unchanged.
        self._forward_version = None
        # A step that stopped the layer, and why (forge_stop); None while it is healthy.
        self._failed_step = None
        self._failed_reason = None
        # The unchecked step of report="defer": (UpdateReport, step, advance), or None.
        self._unchecked = None
        # A training driver (forge_kernels.training) may take over what the backward does
        # with (x, dY): ``forge_backward(layer, x2d, dy2d)`` replaces the plain step.
        self.forge_backward = None
        # The CapturedStep (forge_kernels.capture) whose graph takes this layer's steps, if any.
        self.forge_owner = None
        # parallelize_module replaces the Parameter by a DTensor: one applied after fuse
        # leaves the state sized and placed for the whole weight.
        self._fused_on_dtensor = is_dtensor(self.weight)
        weight = local_weight(self.weight.detach())
        state = rule.init_state(weight, state_format=state_format)
        self._state_keys = tuple(state)
        for key, tensor in state.items():
            self.register_buffer(_STATE_PREFIX + key, tensor)
        self.register_buffer("forge_step", torch.zeros((), dtype=torch.int64, device=weight.device))
        # The stochastic-rounding stream is part of the training state: a resumed run
        # must draw the same bits.
        self.register_buffer("forge_seed", torch.tensor(check_seed(seed), dtype=torch.int64, device=weight.device))
        self._counters_read = (self._counter_sources(), 0, check_seed(seed))

    def _hook_weight(self):
        # The fused path returns no weight gradient; any gradient that reaches the weight
        # comes from a use outside this layer and would be a second, unfused step.
        self.weight.register_hook(self._refuse_outside_gradient)

    def _counter_sources(self) -> tuple:
        return self.forge_step, self.forge_step._version, self.forge_seed, self.forge_seed._version

    def _counters_current(self) -> bool:
        """True when the buffers are those last read (or written) and unwritten since."""
        known = self._counters_read
        if known is None:
            return False
        sources = self._counter_sources()
        return known[0][0] is sources[0] and known[0][2] is sources[2] and known[0][1::2] == sources[1::2]

    def _counters(self) -> tuple:
        """(forge_step, forge_seed) as Python ints, without reading the buffers (a
        synchronization on a GPU) unless they were replaced or written in place since
        they were last read."""
        if not self._counters_current():
            self._counters_read = (self._counter_sources(), int(self.forge_step), int(self.forge_seed))
        return self._counters_read[1], self._counters_read[2]

    def _set_step(self, step: int):
        seed = self._counters()[1]
        self.forge_step.fill_(step)  # asynchronous on a GPU
        self._counters_read = (self._counter_sources(), step, seed)

    def _apply(self, fn, *args, **kwargs):
        current = self._counters_current()
        module = super()._apply(fn, *args, **kwargs)
        if current:
            # .to(), .cuda(), .half() and the like move or convert tensors; integer buffers
            # keep their values, so the host copies stay right for the new buffers.
            self._counters_read = (self._counter_sources(), *self._counters_read[1:])
        return module

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A checkpoint holds checked steps only: an unchecked one would be counted wrong.
        self.forge_check()
        if self._failed_step is not None:
            # forge_step does not name the state it is in; a checkpoint of it would load as
            # a healthy layer.
            raise RuntimeError(
                f"fused layer {self.forge_name!r} stopped at step {self._failed_step} ({self._failed_reason}): call "
                "forge_accept_partial_step() first to checkpoint it as it is, or restore a checkpoint")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def __getstate__(self):
        # A deep copy holds checked steps only (and no CUDA event), and is nobody's
        # captured layer: the CapturedStep (its graph, its streams) stays with the original.
        self.forge_check()
        state = super().__getstate__()
        if state.get("forge_owner") is not None:
            state = {**state, "forge_owner": None, "forge_backward": None}
        return state

    def get_extra_state(self):
        """The rule's class name and hyperparameters but the learning rate, as UTF-8 JSON in
        a uint8 tensor (see the class docstring)."""
        record = {"rule": type(self.rule).__name__, "hyperparameters": recorded_hyperparameters(self.rule)}
        return torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)

    def set_extra_state(self, state):
        """Nothing to set: ``_load_from_state_dict`` has checked the record against the
        layer's own rule before loading anything."""

    def _state_format_of(self, tensors: dict) -> str:
        """"fp32", "bf16" or "q8" (or the dtype) of the state slots in ``tensors``
        (slot name -> tensor); "no state" when the rule keeps none."""
        if not self.rule.slots:
            return "no state"
        dtypes = {getattr(t, "dtype", type(t).__name__) for name, t in tensors.items()
                  if not name.endswith(q8.EXPONENT_SUFFIX)}
        if not dtypes:
            return "missing state"
        if dtypes == {torch.uint8}:
            return "q8"
        names = {v: k for k, v in STATE_FORMATS.items()}
        return "/".join(sorted(names.get(d, str(d)) for d in dtypes))

    def _checkpoint_mismatch(self, state_dict, prefix):
        """Why this layer's entries in ``state_dict`` are not state of its own format, slots,
        rule and hyperparameters (the learning rate aside), or None. A checkpoint with none
        of the layer's fused entries is not checked (a plain nn.Linear's weights loaded with
        strict=False)."""
        own = {key[len(prefix):]: value for key, value in state_dict.items()
               if key.startswith(prefix) and "." not in key[len(prefix):]}
        if not any(key.startswith("forge_") or key == _EXTRA_STATE_KEY for key in own):
            return None
        found_state = {key[len(_STATE_PREFIX):]: value for key, value in own.items() if key.startswith(_STATE_PREFIX)}
        rule = type(self.rule).__name__
        record = _read_record(own[_EXTRA_STATE_KEY]) if _EXTRA_STATE_KEY in own else {}
        found_rule = record.get("rule") if isinstance(record, dict) else record  # None: not recorded
        where = f"fused layer {self.forge_name!r} (checkpoint entries {prefix}*)"
        expected = (self._state_format_of(self.forge_state), set(self._state_keys))
        found = (self._state_format_of(found_state), set(found_state))
        if found != expected or found_rule not in (rule, None):
            found_rule = found_rule or "an unrecorded rule"
            found_slots, slots = ({key for key in keys if not key.endswith(q8.EXPONENT_SUFFIX)}
                                  for keys in (found[1], expected[1]))
            slots = "" if found_slots == slots else f" with slots {sorted(found_slots)}, where it keeps {sorted(slots)}"
            return (f"{where}: expected {expected[0]} state of {rule}, found {found[0]} state of {found_rule}{slots}; "
                    "refused, the layer is left as it was (load a checkpoint of its own state format and rule, or "
                    "fuse with the checkpoint's)")
        bad_values = _bad_counter_or_exponents(own)
        if bad_values:
            # The per-step checks look at shapes and dtypes only (reading values would
            # synchronize every step); a checkpoint is read once, here.
            return f"{where}: {bad_values}; refused, the layer is left as it was"
        ours = recorded_hyperparameters(self.rule)
        layer = f"model.get_submodule({prefix[:-1]!r})" if prefix else "layer"
        vouch = (f"checkpoint[{prefix + _EXTRA_STATE_KEY!r}] = {layer}.get_extra_state(). The learning rate is "
                 "not recorded: a scheduler, or fk.Trainer's optimizer, sets it")
        if "hyperparameters" not in record:
            return (f"{where}: the checkpoint records no hyperparameters of its rule (it was written before they "
                    f"were recorded), so they cannot be checked against the layer's {rule}({shown_hyperparameters(ours)}); "
                    "refused, the layer is left as it was. If it was written with these hyperparameters, give it "
                    f"the layer's record: {vouch}")
        theirs = record["hyperparameters"]
        if theirs == ours:
            return None
        names = [name for name in {**ours, **theirs} if ours.get(name, _ABSENT) != theirs.get(name, _ABSENT)]
        return (f"{where}: its {rule} has {shown_hyperparameters(ours, names)} where the checkpoint's has "
                f"{shown_hyperparameters(theirs, names)}; refused, the layer is left as it was. Fuse with the checkpoint's "
                "hyperparameters or set them on the rule; to go on with the layer's on purpose, give the checkpoint "
                f"the layer's record: {vouch}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.forge_owner is not None:
            # The graph would go on writing the old tensors, with its own step count.
            raise RuntimeError(f"fused layer {self.forge_name!r} is captured by a CapturedStep: release() it "
                               "before loading a checkpoint")
        mismatch = self._checkpoint_mismatch(state_dict, prefix)
        if mismatch is not None:
            # As torch does for a shape mismatch: reported by load_state_dict, strict or not.
            error_msgs.append(mismatch)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "forge_step" in state_dict:
            # The loaded state replaces whatever an unchecked or failed step left behind.
            self._unchecked = None
            self._failed_step = self._failed_reason = None
        self._counters_read = None

    @property
    def forge_state(self) -> dict:
        """The rule's state (live tensors, updated in place): its slots, and in the q8
        format each slot's block exponents."""
        return {key: getattr(self, _STATE_PREFIX + key) for key in self._state_keys}

    def _check_input_dtype(self, x):
        """Refuse, as nn.Linear does, an input whose dtype is not the weight's, unless
        autocast (which casts both, as for nn.Linear) is on for the input's device: the
        layer would otherwise cast its weight and train where nn.Linear raises."""
        if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise RuntimeError(f"fused layer {self.forge_name!r}: mat1 and mat2 must have the same dtype, but got "
                               f"{x.dtype} input and {self.weight.dtype} weight, as nn.Linear refuses; cast the "
                               "input to the weight's dtype, or run the forward under torch.autocast")

    def forward(self, x):
        self._check_input_dtype(x)
        taking_gradient = torch.is_grad_enabled() and self.weight.requires_grad
        # A forward with grad inside a backward is activation checkpointing's replay of one.
        replay = taking_gradient and _inside_backward()
        if replay:
            self._check_replay()
        self._forward_version = self.weight._version
        if not taking_gradient:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if is_dtensor(self.weight) != self._fused_on_dtensor:
            raise RuntimeError(f"the weight of fused layer {self.forge_name!r} was replaced after fuse (e.g. by "
                               "parallelize_module applied after fk.fuse): its optimizer state belongs to the old "
                               "weight. Apply parallelize_module first, then fk.fuse")
        if is_dtensor(self.weight):
            check_input_layout(self.weight, x)
        if replay and len(self._pending):
            # torch.utils.checkpoint(use_reentrant=False) recomputing the forward whose backward
            # is pending, for its saved tensors: this graph is dropped, and steps nothing.
            return ForgeLinearFunction.apply(x, self.weight, self.bias, self,
                                             _PendingUse(self.weight._version, replay=True))
        if len(self._pending):
            raise RuntimeError(
                f"fused layer {self.forge_name!r} was called again before the backward of its previous call: "
                "a fused weight takes exactly one gradient per step, so tied or reused weights are refused "
                "(they would be stepped twice or lose a contribution). If the earlier output is no longer "
                "needed, drop it first; run forwards that take no step under torch.no_grad()")
        use = _PendingUse(self.weight._version)
        self._pending.add(use)
        return ForgeLinearFunction.apply(x, self.weight, self.bias, self, use)

    def _check_replay(self):
        """Refuse a forward replayed inside a backward (activation checkpointing, reentrant or
        not) whose weight is not the one the forward it replays used: the pending call's,
        else (``use_reentrant=True`` runs the first forward without grad) the last call's."""
        pending = next(iter(self._pending), None)
        expected = pending.weight_version if pending is not None else self._forward_version
        if expected is not None and self.weight._version != expected:
            raise RuntimeError(
                f"fused layer {self.forge_name!r} is run again inside a backward (activation checkpointing "
                "recomputing a forward) after its weight was stepped or written since that forward: it would "
                "compute other activations than the forward did. A fused layer may be called once per step, in "
                "one checkpointed region, and the region's backward taken at once (not a part with "
                "torch.autograd.grad first)")

    def _refuse_outside_gradient(self, grad):
        # The layer's own backward reports "no gradient" (None) to this hook.
        if grad is None:
            return None
        raise RuntimeError(f"the weight of fused layer {self.forge_name!r} received a gradient from a use "
                           "outside the layer; a fused weight takes exactly one gradient per step, through "
                           "its own backward")

    def _apply_step(self, x2d, dy2d, *, grad=None, rule=None, grad_scale=1.0, advance=True, report=None,
                    square_sums=None):
        """One step of ``rule`` (default: the layer's) with dW = dy2dᵀ x2d, or with a
        materialized fp32 ``grad`` (of the local shard) when given; the gradient is
        multiplied by ``grad_scale`` before the rule. ``advance=False`` leaves
        ``forge_step`` where it is (a micro-batch of an accumulated step). ``report``
        (default: the layer's) is ``"raise"`` or ``"defer"``, as in the constructor.
        ``square_sums``: filled with the tiles' sums of squares of dW by the fused step
        (``fused_weight_update``'s argument; not with ``grad``)."""
        if square_sums is not None and grad is not None:
            raise ValueError("square_sums are kept by the fused step; with a materialized grad take its norm directly")
        report = self.report if report is None else check_report(report)
        if self.forge_owner is not None:
            raise RuntimeError(f"fused layer {self.forge_name!r} is captured by a CapturedStep: its steps are the "
                               "CapturedStep's calls; release() it to step it any other way")
        # First, on every rank alike: bringing the operands to their layouts may take
        # collectives, which a rank raising below must not leave its peers waiting in.
        if is_dtensor(self.weight):
            if grad is not None:
                raise NotImplementedError(f"fused layer {self.forge_name!r} is tensor-parallel: a materialized "
                                          "gradient for it is not supported")
            x2d, dy2d = local_operands(self.weight, x2d, dy2d)
        # The previous deferred step first: it may have failed, and its step count is
        # this step's base. Its event is long passed by now, so this waits for nothing.
        try:
            self.forge_check()
        except FloatingPointError as error:
            reword(error, "", " (a deferred step, checked at this layer's next backward, which took no step: "
                               "call fk.check_updates(model) once per step to learn of it in its own step)")
            raise
        if self._failed_step is not None:
            raise RuntimeError(
                f"fused layer {self.forge_name!r} stopped at step {self._failed_step} ({self._failed_reason}). "
                "Restore a checkpoint, or call forge_accept_partial_step() to go on from here")
        step, seed = self._counters()
        step += 1
        # "raise" reads the outcome once, in the call (no pinned copy, no event); "defer"
        # keeps the report for forge_check.
        options = dict(config=self.config, rounding=self.rounding, seed=seed, grad_scale=grad_scale,
                       weight_slice=self.weight_slice, report=report)
        weight = local_weight(self.weight.data)
        try:
            with torch.no_grad():
                if grad is None:
                    outcome = fused_weight_update(x2d, dy2d, weight, self.forge_state, rule or self.rule, step,
                                                  oracle=self.oracle, square_sums=square_sums,
                                                  input_check=self.input_check, **options)
                else:
                    outcome = apply_rule(grad, weight, self.forge_state, rule or self.rule, step, **options)
        except FloatingPointError as error:  # "raise": the kernels ran and found non-finite values
            self._bump_versions(weight)
            self._failed(error, step)
            raise
        self._bump_versions(weight)
        if report == "defer":
            self._unchecked = (outcome, step, advance)
        elif advance:
            self._set_step(step)

    def _bump_versions(self, weight):
        # The kernel writes the weight's memory directly; bump its version so autograd
        # refuses any graph that saved the old values.
        torch.autograd.graph.increment_version(self.weight)
        if is_dtensor(self.weight):
            torch.autograd.graph.increment_version(weight)

    def _failed(self, error, step):
        """Record what a non-finite outcome of ``step`` means for the layer (failed tiles
        stop it; bad inputs wrote nothing) and name the layer and step in the error."""
        if isinstance(error, NonFiniteUpdateError):
            self.forge_stop(step, MIXED_STEPS)
        reword(error, f"fused layer {self.forge_name!r}, step {step}: ", "")

    def forge_check(self):
        """Check the layer's deferred step, if it has one (``report="defer"``); raise its
        ``NonFiniteInputError`` (nothing was written, the step does not count) or
        ``NonFiniteUpdateError`` (the layer stops, as after a failed step in ``"raise"``
        mode). A clean step is counted in ``forge_step``. Waits only for the GPU to
        finish that step (an event), not for everything queued after it. A layer held by
        a ``CapturedStep`` has its latest replay checked there (every layer at once)."""
        if self.forge_owner is not None:
            self.forge_owner.check()
        if self._unchecked is None:
            return
        outcome, step, advance = self._unchecked
        self._unchecked = None
        try:
            outcome.check()
        except FloatingPointError as error:
            self._failed(error, step)
            raise
        if advance:
            self._set_step(step)

    def forge_stop(self, step, reason):
        """Stop the layer at ``step``, which left its weight or state part-way (``reason``
        says how): it refuses to step or be checkpointed until a checkpoint is restored or
        ``forge_accept_partial_step()`` is called. Its own failed updates stop it so
        (``MIXED_STEPS``); a training driver stops a layer for what its step left behind."""
        self._failed_step = step
        self._failed_reason = reason

    def forge_accept_partial_step(self):
        """Go on from where the step that stopped the layer left it, counting that step as
        taken (after a NonFiniteUpdateError: the tiles that stepped are at it, the skipped
        tiles keep their previous values)."""
        if self._failed_step is None:
            raise RuntimeError(f"fused layer {self.forge_name!r} has no failed step to accept")
        self._set_step(self._failed_step)
        self._failed_step = self._failed_reason = None

    def extra_repr(self):
        return f"{super().extra_repr()}, rule={self.rule!r}, oracle={self.oracle}"


_ABSENT = object()  # a hyperparameter one side does not record


def _inside_backward() -> bool:
    """True while the autograd engine runs a backward on this thread, where activation
    checkpointing replays forwards (the private call torch.utils.checkpoint itself uses
    to tell one backward from another)."""
    return torch._C._current_graph_task_id() != -1


def _read_record(tensor):
    """The rule record in a checkpoint's ``_extra_state`` as a dict with a ``"rule"``
    name, or a description of what was found instead."""
    try:
        record = json.loads(bytes(tensor.tolist()).decode())
    except (AttributeError, TypeError, ValueError):
        record = None
    if isinstance(record, dict) and isinstance(record.get("rule"), str) and \
            isinstance(record.get("hyperparameters", {}), dict):
        return record
    return f"an unreadable rule record ({tensor!r:.60})"


def _shared_parameters(model: nn.Module) -> dict:
    """id(parameter) -> every name it is registered under."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def fuse(model: nn.Module, rule, *, oracle=False, config=None, state_format="fp32", rounding=None,
         seed=0, exclude=(), report="raise", input_check="step") -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a ForgeLinear using ``rule``.

    Weights may be float32 or bfloat16; ``state_format``, ``rounding`` and ``seed`` are
    those of ``fused_weight_update``. Each layer gets its own stochastic-rounding seed,
    derived from ``seed`` and its position in ``model.named_modules()`` order.
    ``report`` is the layers' ``"raise"`` or ``"defer"`` (see ``ForgeLinear``; with
    ``"defer"`` call ``check_updates(model)`` where a step's errors should surface).
    ``input_check`` is the layers' ``"step"`` or ``"tiles"`` (see ``ForgeLinear``).

    ``exclude`` names modules (as in ``named_modules()``) whose Linear layers, the module
    itself or any inside it, stay unfused, e.g. an ``lm_head`` tied to the embedding: its
    weight then belongs to the torch optimizer, which steps it once with the gradient of
    both uses.

    The module tree, names and Parameter objects are unchanged. Refused with a clear
    error: a model in which no layer would be fused (no nn.Linear outside ``exclude``;
    the error names the trainable modules skipped and why), a Linear whose weight is
    registered anywhere else in the model (tied),
    Hugging Face's ``Conv1D`` (GPT-2's transposed linear; convert it with
    ``forge_kernels.hf.conv1d_to_linear`` first) and subclasses of nn.Linear, whose forward may bypass ``nn.Linear.forward``
    (e.g. MultiheadAttention's out_proj) and would leave the weight silently unfused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, ForgeLinear) or type(model) is nn.Linear:
        raise TypeError("fuse converts the Linear layers inside a model; wrap a single layer with "
                        "ForgeLinear.from_linear instead")
    check_report(report)
    check_input_check(input_check)
    shared = _shared_parameters(model)
    exclude = set(exclude)
    unknown = exclude - {name for name, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"exclude names modules the model does not have: {sorted(unknown)}")
    targets = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            if any(qualified == e or qualified.startswith(e + ".") for e in exclude):
                continue
            if isinstance(child, ForgeLinear):
                raise ValueError(f"{qualified!r} is already fused")
            if is_conv1d(child):
                raise TypeError(f"{qualified!r} is a transformers Conv1D (a linear layer with a transposed weight) "
                                "that fuse would otherwise leave silently unfused; convert the model with "
                                "forge_kernels.hf.conv1d_to_linear(model) first")
            if isinstance(child, nn.Linear) and type(child) is not nn.Linear:
                raise TypeError(f"{qualified!r} is a {type(child).__name__}, a subclass of nn.Linear whose "
                                "forward may not go through nn.Linear.forward; refusing rather than leaving "
                                "its weight silently unfused")
            if type(child) is nn.Linear:
                owners = shared[id(child.weight)]
                if len(owners) > 1:
                    raise ValueError(f"the weight of {qualified!r} is tied: it is registered as {owners}; "
                                     "a fused weight must get exactly one gradient per step. Leave the layer "
                                     f"to the torch optimizer with fuse(..., exclude=[{qualified!r}])")
                targets.append((module, child_name, qualified, child))
    if not targets:
        raise ValueError(_nothing_to_fuse(model, exclude))
    check_seed(seed)
    layers = []
    for index, (_, _, qualified, linear) in enumerate(targets):
        try:
            layers.append(ForgeLinear._unhooked_from_linear(
                linear, rule, oracle=oracle, config=config, state_format=state_format, rounding=rounding,
                seed=stream_seed(seed, index + 1, 0), name=qualified, report=report, input_check=input_check))
        except (TypeError, ValueError) as error:
            reword(error, f"layer {qualified!r}: ", " (nothing was fused)")
            raise
    # Swapped in only once every layer is built: a refused layer leaves the model as it was.
    for (parent, child_name, _, _), layer in zip(targets, layers):
        layer._hook_weight()
        setattr(parent, child_name, layer)
    return model


def _nothing_to_fuse(model: nn.Module, exclude: set, shown: int = 8) -> str:
    """Why ``fuse`` found no layer: each module holding trainable parameters of its own,
    with the reason it was not fused."""
    skipped = []
    for name, module in model.named_modules():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        label = repr(name) if name else "the model itself"
        if any(name == e or name.startswith(e + ".") for e in exclude):
            skipped.append(f"{label} ({type(module).__name__}, excluded by exclude=)")
        else:
            skipped.append(f"{label} ({type(module).__name__}, not an nn.Linear)")
    found = ("its trainable modules were all skipped: " + ", ".join(skipped[:shown]) +
             (f" and {len(skipped) - shown} more" if len(skipped) > shown else "")) if skipped else \
        "it has no trainable parameters"
    return (f"fuse fused no layer of this {type(model).__name__}: only nn.Linear layers are fused (and transformers "
            f"Conv1D after forge_kernels.hf.conv1d_to_linear), and {found}. A model without linear layers "
            "gains nothing from fuse: train it with a torch optimizer")


def check_updates(model: nn.Module) -> None:
    """Check every fused layer's deferred step (``report="defer"``), in
    ``named_modules()`` order, and raise the first error found, after every layer has
    been checked (so each failed layer is stopped, and each clean one counts its
    step); the others are named in the error's notes (Python 3.11 and later). Costs
    one wait for the GPU to finish the steps, and nothing when there are none."""
    errors = []
    for module in model.modules():
        if isinstance(module, ForgeLinear):
            try:
                module.forge_check()
            except FloatingPointError as error:
                errors.append((module.forge_name, error))
    if not errors:
        return
    first = errors[0][1]
    if hasattr(first, "add_note"):  # Python >= 3.11
        for name, error in errors[1:]:
            first.add_note(f"fused layer {name!r} failed too: {error}")
    raise first
