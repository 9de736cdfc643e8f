"""A model's whole training step captured once in a CUDA graph and replayed per step:
``CapturedStep``. A fused step then costs the host one graph launch and one small copy,
whatever the number of layers, where an eager step pays each fused layer's argument
checks and kernel launches (0.1 to 0.6 ms a layer on an H200, more than its kernel
at fine-tuning batch sizes).

``step_fn`` runs forward and backward (and whatever optimizer steps the unfused
parameters: a ``torch.optim`` optimizer made with ``capturable=True``, whose
``zero_grad(set_to_none=True)`` starts ``step_fn``, so that the captured backward
writes fresh gradients rather than adding to the warm-up's) on static input tensors;
each call of the ``CapturedStep`` is one training step:

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
``check()``, which reads the latest replay's outcome. A replay in which a layer's
inputs were non-finite (that layer wrote nothing) or some tiles were non-finite (left
unstepped) stops the capture: the layers are released with their own step counts, as
eager training with ``report="defer"`` would leave them, and the error is raised; go on
eagerly, or from a checkpoint. An error inside ``step_fn`` during a warm-up step, or a
layer stepped twice in one step (gradient accumulation: refused) or not at all, also
releases every layer at the step it really took. While captured, a fused layer refuses
an eager backward (its steps would be counted twice), ``fk.Trainer``, a second
``CapturedStep`` and a checkpoint load; a deep copy of it is not captured.
``release()`` gives the layers back. ``state_dict()`` of a captured model checks the
latest replay first.

What a graph cannot change is refused or fixed at capture: the inputs' shapes and
addresses (copy new data into the same tensors), the model's structure, the rule's
hyperparameters other than through ``rule.lr`` and the like, which are read at each
``set``. Not supported while captured: ``fk.Trainer`` (its clipping and accumulation
run host code between layers), layers with ``report="raise"`` semantics inside the
graph (every captured layer defers, and the call checks), and CPU execution (the Triton
interpreter has no graphs: refused with an error).
"""

import contextlib

import torch
from torch.utils import _pytree as pytree

from .errors import NonFiniteInputError
from .linear import ForgeLinear
from .tensor_parallel import is_dtensor
from .ops.fused_weight_update import fused_weight_update
from .ops.step_scalars import StepScalarsGroup

CHECKS = ("every step", "manual")


def _detached(value):
    """``value`` with every tensor in it (also inside tuples, lists and dicts) detached."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


class CapturedStep:
    """See the module docstring. ``model``'s fused layers must all be at one step and on
    one CUDA device; each call takes the next step."""

    def __init__(self, model: torch.nn.Module, step_fn, *, warmup: int = 1, check: str = "every step"):
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1 (eager steps before capture), got {warmup!r}")
        layers = [m for m in model.modules() if isinstance(m, ForgeLinear)]
        if not layers:
            raise ValueError("CapturedStep needs a model with fused layers (fk.fuse); for a model without any, "
                             "capture its step with torch.cuda.graph directly")
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
        failed = [layer.forge_name for layer in layers if layer._failed_step is not None]
        if failed:
            raise RuntimeError(f"fused layers {failed} stopped after a non-finite update: restore a checkpoint or "
                               "accept the partial step before capturing")
        steps = {layer._counters()[0] for layer in layers}
        if len(steps) > 1:
            raise RuntimeError(f"the fused layers are at different steps {sorted(steps)}: a captured step advances "
                               "them together, so it needs them at one step (did some layer take no backward?)")
        self.step_fn, self.check_mode, self.layers = step_fn, check, layers
        self.step = steps.pop()     # the step the latest call took
        self.graph = self.loss = None
        self._warmup_left = warmup
        self._checked = True        # whether the latest step's outcome has been read
        self._outcomes = {}         # layer -> UpdateReport of its latest launch
        self._running = False       # inside this object's own run of step_fn
        self._device = devices.pop()
        self._stream = torch.cuda.Stream(device=self._device)
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
        self.active = True

    def __call__(self):
        """Take one training step; returns what ``step_fn`` returned (once captured, the
        same static tensor at every replay, holding this step's value)."""
        if not self.active:
            raise RuntimeError("this CapturedStep was released or stopped; make a new one to capture again")
        with torch.cuda.device(self._device):
            return self._call()

    def _call(self):
        self.check()  # "manual": the previous step's outcome goes unread only until this call
        step = self.step + 1
        for group in self._groups:
            group.set(step)
        if self._warmup_left:
            returned = self._eager(step)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            returned = self.loss
        self.step, self._checked = step, False
        if self.check_mode == "every step" or self.graph is None:  # warm-up steps are always read
            self.check()
        return returned

    def _eager(self, step):
        """A warm-up step. Whatever goes wrong in it (an error in ``step_fn``, a layer
        stepped twice or not at all) releases the layers at the step each really took:
        eager kernels have run for the layers that stepped."""
        self._outcomes.clear()
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream), self._own_run():
                returned = self.step_fn()
            current.wait_stream(self._stream)
            self._require_every_layer_stepped(step)
        except BaseException:
            current.wait_stream(self._stream)
            self._settle(step)
            raise
        self._warmup_left -= 1
        return returned

    def _capture(self):
        """Record ``step_fn`` once. Recording runs no kernel, so whatever goes wrong here
        leaves every layer at the step it was at."""
        self._outcomes.clear()
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.graph(self.graph, stream=self._stream), self._own_run():
                # Kept without its autograd graph: that graph's nodes hold the layers, the
                # layers this object, and a cycle through C++ nodes is never collected.
                self.loss = _detached(self.step_fn())
            current.wait_stream(self._stream)
            self._require_every_layer_stepped(self.step + 1)
        except BaseException:
            self._stop(self.step)
            raise

    def _require_every_layer_stepped(self, step):
        missing = [layer.forge_name for layer in self.layers if layer not in self._outcomes]
        if missing:
            raise RuntimeError(f"fused layers {missing} took no backward in step {step}: a captured step must "
                               "step every fused layer of the model once; the layers are released")

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

    @contextlib.contextmanager
    def _own_run(self):
        self._running = True
        try:
            yield
        finally:
            self._running = False

    def _step_layer(self, layer, x2d, dy2d):
        """A fused layer's step, eager (warm-up) or as the graph records it: its scalars
        and rounding key read from the group's device buffer, its outcome kept for
        ``check``, its ``forge_step`` advanced on the device. A backward outside this
        object's own runs of ``step_fn`` is refused: it would step the layer a second time."""
        if not self._running:
            raise RuntimeError(f"fused layer {layer.forge_name!r} is captured by a CapturedStep: its steps are "
                               "the CapturedStep's calls. Call it, or its release(), not the model's backward")
        if layer in self._outcomes:
            raise RuntimeError(f"fused layer {layer.forge_name!r} took a second backward in one step of a "
                               "CapturedStep: a fused weight takes one step per backward, so step_fn must run one "
                               "backward through each fused layer (no gradient accumulation)")
        with torch.no_grad():
            self._outcomes[layer] = fused_weight_update(
                x2d, dy2d, layer.weight.data, layer.forge_state, layer.rule, self._scalars[layer],
                oracle=layer.oracle, config=layer.config, rounding=layer.rounding, seed=self._scalars[layer].seed,
                weight_slice=layer.weight_slice, report="defer")
            layer.forge_step.add_(1)
        layer._bump_versions(layer.weight.data)

    def check(self):
        """Read the latest step's outcome for every fused layer (one synchronization);
        raise its first error, after stopping the capture (see the module docstring)."""
        if self._checked or not self.active:
            return
        self._checked = True
        with torch.cuda.device(self._device):
            statuses = torch.stack([self._outcomes[layer].status for layer in self.layers]).cpu()
        bad = [layer for layer, status in zip(self.layers, statuses) if bool(status.any())]
        if not bad:
            return
        errors = {}
        for layer in bad:
            try:
                self._outcomes[layer].check()
            except FloatingPointError as error:
                errors[layer] = error
        self._stop(self.step, errors)
        (first_layer, first), *others = errors.items()
        first.args = (f"fused layer {first_layer.forge_name!r}, step {self.step} (CapturedStep): {first.args[0]}; "
                      "the capture is stopped and the layers released",) + first.args[1:]
        if hasattr(first, "add_note"):
            for layer, error in others:
                first.add_note(f"fused layer {layer.forge_name!r} failed too: {error}")
        raise first

    def _stop(self, step, errors=None):
        """Release the layers to eager training and drop the graph, the layers at ``step``
        except those with an entry in ``errors``: ``None`` (took no backward) or a
        ``NonFiniteInputError`` (wrote nothing) leave a layer at step - 1; another error
        (non-finite tiles) stops it at ``step``, as eagerly."""
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
                layer._failed_step = step
        self.graph = self.loss = None
        self._outcomes = {}
        self.active = False

    def release(self):
        """Check the latest step, then give the layers back to eager training at the step
        they are at; the graph is dropped."""
        if not self.active:
            return
        self.check()
        self._stop(self.step)
