"""A model's whole training step captured once in a CUDA graph and replayed per step:
``CapturedStep``. A fused step then costs the host one graph launch and one small copy,
whatever the number of layers, where an eager step pays each fused layer's argument
checks and kernel launches (0.1 to 0.6 ms a layer on an H200, more than its kernel
at fine-tuning batch sizes).

``step_fn`` runs forward and backward (and whatever optimizer steps the unfused
parameters: a ``torch.optim`` optimizer made with ``capturable=True``, whose
``zero_grad(set_to_none=True)`` starts ``step_fn``, so that the captured backward
writes fresh gradients rather than adding to the warm-up's; or see ``optimizer=``
below) on static input tensors; each call of the ``CapturedStep`` is one training step:

    static_x = torch.empty(batch, seq, dim, device="cuda")    # the inputs step_fn reads

    def step_fn():
        loss = loss_fn(model(static_x))
        loss.backward()
        return loss

    step = fk.CapturedStep(model, step_fn)
    for batch in data:
        static_x.copy_(batch)
        loss = step()

The first ``warmup`` calls (default 1) run ``step_fn`` eagerly on a side stream, as
ordinary steps taken the captured way (CUDA graphs need the kernels compiled, autograd's
and cuBLAS's workspaces made, before capture); the next call captures it and replays it,
and every later call replays it. Replayed steps are bitwise the eager ones at the same step
(``tests/test_captured_step.py``, on a GPU): each fused layer reads its step's scalars
and rounding key from a ``StepScalarsGroup`` that the call sets before the replay, and
its ``forge_step`` is written inside the graph.

After each replay (``check="every step"``, the default) the call reads every fused
layer's outcome at once (one synchronization); ``check="manual"`` leaves it to
``check()``, which reads the latest replay's outcome, or to the next call, before it
replays. Either way the GPU idles while the host reads and launches the next step. A
replay in which a layer's inputs were non-finite (that layer wrote nothing) or some tiles
were non-finite (left unstepped) stops the capture: the layers are released with their own step counts, as
eager training with ``report="defer"`` would leave them, and the error is raised; go on
eagerly, or from a checkpoint. An error inside ``step_fn`` during a warm-up step, or a
layer stepped twice in one step (gradient accumulation: refused) or not at all, also
releases every layer at the step it really took. While captured, a fused layer refuses
an eager backward (its steps would be counted twice), ``fk.Trainer``, a second
``CapturedStep`` and a checkpoint load; a deep copy of it is not captured.
``release()`` gives the layers back. ``state_dict()`` of a captured model checks the
latest replay first.

``check="lagged"`` reads each replay's outcome during the next call, after that call's
replay is queued (a copy of the outcome to pinned memory behind each replay), so the GPU
goes from step to step without waiting, which saved 0.26-0.51 ms a step on two
Llama-3-8B-shaped blocks at 512 tokens and 2.1-2.2 ms on 32 of them, on an H100
(``benchmarks/bench_model.py --back-to-back``; benchmarks/HISTORY.md, "The lagged
check"). A replay after a bad one is halted on the device: its gradients are scaled by
NaN, so no fused layer stores a tile (``fused_weight_update``'s ``grad_scale``), and the
optimizer and ``last_norm`` are skipped as for a bad step; the call that reads the bad replay then stops the capture at
that replay's step, the layers where ``check="every step"`` leaves them, and raises its
error. Its non-finite tiles are counted, not named (``NonFiniteUpdateError.tiles`` is
empty: the halted replay reused the flags), unless ``check()`` reads it before another call. What the halt covers is the fused layers, the
optimizer handed over and ``last_norm``; the halted replay still runs the rest of
``step_fn``: an optimizer stepped inside it steps (hand it over with ``optimizer=``,
below, to have it skipped), the CUDA RNG advances, in-place buffers (a norm's running
statistics) update, the unfused ``.grad`` (without ``optimizer=``) and the returned loss
tensor take the halted step's values. Make every call of a lagged ``CapturedStep`` on one
stream: replays on different streams could overlap, and a replay must follow the one
before it to be halted.

``optimizer=``: the torch optimizer of the unfused parameters (exactly
``fk.unfused_parameters(model)``'s trainable ones), handed to the ``CapturedStep`` as to
``fk.Trainer``; ``step_fn`` then only runs forward and backward, and the step, in the
graph, sets the unfused gradients to None before ``step_fn`` and steps the optimizer
after it (after the clip, with ``max_norm``). It must be one of torch's fused optimizers
(``fused=True``; Adam and AdamW also ``capturable=True``): where a fused layer's step or
the global norm is non-finite, the step skips it on the device through the ``found_inf``
tensor torch's ``GradScaler`` uses for them (no synchronization), as ``fk.Trainer`` does
not step it then (an eager step, which reads its outcome anyway, does not call it). Its
hyperparameters are fixed at capture unless they are tensors (``lr=torch.tensor(...)``
for a schedule); a ``load_state_dict`` on it while captured, or its ``step()`` inside
``step_fn``, is refused (the graph would go on stepping the old state; it would step twice).

``max_norm=`` with ``clipping="previous-norm"`` (named explicitly: it is APPROXIMATE)
clips by global norm as ``fk.Trainer(..., max_norm, clipping="previous-norm")`` does,
bitwise (``tests/test_captured_clipping.py``, on a GPU), with no synchronization in a
replay beyond the check's (none with ``check="manual"``). The first call, which has no previous
norm, is that Trainer's first step: exact, eager, ``step_fn`` run twice (the first run
only measures the fused layers' gradient norms; the torch RNG is rewound between the
runs); then ``warmup`` eager steps of the captured kind, then the capture. Every later
step, in the graph: the clip coefficient ``clip_coefficient(max_norm, last_norm)`` of the
previous step's norm is computed on the device; each fused layer materializes its fp32
gradient (``weight_gradient``), keeps its norm and steps from it with that coefficient as
a device ``grad_scale``; then the global norm of this step (``total_norm``, the fused
norms and the unfused ``.grad``), the unfused gradients multiplied by the coefficient,
the optimizer's step, and ``last_norm`` (a device tensor, updated in place; the first,
exact step sets it from its norm, as the Trainer's does) set to the new norm where it and
every fused step are finite. A non-finite norm leaves ``last_norm`` as it was, skips the
optimizer, and the check raises the Trainer's FloatingPointError (the fused layers have
stepped, the torch optimizer has not), stopping the capture.
``norm="tiles"`` (with ``max_norm``) takes each fused layer's norm as
``fk.Trainer(..., norm="tiles")`` does: from tile sums of squares (one float per tile,
within the bound of ``proofs/gradient_norm.md`` of the exact norm, not
``clip_grad_norm_``'s bits), which the fused step keeps as it steps with the device
coefficient (``fused_weight_update(..., square_sums=)``; the exact first step takes them
from the tile loop, ``weight_gradient_norm``), so no fused layer's gradient is stored in
any step (``oracle=False``, the default); bitwise that Trainer
(``tests/test_captured_clipping.py``, on a GPU).
That costs no second pass over the tokens: on an H200 the step keeping its sums, then the
norm, took 1.05-1.15x the plain step at 512-1,024 tokens (``benchmarks/probe_gradient_norm.py``,
979663d), and two Llama-3-8B-shaped blocks stepped faster with tile norms than with gradient
norms (bf16: 6.24 against 9.61 ms at 512 tokens, 24.94 against 26.51 at 4,096), without
the largest layer's fp32 gradient that gradient norms store.
``clipping="exact"`` is refused: it needs two forward/backward passes per step with the
RNG rewound between them, and a ``CapturedStep`` records one pass of ``step_fn``.

What a graph cannot change is refused or fixed at capture: the inputs' shapes and
addresses (copy new data into the same tensors), the model's structure, the rule's
hyperparameters other than through ``rule.lr`` and the like, which are read at each
``set``. Not supported while captured: ``fk.Trainer`` (its accumulation runs host code
between layers; for clipping, pass ``max_norm`` here), exact clipping, layers with
``report="raise"`` semantics inside the graph (every captured layer defers, and the call
checks), and CPU execution (the Triton interpreter has no graphs: refused with an error).
"""

import math
import warnings

import torch
from torch.utils import _pytree as pytree

from .errors import NonFiniteInputError
from .linear import MIXED_STEPS, ForgeLinear
from .tensor_parallel import is_dtensor
from .ops.fused_weight_update import apply_rule, fused_weight_update
from .ops.gradient_norm import norm_from_square_sums
from .ops.step_scalars import StepScalarsGroup
from .training import (PREVIOUS_NORM_STEPPED, _InputCheck, _layer_gradient, _layer_norm, check_clipping_mode,
                       check_max_norm, check_norm, check_unfused_optimizer, clip_coefficient, clip_scale,
                       layer_square_sums, non_finite_norm_error, refuse_stopped_layers, rng_rewinder,
                       scale_unfused_gradients, set_aside_clipped_gradients, total_norm)

CHECKS = ("every step", "manual", "lagged")


def _detached(value):
    """``value`` with every tensor in it (also inside tuples, lists and dicts) detached."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _check_clipping(max_norm, clipping):
    check_max_norm(max_norm)
    check_clipping_mode(clipping, max_norm, default=None)
    if clipping == "exact":
        raise ValueError("clipping='exact' cannot be captured: it runs step_fn's forward and backward twice per step "
                         "(the first pass only for the global norm) with the torch RNG rewound between them, and a "
                         "CapturedStep records one pass of step_fn. Capture with clipping='previous-norm' "
                         "(APPROXIMATE: step t scaled by step t-1's norm, one pass), or clip exactly uncaptured with "
                         "fk.Trainer(model, optimizer, max_norm=...)")
    if max_norm is not None and clipping is None:
        raise ValueError("a captured step clips by the previous step's global norm, which is APPROXIMATE (a gradient "
                         "spike passes unclipped on its step; see fk.Trainer's clipping='previous-norm'): pass "
                         "clipping='previous-norm' to accept it, or train uncaptured with fk.Trainer for exact "
                         "clipping")


def _check_last_norm(last_norm, max_norm):
    if last_norm is None:
        return
    if max_norm is None:
        raise ValueError("last_norm= is the previous step's global norm for previous-norm clipping; it needs max_norm")
    if not (isinstance(last_norm, torch.Tensor) and last_norm.numel() == 1 and last_norm.is_floating_point()):
        raise TypeError("last_norm must be the one-element tensor that fk.Trainer's or a CapturedStep's last_norm "
                        f"holds (its dtype is part of the next clip factor's bits), got {last_norm!r}")
    if not (bool(torch.isfinite(last_norm)) and float(last_norm) >= 0):
        raise ValueError(f"last_norm must be a finite norm >= 0, got {float(last_norm)}")


def _check_optimizer(model, optimizer, max_norm):
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(f"optimizer= must be one of torch's fused optimizers (fused=True; Adam and AdamW also "
                             f"capturable=True), got {type(optimizer).__name__} without fused=True: the step skips "
                             "it on the device when a fused step or the norm is non-finite, through the found_inf "
                             "tensor that only fused optimizers read (as GradScaler does). Another capturable "
                             "optimizer can be stepped inside step_fn, without max_norm")
        if any(group.get("capturable") is False for group in optimizer.param_groups):
            raise ValueError(f"optimizer= is a {type(optimizer).__name__} with capturable=False: its step would be "
                             "recorded in the graph with host-side step counts; make it with capturable=True")
    if optimizer is not None or max_norm is not None:  # with max_norm the clip must come before the optimizer
        check_unfused_optimizer(model, optimizer)


class CapturedStep:
    """See the module docstring. ``model``'s fused layers must all be at one step and on
    one CUDA device; each call takes the next step. ``optimizer``: the torch optimizer of
    the unfused parameters, stepped by the call (not by ``step_fn``); ``max_norm`` and
    ``clipping="previous-norm"``: global-norm clipping as ``fk.Trainer``'s, the fused layers'
    norms from their gradients or (``norm="tiles"``) their tile loops; ``last_norm``:
    the global norm the next step's clip factor comes from (None without ``max_norm`` and
    before the first call), one device tensor updated in place at each step (``clone()``
    it to keep a step's value), and what a checkpoint keeps to resume: pass it back as
    ``last_norm=`` (or set ``fk.Trainer``'s ``last_norm`` to a clone of it) and the next
    step is the previous-norm step an uninterrupted run takes, not an exact first step."""

    def __init__(self, model: torch.nn.Module, step_fn, *, optimizer=None, max_norm=None, clipping=None,
                 norm="gradient", last_norm=None, warmup: int = 1, check: str = "every step"):
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1 (eager steps before capture), got {warmup!r}")
        _check_clipping(max_norm, clipping)
        check_norm(norm, max_norm)
        _check_last_norm(last_norm, max_norm)
        layers = [m for m in model.modules() if isinstance(m, ForgeLinear)]
        if not layers:
            raise ValueError("CapturedStep needs a model with fused layers (fk.fuse); for a model without any, "
                             "capture its step with torch.cuda.graph directly")
        _check_optimizer(model, optimizer, max_norm)
        for layer in layers:
            if layer.forge_backward is not None or layer.forge_owner is not None:
                raise RuntimeError(f"fused layer {layer.forge_name!r} is driven by another training driver "
                                   "(fk.Trainer, another CapturedStep?): capture a model that no driver holds")
            if is_dtensor(layer.weight):
                raise NotImplementedError(f"fused layer {layer.forge_name!r} is tensor-parallel (a DTensor weight): "
                                          "CapturedStep does not capture tensor-parallel layers")
        devices = {layer.weight.device for layer in layers}
        if any(device.type != "cuda" for device in devices) or len(devices) > 1:
            raise RuntimeError(f"CapturedStep needs every fused layer on one CUDA device (CUDA graphs); the layers "
                               f"are on {sorted(map(str, devices))}")
        for layer in layers:
            layer.forge_check()
        refuse_stopped_layers(layers, "Restore a checkpoint or accept the partial step before capturing")
        steps = {layer._counters()[0] for layer in layers}
        if len(steps) > 1:
            raise RuntimeError(f"the fused layers are at different steps {sorted(steps)}: a captured step advances "
                               "them together, so it needs them at one step (did some layer take no backward?)")
        self.model, self.step_fn, self.check_mode, self.layers = model, step_fn, check, layers
        self.optimizer, self.max_norm, self.norm = optimizer, max_norm, norm
        self.last_norm = None if last_norm is None else last_norm.detach().to(layers[0].weight.device, copy=True)
        self.step = steps.pop()     # the step the latest call took
        self.graph = self.loss = None
        self._warmup_left = warmup
        self._checked = True        # whether the latest step's outcome has been read
        self._unread = []           # check="lagged": (step, pinned host copy of its verdict, event), oldest first
        self._outcomes = {}         # layer -> UpdateReport of its latest launch
        self._verdict = None        # the latest step's outcome words (and global norm), for check
        # What the fused layers' backwards do, for the pass of step_fn under way (see _step_layer).
        self._pass = None           # None (not this object's run), "step" or "measure"
        self._seen = set()          # the layers that took a backward in this pass
        self._norms = None          # id(weight) -> the layer's gradient norm, when norms are taken
        self._inputs = None         # an _InputCheck of the gradients' operands, in a measuring pass
        self._grad_scale = 1.0       # the fused steps' grad_scale: a number, or the device clip coefficient
        self._device = devices.pop()
        self._stream = torch.cuda.Stream(device=self._device)
        # check="lagged": set on the device at the end of a step with any non-finite outcome;
        # every later step then writes nothing (see _one_pass_step) until a call reads it.
        self._halt = torch.zeros((), dtype=torch.bool, device=self._device) if check == "lagged" else None
        by_rule = {}
        for layer in layers:
            by_rule.setdefault(id(layer.rule), []).append(layer)
        self._groups, self._scalars = [], {}
        for members in by_rule.values():
            group = StepScalarsGroup(members[0].rule, [layer._counters()[1] for layer in members],
                                     device=members[0].weight.device)
            self._groups.append(group)
            self._scalars.update(zip(members, group.members))
        for layer in layers:
            layer.forge_backward = self._step_layer
            layer.forge_owner = self
        self._hooks = []
        if optimizer is not None:
            self._hooks = [optimizer.register_step_pre_hook(self._refuse_a_step_in_step_fn),
                           optimizer.register_load_state_dict_pre_hook(self._refuse_a_load_while_captured)]
        self.active = True

    def _refuse_a_step_in_step_fn(self, optimizer, args, kwargs):
        if self._pass is not None:
            raise RuntimeError("the optimizer handed to the CapturedStep (optimizer=) is stepped by the step itself, "
                               "after step_fn: step_fn must only run forward and backward")

    def _refuse_a_load_while_captured(self, optimizer, state_dict):
        if self.graph is not None:
            raise RuntimeError("the optimizer's state is captured in the CapturedStep's graph, which would go on "
                               "stepping the old tensors: release() the CapturedStep, load, and make a new one")

    def __call__(self):
        """Take one training step; returns what ``step_fn`` returned (once captured, the
        same static tensor at every replay, holding this step's value)."""
        if not self.active:
            raise RuntimeError("this CapturedStep was released or stopped; make a new one to capture again")
        with torch.cuda.device(self._device):
            return self._call()

    def _call(self):
        if self.check_mode != "lagged":
            self.check()  # "manual": the previous step's outcome goes unread only until this call
        step = self.step + 1
        for group in self._groups:
            group.set(step)
        exact = self.max_norm is not None and self.last_norm is None  # no previous norm yet
        if exact or self._warmup_left:
            returned = self._eager(step, exact)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            returned = self.loss
        self.step, self._checked = step, False
        if self.check_mode == "lagged" and self.graph is not None:
            self._queue_verdict(step)
            self._read_verdicts(keep=1)  # every earlier step's: the GPU has this one queued meanwhile
        elif self.check_mode == "every step" or self.graph is None:  # warm-up steps are always read
            self.check()
        return returned

    def _eager(self, step, exact):
        """A warm-up step (or the exact first step of clipping). Whatever goes wrong in it
        (an error in ``step_fn``, a layer stepped twice or not at all, a non-finite norm
        before the exact step's stepping pass) releases the layers at the step each really
        took: eager kernels have run for the layers that stepped."""
        self._outcomes.clear()
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                returned = self._exact_step(step) if exact else self._one_pass_step(step)
            current.wait_stream(self._stream)
        except BaseException:
            current.wait_stream(self._stream)
            self._settle(step)
            raise
        if not exact:
            self._warmup_left -= 1
        return returned

    def _capture(self):
        """Record one step. Recording runs no kernel, so whatever goes wrong here leaves
        every layer at the step it was at."""
        self._outcomes.clear()
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.graph(self.graph, stream=self._stream):
                # Kept without its autograd graph: that graph's nodes hold the layers, the
                # layers this object, and a cycle through C++ nodes is never collected.
                self.loss = _detached(self._one_pass_step(self.step + 1))
            current.wait_stream(self._stream)
        except BaseException:
            self._stop(self.step)
            raise

    def _one_pass_step(self, step):
        """One step as the graph holds it (and a warm-up step runs it): ``step_fn`` once,
        with previous-norm clipping around it if ``max_norm``; the optimizer's step last."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        coefficient = None
        if self.max_norm is not None:
            coefficient = clip_coefficient(self.max_norm, self.last_norm)  # the previous step's factor
        self._norms = None if coefficient is None else {}
        self._inputs, self._grad_scale = None, 1.0 if coefficient is None else coefficient
        if self._halt is not None:
            # A step after an unread non-finite one scales every gradient by NaN: the fused
            # kernels then store no tile (fused_weight_update's grad_scale); by 1.0 (or the
            # clip coefficient) otherwise, which changes no bit.
            base = torch.ones((), dtype=torch.float32, device=self._device) if coefficient is None else coefficient
            self._grad_scale = torch.where(self._halt, torch.full_like(base, math.nan), base).reshape(1)
        returned = self._run_step_fn("step", step)
        norm = None
        if coefficient is not None:
            norm = total_norm(self.model.parameters(), self._norms)
            scale_unfused_gradients(self.model, coefficient)
        self._finish(norm)
        return returned

    def _exact_step(self, step):
        """``fk.Trainer``'s first step with clipping, which has no previous norm: exact, in
        two runs of ``step_fn`` (as ``Trainer._clipped_fused_step``), eager."""
        rewind = rng_rewinder()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._norms, self._inputs = {}, _InputCheck()
        self._run_step_fn("measure", step)
        norm, coefficient = clip_scale(self.model.parameters(), self.max_norm, self._norms, self._inputs)
        put_back = set_aside_clipped_gradients(self.model, coefficient)
        rewind()
        self._norms, self._inputs, self._grad_scale = None, None, float(coefficient)
        returned = self._run_step_fn("step", step)
        put_back()
        self.last_norm = norm
        self._finish(norm)
        return returned

    def _run_step_fn(self, kind, step):
        """Run ``step_fn`` as a ``kind`` pass (see ``_step_layer``); every fused layer must
        take its one backward in it."""
        self._pass, self._seen = kind, set()
        try:
            returned = self.step_fn()
        finally:
            self._pass = None
        missing = [layer.forge_name for layer in self.layers if layer not in self._seen]
        if missing:
            raise RuntimeError(f"fused layers {missing} took no backward in step {step}: a captured step must "
                               "step every fused layer of the model once; the layers are released")
        return returned

    def _finish(self, norm):
        """After ``step_fn``: what ``check`` reads (every layer's status words, and the
        global ``norm`` when clipping), then the optimizer's step, skipped on the device
        where a fused step or the norm is non-finite (``fk.Trainer`` raises before stepping
        it then); ``last_norm`` takes the norm where both are finite, as the Trainer's does."""
        self._norms = None
        statuses = torch.stack([self._outcomes[layer].status for layer in self.layers])
        self._verdict = statuses
        if norm is not None:  # one more row, in the same copy (the int32 counts are exact in float64)
            self._verdict = torch.cat([statuses.double(), norm.double().expand(1, statuses.shape[1])])
        if norm is None and self.optimizer is None and self._halt is None:
            return
        bad = statuses.any()
        if norm is not None:
            bad = bad | ~torch.isfinite(norm)
        if self._halt is not None:
            bad = bad | self._halt  # a halted step steps nothing, the optimizer and last_norm included
            self._halt.copy_(bad)
        if norm is not None:
            self.last_norm.copy_(torch.where(bad, self.last_norm, norm))
        if self.optimizer is None:
            return
        if not torch.cuda.is_current_stream_capturing():
            # An eager step reads the verdict (it synchronizes anyway) and, like the
            # Trainer, does not step the optimizer at all after a bad step: skipped through
            # found_inf, a first step would still create its state (fused SGD's momentum
            # from torch.empty_like, never written).
            if not bool(bad):
                with warnings.catch_warnings():
                    # A warm-up step runs the capturable optimizer uncaptured, as capture needs.
                    warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")
                    self.optimizer.step()
            return
        self.optimizer.found_inf = bad.float()  # read by torch's fused optimizers, as GradScaler sets it
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _settle(self, step):
        """Release the layers after a warm-up ``step`` that failed part-way: a layer that
        stepped cleanly is at ``step``; one that did not step, or whose inputs were
        non-finite (it wrote nothing), at ``step - 1``; one with non-finite tiles stops at
        ``step``, as eagerly."""
        errors = {}
        for layer in self.layers:
            outcome = self._outcomes.get(layer)
            if outcome is None:
                errors[layer] = None
                continue
            try:
                outcome.check()
            except FloatingPointError as error:
                errors[layer] = error
        self._stop(step, errors)

    def _step_layer(self, layer, x2d, dy2d):
        """A fused layer's backward in this object's run of ``step_fn``, eager (warm-up) or
        as the graph records it. A ``"measure"`` pass (exact clipping's first) keeps the
        norm of the layer's fp32 gradient and steps nothing; a ``"step"`` pass steps, its
        scalars and rounding key read from the group's device buffer, its outcome kept
        for ``check``, its ``forge_step`` advanced on the device: through the fused kernel,
        or, where norms are taken (previous-norm clipping), from the materialized gradient
        whose norm it keeps, as ``fk.Trainer`` does. A backward outside this object's own
        runs of ``step_fn`` is refused: it would step the layer a second time. With
        ``norm="tiles"`` the layer steps through the fused kernel and no gradient is
        stored: a measuring pass takes the norm from the tile loop
        (``weight_gradient_norm``), a stepping pass from the fused step's own tiles' sums
        (``square_sums``), as ``fk.Trainer`` does."""
        if self._pass is None:
            raise RuntimeError(f"fused layer {layer.forge_name!r} is captured by a CapturedStep: its steps are "
                               "the CapturedStep's calls. Call it, or its release(), not the model's backward")
        if layer in self._seen:
            raise RuntimeError(f"fused layer {layer.forge_name!r} took a second backward in one step of a "
                               "CapturedStep: a fused weight takes one step per backward, so step_fn must run one "
                               "backward through each fused layer (no gradient accumulation)")
        self._seen.add(layer)
        with torch.no_grad():
            grad = sums = None
            if self._norms is not None:
                if self._pass == "measure":
                    self._norms[id(layer.weight)] = _layer_norm(layer, x2d, dy2d, self.norm, self._inputs)
                    return
                if self.norm == "tiles":
                    sums = layer_square_sums(layer)
                else:
                    grad = _layer_gradient(layer, x2d, dy2d, self._inputs)
                    self._norms[id(layer.weight)] = torch.linalg.vector_norm(grad, 2.0)
            scalars = self._scalars[layer]
            options = dict(config=layer.config, rounding=layer.rounding, seed=scalars.seed,
                           grad_scale=self._grad_scale, weight_slice=layer.weight_slice, report="defer")
            if grad is None:
                self._outcomes[layer] = fused_weight_update(x2d, dy2d, layer.weight.data, layer.forge_state,
                                                            layer.rule, scalars, oracle=layer.oracle,
                                                            square_sums=sums, input_check=layer.input_check, **options)
                if sums is not None:
                    self._norms[id(layer.weight)] = norm_from_square_sums(sums)
            else:
                self._outcomes[layer] = apply_rule(grad, layer.weight.data, layer.forge_state, layer.rule, scalars,
                                                   **options)
            layer.forge_step.add_(1)
        layer._bump_versions(layer.weight.data)

    def check(self):
        """Read the latest step's outcome for every fused layer, and its global norm when
        clipping (one synchronization); raise its first error, after stopping the capture
        (see the module docstring). With ``check="lagged"``, every step not yet read, oldest
        first."""
        if self._checked or not self.active:
            return
        self._checked = True
        if self._unread:
            self._read_verdicts(keep=0)
            return
        with torch.cuda.device(self._device):
            read = self._verdict.cpu()
        self._judge(read, self.step)

    def _queue_verdict(self, step):
        """check="lagged": copy the replay's verdict to pinned host memory, behind it on the stream."""
        host = torch.empty(self._verdict.shape, dtype=self._verdict.dtype, pin_memory=True)
        host.copy_(self._verdict, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._unread.append((step, host, done))

    def _read_verdicts(self, keep):
        """check="lagged": read the queued verdicts but the latest ``keep``, oldest first. A
        bad one stops the capture at its step: the steps after it, halted on the device,
        wrote nothing, so the layers are where ``check="every step"`` would leave them."""
        while len(self._unread) > keep:
            step, host, done = self._unread.pop(0)
            done.synchronize()
            if self._flagged(host):
                # Let the halted replays behind it finish (on whatever stream) before the
                # layers go back to eager use; none may run after _stop sets their steps.
                torch.cuda.synchronize(self._device)
                later = bool(self._unread)  # a later replay has reused the tile flags
                self._unread.clear()
                self.step = step
                self._judge(host, step, lagged=later)
                # _judge returns only for a clean verdict, and this one was flagged: the device
                # has halted the capture, so it must stop here rather than go on writing nothing.
                self._stop(step)
                raise FloatingPointError(f"step {step} (CapturedStep): outcome words {host.tolist()} flagged with no "
                                         "error to name; the capture is stopped and the layers released")

    def _flagged(self, read):
        """Whether a verdict read on the host is bad, as ``_finish``'s ``bad`` on the device:
        a layer's nonzero status word, or a non-finite global norm."""
        return bool(read[:len(self.layers)].any()) or (self.max_norm is not None
                                                       and not math.isfinite(float(read[-1, 0])))

    def _judge(self, read, step, lagged=False):
        """Raise the first error of one step's verdict ``read`` (on the host), after stopping
        the capture at ``step``; return if the step was clean. ``lagged``: a later replay has
        run since, so each layer's error comes from its words in ``read``, not its report."""
        bad = [(layer, status) for layer, status in zip(self.layers, read) if bool(status.any())]
        errors = {}
        for layer, status in bad:
            if lagged:
                words = [int(word) for word in status.tolist()]
                # A flagged row always maps to an error: a capture halted on the device must stop.
                errors[layer] = (self._outcomes[layer].error_from(words)
                                 or FloatingPointError(f"unexpected status words {words}"))
                continue
            try:
                self._outcomes[layer].check()
            except FloatingPointError as error:
                errors[layer] = error
        if not errors:
            norm = None if self.max_norm is None else float(read[-1, 0])
            if norm is None or math.isfinite(norm):
                return
            # Every fused layer stepped cleanly (they step before the norm is known); the
            # optimizer was skipped in the graph.
            self._stop(step)
            error = non_finite_norm_error(norm, PREVIOUS_NORM_STEPPED)
            error.args = (f"step {step} (CapturedStep): {error.args[0]}; the capture is stopped and the layers "
                          "released",)
            raise error
        self._stop(step, errors)
        (first_layer, first), *others = errors.items()
        first.args = (f"fused layer {first_layer.forge_name!r}, step {step} (CapturedStep): {first.args[0]}; "
                      "the capture is stopped and the layers released",) + first.args[1:]
        if hasattr(first, "add_note"):
            for layer, error in others:
                first.add_note(f"fused layer {layer.forge_name!r} failed too: {error}")
        raise first

    def _stop(self, step, errors=None):
        """Release the layers to eager training and drop the graph, the layers at ``step``
        except those with an entry in ``errors``: ``None`` (took no backward) or a
        ``NonFiniteInputError`` (wrote nothing) leave a layer at step - 1; another error
        (non-finite tiles) stops it at ``step``, as eagerly. The unfused gradients go, as
        ``fk.Trainer`` leaves none, where this object steps the optimizer."""
        errors = errors or {}
        for layer in self.layers:
            layer.forge_backward = None
            layer.forge_owner = None
            if layer not in errors:
                layer._set_step(step)
                continue
            layer._set_step(step - 1)
            error = errors[layer]
            if error is not None and not isinstance(error, NonFiniteInputError):
                layer.forge_stop(step, MIXED_STEPS)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for hook in self._hooks:
            hook.remove()
        self.graph = self.loss = self._verdict = None
        self._outcomes, self._hooks, self._grad_scale = {}, [], 1.0  # the coefficient lived in the graph's pool
        self.active = False

    def release(self):
        """Check the latest step, then give the layers back to eager training at the step
        they are at; the graph is dropped."""
        if not self.active:
            return
        self.check()
        self._stop(self.step)
