"""Training a model whose Linear layers are fused: one object, called once per step.

``Trainer(model, optimizer)`` drives the fused layers (their steps happen inside the
backward) and an ordinary torch optimizer over everything else (embeddings, norms,
biases) in the same ``step()``. It adds one parameter group per fused rule to that
optimizer, holding the fused weights and the rule's hyperparameters under torch.optim's
names: torch optimizers skip parameters without a gradient, and fused weights never have
one, so the group is never stepped by torch, but a torch scheduler moves its ``lr`` (and
momentum: OneCycleLR) like any other and the trainer hands them to the rule before each
step.

Fused steps are taken with ``report="defer"``: no layer waits for the GPU in the
backward; ``step()`` checks every layer's step once at its end (``check_updates``),
before the torch optimizer steps, as torch's GradScaler reads its inf check once.

Global-norm clipping (``max_norm``) is exact: bitwise ``clip_grad_norm_`` then the
oracle step. Gradient accumulation (several micro-batch closures per ``step``) is
bitwise the standard pipeline with ``gradients="materialized"``; on the fused path
(SGD momentum adding into its buffer) it is exact in real arithmetic, its sums rounded
in another order. What each costs is in ``Trainer``'s docstring.
"""

import copy

import torch
# The grouping clip_grad_norm_ itself uses: the norms must be stacked in its order.
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ._backend import on_device, quiet_non_finite
from .errors import NonFiniteInputError, reword
from .linear import ForgeLinear, check_updates
from .ops.finite_check import STATUS_WORDS, launch_finite_check
from .ops.gradient_norm import empty_square_sums, norm_from_square_sums, weight_gradient_norm
from .ops.weight_gradient import weight_gradient
from .tensor_parallel import is_dtensor
from .rules.sgd import SGD, SGDMicroBatch

GRADIENTS = ("fused", "materialized")
CLIPPING = ("exact", "previous-norm")
NORMS = ("gradient", "tiles")
_GROUP_KEY = "forge_rule_index"
# The names of the rule hyperparameters a fused group holds. A checkpoint's group without
# it (saved before groups held them all) held the lr alone: Trainer.load_state_dict brings
# it up to date (_bring_groups_up_to_date), so every group in use has it.
_HELD_KEY = "forge_rule_hyperparameters"
# What torch's schedulers move besides lr: OneCycleLR and CyclicLR cycle one of these.
_SCHEDULED_MOMENTA = ("momentum", "betas")


def fused_layers(model: torch.nn.Module) -> list:
    """The model's fused layers, in ``named_modules()`` order."""
    return [m for m in model.modules() if isinstance(m, ForgeLinear)]


def unfused_parameters(model: torch.nn.Module) -> list:
    """The parameters an ordinary optimizer must step: all but the fused weights."""
    fused = {id(layer.weight) for layer in fused_layers(model)}
    return [p for p in model.parameters() if id(p) not in fused]


def total_norm(params, fused_norms: dict) -> torch.Tensor:
    """The global 2-norm that ``torch.nn.utils.clip_grad_norm_(params, foreach=False)``
    computes, where the fused weights' gradients exist only as their norms.

    ``fused_norms`` maps ``id(weight)`` to ``torch.linalg.vector_norm`` of the weight's
    fp32 gradient. torch takes one norm per gradient, groups them by (device, dtype)
    and takes the norm of the stacked norms; the same grouping and order here give the
    same bits. Parameters without a gradient (and fused weights without a norm: their
    layer took no backward) are left out, as torch leaves out ``grad is None``.
    """
    sources = []
    for p in params:
        if id(p) in fused_norms:
            sources.append(fused_norms[id(p)])
        elif p.grad is not None:
            sources.append(p.grad)
    if not sources:
        return torch.tensor(0.0)
    given = {id(n) for n in fused_norms.values()}
    norms = []
    for ([group], _) in _group_tensors_by_device_and_dtype([sources]).values():
        norms.extend(t if id(t) in given else torch.linalg.vector_norm(t, 2.0) for t in group)
    first_device = sources[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), 2.0)


def clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s factor, computed as torch computes it (a float32 tensor)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def check_max_norm(max_norm) -> None:
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and 0 < max_norm < float("inf")):
        raise ValueError(f"max_norm must be a finite number > 0 (or None for no clipping), got {max_norm!r}")


def check_clipping_mode(clipping, max_norm, default) -> None:
    """``clipping`` says how ``max_norm`` clips (the Trainer's and the CapturedStep's check):
    one named without ``max_norm`` would clip nothing, and is refused."""
    if clipping not in (default, *CLIPPING):
        raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
    if max_norm is None and clipping != default:
        raise ValueError(f"clipping={clipping!r} says how max_norm clips; without max_norm nothing clips: set "
                         f"max_norm, or leave clipping at its default ({default!r})")


def check_norm(norm, max_norm) -> None:
    """``norm`` says how clipping takes the fused layers' norms (the Trainer's and the
    CapturedStep's check): ``"tiles"`` without ``max_norm`` would change nothing, and is refused."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm != "gradient" and max_norm is None:
        raise ValueError("norm='tiles' says how clipping takes the layers' norms; without max_norm nothing clips: "
                         "set max_norm, or leave norm at its default")


# What has happened when a value is refused: before a step runs, in a refused load, while
# the Trainer is made, after a step.
NOTHING_STEPPED = "nothing was stepped"
NOTHING_LOADED = "nothing was loaded"
NOT_MADE = "the Trainer was not made; the optimizer and the rules are as they were"
STEP_TAKEN = ("this step was taken (the fused layers, the torch optimizer and the scheduler stepped); the rules keep "
              "its values, and the next step() refuses the group's until they are corrected")


def non_finite_norm_error(norm: float, stepped: str) -> FloatingPointError:
    return FloatingPointError(f"the global gradient norm is {norm}; {stepped}")


# What has happened when previous-norm clipping finds the norm non-finite.
PREVIOUS_NORM_STEPPED = ("the fused layers have stepped (previous-norm clipping steps them before the norm is known); "
                         "the torch optimizer has not")


def clip_scale(params, max_norm: float, fused_norms: dict, inputs=None, stepped=NOTHING_STEPPED) -> tuple:
    """(global norm, clip coefficient) as ``total_norm`` and ``clip_coefficient`` give
    them; a non-finite norm raises, after ``inputs`` (an ``_InputCheck``, if given) has
    raised its more precise error where non-finite operands are the cause. Synchronizes."""
    norm = total_norm(params, fused_norms)
    if not bool(torch.isfinite(norm)):
        if inputs is not None:
            inputs.raise_if_any()
        raise non_finite_norm_error(float(norm), stepped)
    return norm, clip_coefficient(max_norm, norm)


def rng_rewinder():
    """A function that puts the torch RNG (the CPU's and every CUDA device's) back as it is
    now: exact clipping's two passes then draw the same dropout masks."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def rewind():
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return rewind


def set_aside_clipped_gradients(model, coefficient):
    """Exact clipping's measuring pass leaves the unfused gradients: multiply them by the
    clip ``coefficient`` (the multiply clip_grad_norm_ does) and take them off the
    parameters, so that the stepping pass's backward writes fresh ones; returns a function
    that puts the clipped ones back."""
    unfused = [p for p in unfused_parameters(model) if p.grad is not None]
    clipped = [p.grad.mul_(coefficient) for p in unfused]
    for p in unfused:
        p.grad = None

    def put_back():
        for p, grad in zip(unfused, clipped):
            p.grad = grad
    return put_back


def scale_unfused_gradients(model, factor) -> None:
    for p in unfused_parameters(model):
        if p.grad is not None:
            p.grad.mul_(factor)  # the multiply clip_grad_norm_ does


def check_unfused_optimizer(model, optimizer) -> None:
    """Refuse a torch optimizer that does not hold exactly the model's trainable parameters
    outside its fused layers (``None``: the model must have none)."""
    unfused = unfused_parameters(model)
    if optimizer is None:
        if any(p.requires_grad for p in unfused):
            raise ValueError("the model has parameters outside its fused layers; pass a torch optimizer "
                             "over fk.unfused_parameters(model)")
        return
    fused_ids = {id(layer.weight) for layer in fused_layers(model)}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if stepped & fused_ids:
        raise ValueError("the optimizer holds fused weights; build it over fk.unfused_parameters(model)")
    missing = [name for name, p in model.named_parameters()
               if p.requires_grad and id(p) not in fused_ids and id(p) not in stepped]
    if missing:
        raise ValueError(f"parameters that nothing would step: {missing}; build the optimizer over "
                         "fk.unfused_parameters(model)")


def _fused_group(rule, weights, index) -> dict:
    """The param group of the fused weights stepped by ``rule``: its hyperparameters under
    torch.optim's names, where schedulers move them."""
    hyperparameters = rule.hyperparameters()
    return {"params": weights, **hyperparameters, _GROUP_KEY: index, _HELD_KEY: tuple(hyperparameters)}


def _as_rule_value(value):
    """A group's value as a rule holds it: a float (a tensor lr read once), a tuple of them, a bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_as_rule_value(v) for v in value)
    return float(value)


def _group_kind(group) -> str:
    return "unfused" if _GROUP_KEY not in group else f"fused rule {group[_GROUP_KEY]}"


def _set_hyperparameters(rule, values: dict) -> None:
    for name, value in values.items():
        setattr(rule, name, value)


def _check_rule_takes(rule, values: dict, previous: dict, done: str) -> None:
    """Refuse ``values`` (name -> value) that ``rule`` would refuse, checked on a copy of
    it, so that a refused value never reaches the rule. The error names the values that
    differ from ``previous`` and ends with ``done`` (what has happened by then)."""
    trial = copy.copy(rule)
    _set_hyperparameters(trial, values)
    try:
        trial._validate()
    except (ValueError, TypeError) as error:
        changed = {name: value for name, value in values.items() if name not in previous or value != previous[name]}
        changed = ", ".join(f"{name}={value!r}" + (f" (was {previous[name]!r})" if name in previous else "")
                            for name, value in (changed or values).items())
        raise type(error)(f"the fused {type(rule).__name__} group's {changed} is refused: {error}; {done}") from error


def _restorer(optimizer, rules):
    """A function that puts ``optimizer``'s param groups (how many, and what each holds)
    and the ``rules``' hyperparameters back as they are now."""
    groups = [] if optimizer is None else [(group, dict(group)) for group in optimizer.param_groups]
    values = [(rule, rule.hyperparameters()) for rule in rules]

    def restore():
        if optimizer is not None:
            del optimizer.param_groups[len(groups):]
            for group, held in groups:
                group.clear()
                group.update(held)
        for rule, hyperparameters in values:
            _set_hyperparameters(rule, hyperparameters)
    return restore


class _FusedGroupsOnly(torch.optim.Optimizer):
    """The Trainer's optimizer for a model without unfused parameters: it holds the fused
    groups for schedulers and checkpoints and steps nothing. Its defaults are the first
    rule's hyperparameters, so a scheduler that asks them finds what the rule has
    (OneCycleLR cycles AdamW's betas, SGD's momentum)."""

    def __init__(self, groups):
        super().__init__(groups, {name: groups[0][name] for name in groups[0][_HELD_KEY]})

    def step(self, closure=None):
        return None if closure is None else closure()


class _InputCheck:
    """Non-finite operands of the fused layers' gradients (materialized, or their norms
    taken from the tile loop): counted on the device as each layer's norm is taken (no
    synchronization), read once per step."""

    def __init__(self):
        self.status = {}

    def count(self, x2d, dy2d):
        status = self.status.get(x2d.device)
        if status is None:
            status = self.status[x2d.device] = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=x2d.device)
        with on_device(x2d.device), quiet_non_finite():
            launch_finite_check(status, x2d, dy2d)

    def raise_if_any(self):
        counts = [sum(words) for words in zip(*(status[:2].tolist() for status in self.status.values()))]
        if any(counts):
            raise NonFiniteInputError(f"non-finite inputs to the fused layers: {counts[0]} activation and {counts[1]} "
                                      "output-gradient element(s) are NaN or infinite; nothing was updated")


def _layer_gradient(layer, x2d, dy2d, inputs=None):
    """The layer's fp32 weight gradient through the fused kernel's own tile loop (so it is
    the gradient the fused step would use); non-finite operands are counted in
    ``inputs`` (an ``_InputCheck``), which the caller reads before anything steps."""
    grad = weight_gradient(x2d, dy2d, config=layer.config)
    if inputs is not None:
        inputs.count(x2d, dy2d)
    return grad


def _layer_norm(layer, x2d, dy2d, norm, inputs=None):
    """The layer's gradient norm for clipping: ``vector_norm`` of the materialized gradient
    (``norm="gradient"``: ``clip_grad_norm_``'s bits), or from the fused kernel's tile loop
    without a gradient (``"tiles"``, ``weight_gradient_norm``). Non-finite operands are
    counted in ``inputs`` either way. (A layer that steps before its norm is needed
    keeps its tiles' sums in the fused step instead: ``_step_keeping_norm``.)"""
    if norm == "gradient":
        return torch.linalg.vector_norm(_layer_gradient(layer, x2d, dy2d, inputs), 2.0)
    if inputs is not None:
        inputs.count(x2d, dy2d)
    return weight_gradient_norm(x2d, dy2d, config=layer.config)


def layer_square_sums(layer):
    """A buffer for the fused layer's tiles' sums of squares (``fused_weight_update(...,
    square_sums=)``), one float per tile of its config."""
    return empty_square_sums(tuple(layer.weight.shape), layer.config, layer.weight.device)


def _step_keeping_norm(layer, x2d, dy2d, grad_scale):
    """A deferred fused step (clip factor ``grad_scale``, a number or a device tensor) that
    keeps its tiles' sums of squares of the unscaled gradient; returns the layer's gradient
    norm from them (``norm="tiles"`` in previous-norm clipping: one tile loop for both)."""
    sums = layer_square_sums(layer)
    layer._apply_step(x2d, dy2d, grad_scale=grad_scale, report="defer", square_sums=sums)
    return norm_from_square_sums(sums)


def _deferred_step(layer, x2d, dy2d):
    layer._apply_step(x2d, dy2d, report="defer")


def _refuse_backward_in_closure(layer, x2d, dy2d):
    # The fused layers' backward action while a closure runs: a torch.optim-style closure
    # that calls backward() itself would step them before the Trainer clips or checks.
    raise RuntimeError(f"a backward through fused layer {layer.forge_name!r} ran inside the closure: the closure "
                       "must return the loss, and the Trainer calls backward() (it clips, accumulates and checks the "
                       "fused steps around it)")


def _bits(tensor):
    return tensor.detach().reshape(-1).view(torch.uint8)


def _check_repeated_pass(first, again):
    """Exact clipping's stepping pass must repeat its norm pass: the same fused layers in
    the forward and the same loss, bit for bit (``first`` and ``again``: each pass's (loss,
    fused layers with a pending backward)). Checked before the stepping pass's backward, so
    a closure that is not repeatable (one drawing its batch, ``next(batches)``) steps nothing."""
    (first_loss, first_layers), (loss, layers) = first, again
    if layers != first_layers:
        raise RuntimeError(
            "exact clipping's two passes ran different fused layers (in the norm pass only: "
            f"{[n for n in first_layers if n not in layers]}; in the stepping pass only: "
            f"{[n for n in layers if n not in first_layers]}): the closure must run the same layers each time it "
            "is called; nothing was stepped")
    if not torch.equal(_bits(first_loss), _bits(loss)):
        raise RuntimeError(
            f"exact clipping's two passes gave different losses ({first_loss.tolist()!r}, then {loss.tolist()!r}): "
            "the closure must compute the same loss each time it is called (the torch RNG is rewound between the "
            "passes). Draw the batch outside it (x, y = next(batches); trainer.step(lambda: model.loss(x, y))), "
            "and use deterministic kernels (torch.use_deterministic_algorithms(True)); nothing was stepped")


def _tell(error: BaseException, text: str) -> None:
    """Add ``text`` to ``error``'s message (or, where the message is not a string, as a note)."""
    if error.args and isinstance(error.args[0], str):
        reword(error, "", text)
    elif hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(text.strip())


class _WeightStep(SGDMicroBatch):
    """The weight step ``w ← w − lr·buf`` of a layer whose last call in an accumulated step
    came before the last micro-batch, its buffer left as it is. The kernel still adds
    ``c·(g + 0·w)`` to the buffer: here c = 0 and the gradient is −1 (``_unit_gradient``),
    so that term is −0, and buf + (−0) is buf for every buf, −0 included (a +0 term would
    turn a −0 into +0): the layer's step is bitwise the split over its own calls."""

    def __init__(self, sgd: SGD):
        super().__init__(sgd, first=False, last=True)

    def _host_scalars(self, step):
        lr, weight_decay, buf_factor, _, momentum = super()._host_scalars(step)
        return (lr, weight_decay, buf_factor, 0.0, momentum)


def _unit_gradient(layer):
    """(x2d, dy2d) of one token whose weight gradient dYᵀX is −1 in every element."""
    weight = layer.weight
    x2d = torch.ones(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    return x2d, -torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)


# Why the Trainer stops a layer after an accumulated step that failed part-way (forge_stop).
PARTIAL_SUM = ("an accumulated step that failed part-way left a partial sum of its micro-batches in the momentum "
               "buffer, the weight not stepped")


class _MicroBatchSteps:
    """The phases of one accumulated SGD-momentum step (``SGDMicroBatch``), chosen by each
    layer's own calls, as autograd sums only the micro-batches that reach a layer: its
    first call in the step takes the first phase (b·buf and wd·w), a call in the last
    micro-batch the last (the weight steps), and a layer whose last call came earlier
    takes its weight step after the last micro-batch (``finish``). A layer called in no
    micro-batch takes no step, as torch.optim skips a parameter without a gradient.

    A phase that adds into the buffer cannot be undone (keeping the buffers to restore
    them would cost 4 bytes per fused parameter), so the step is not all-or-nothing: it
    knows which layers have added part of its sum (``holding``) and, after an error,
    stops those whose weight did not step (``stop_partial``)."""

    def __init__(self, micro_batches: int, steps_before: dict):
        self.last = micro_batches - 1
        self.steps_before = steps_before  # each layer's step count before this step
        self.called = set()  # the layers called so far in this step
        self.weight_stepped = set()  # the layers whose weight step is launched
        self.accumulating = set()  # the layers whose latest phase adds into the buffer, unchecked
        self.holding = {}  # the layers with a clean phase that added into the buffer, in order

    def _check_previous(self, layer):
        """Check the layer's latest phase (raising its error): each phase waits for the
        one before, so a failure stops the step as it would stop the layer alone."""
        accumulating = layer in self.accumulating
        self.accumulating.discard(layer)
        layer.forge_check()
        if accumulating:
            self.holding[layer] = None

    def backward_for(self, index):
        def accumulate(layer, x2d, dy2d):
            self._check_previous(layer)
            last = index == self.last
            phase = SGDMicroBatch(layer.rule, first=layer not in self.called, last=last)
            layer._apply_step(x2d, dy2d, rule=phase, advance=last, report="defer")
            self.called.add(layer)
            (self.weight_stepped if last else self.accumulating).add(layer)
        return accumulate

    def finish(self, layers):
        for layer in layers:
            if layer in self.called and layer not in self.weight_stepped:
                self._check_previous(layer)
                layer._apply_step(*_unit_gradient(layer), rule=_WeightStep(layer.rule), report="defer")
                self.weight_stepped.add(layer)

    def stop_partial(self) -> list:
        """After an error: the layers holding part of this step's sum whose weight did not
        step, stopped as a failed update stops a layer (restore, or accept the partial
        step); their outcomes read first (a failed one is not raised again)."""
        for layer in self.called:
            try:
                self._check_previous(layer)
            except FloatingPointError:
                pass
        partial = [layer for layer, step in self.steps_before.items()
                   if layer in self.holding and layer._counters()[0] == step]
        for layer in partial:
            layer.forge_stop(self.steps_before[layer] + 1, PARTIAL_SUM)
        return partial


def refuse_stopped_layers(layers, remedy: str) -> None:
    """Raise naming every stopped layer of ``layers`` (``ForgeLinear.forge_stop``), its step
    and why, then ``remedy``; nothing if none is stopped."""
    stopped = [f"{layer.forge_name!r} at step {layer._failed_step} ({layer._failed_reason})"
               for layer in layers if layer._failed_step is not None]
    if stopped:
        raise RuntimeError(f"fused layers stopped: {'; '.join(stopped)}. {remedy}")


class Trainer:
    """One training step for a fused model and the torch optimizer of its other parameters.

    ``model`` holds ``ForgeLinear`` layers (``fk.fuse``); ``optimizer`` is a torch
    optimizer over exactly ``unfused_parameters(model)`` (``None`` when there are none).
    ``scheduler``, if given, is a callable ``optimizer -> LRScheduler``; it is built after
    the fused groups are added, so it drives the fused rules' ``lr`` (and momentum) too,
    and it is stepped once per ``step()``. ``ReduceLROnPlateau`` steps on a metric: build
    it on ``trainer.optimizer`` and step it yourself. A scheduler cycling a momentum that a
    fused rule lacks or refuses (OneCycleLR, CyclicLR) is refused when the Trainer is made;
    a refused Trainer leaves the optimizer and the rules as they were. A rule
    hyperparameter set on the rule (``rule.lr = ...``) is adopted into its group at the
    next step; a group value the rule refuses reaches no rule.

    ``step(closures)``: ``closures`` is one callable, or a list with one per micro-batch;
    each runs a forward and returns a scalar loss, which the trainer backpropagates
    (scale it by 1/M yourself for a mean over M micro-batches, as with ``.grad``
    accumulation; a backward through a fused layer inside the closure is refused).
    Forward passes must be repeatable when clipping exactly: the torch RNG state is
    restored between the two passes, so dropout draws the same masks, and the stepping
    pass must run the same fused layers and give the same loss bits as the norm pass
    (checked before its backward, so a closure drawing its own batch steps nothing).
    A layer stopped by a failed step refuses the next ``step()`` before anything runs; an
    error part-way through a step names the fused layers that had stepped.

    ``gradients="fused"`` (default): dW never exists.

    * ``max_norm``: exact global-norm clipping in two passes. The first forward/backward
      takes no step: each fused layer materializes its fp32 gradient (the fused kernel's
      own tile loop, ``weight_gradient``) one layer at a time, keeps its norm and frees
      it; unfused parameters keep their ``.grad``. The global norm and clip factor are
      computed as ``clip_grad_norm_(..., foreach=False)`` computes them. The second
      forward/backward takes the fused steps with the gradient multiplied by that factor
      in the kernel. Cost: one extra forward and backward, one weight-gradient GEMM per
      layer, transient memory of the largest layer's fp32 gradient, and host
      synchronizations: one for the clip factor, and one per micro-batch (its stepping
      pass's loss compared with the norm pass's before the backward, ``_check_repeated_pass``).
    * ``clipping="previous-norm"``: APPROXIMATE, one pass. Step t is scaled by the clip
      factor of step t-1's global norm (step 1 clips exactly); each layer's gradient is
      materialized transiently for its norm and the step taken from it. A gradient spike
      passes unclipped on the step it happens: see ``forge_verify.commands.clipping_spike`` for
      the measured deviation.
    * ``norm="tiles"`` (with ``max_norm``, either clipping mode): no fused layer's gradient
      is ever stored. Each layer's norm comes from one sum of squares per tile of its
      gradient tiles (extra memory one float per tile): from the tile loop alone where
      nothing steps (``weight_gradient_norm``, exact clipping's first pass), kept by the
      fused step where it steps (previous-norm clipping), and the layer steps fused. The
      norm is deterministic and within the
      bound of ``proofs/gradient_norm.md`` of the gradient's exact norm (about 1.2e-4
      relative for 64 x 64 tiles), but not ``clip_grad_norm_``'s bits: its squares are
      summed in another order. Where the clip factor is 1 the steps are bitwise those of
      ``norm="gradient"`` (default: the norms and bits above). Cost: in exact clipping,
      the first pass runs the tile loop instead of the gradient GEMM; in previous-norm
      clipping the fused step keeps its tiles' sums itself (``fused_weight_update(...,
      square_sums=)``: no second pass over the tokens).
    * Accumulation over micro-batches: only SGD with momentum (not Nesterov) with fp32
      state, accumulating into the momentum buffer (``SGDMicroBatch``), no extra memory.
      The phases follow each layer's own calls (``_MicroBatchSteps``): a layer that only
      some micro-batches reach (an expert) steps on the sum of those, one that none
      reaches takes no step. Other rules are refused: they are not affine in the
      gradient, so the micro-batch gradients must be summed before the rule.

    ``gradients="materialized"``: every fused layer's backward adds its fp32 gradient to a
    buffer; after the last micro-batch the rule runs on the buffer (``apply_rule``), with
    the clip factor if ``max_norm`` is set (one pass). Any rule, clipping and accumulation
    together, bitwise the standard pipeline (``.grad`` accumulation, ``clip_grad_norm_``,
    then the rule); it costs 4 bytes per fused parameter for the buffers, the memory the
    fused path saves.

    Non-finite values: the fused steps are deferred (``report="defer"``), so a layer whose
    inputs or tiles are non-finite does not stop the backward; it writes nothing (or
    leaves its bad tiles), the other layers step, and ``step()`` raises at its end, before
    the torch optimizer steps. The passes that materialize gradients (exact clipping's
    norm pass, ``"materialized"``) count non-finite operands on the device and raise
    before any fused layer steps. With several micro-batches on the fused path, a layer
    checks its previous micro-batch's step before taking the next (a wait for that
    step's event, not for the whole queue), so a failure stops the step there. A layer
    whose momentum buffer then holds part of the step's sum, its weight not stepped, is
    stopped as after a failed update (the error names it; restore a checkpoint, or
    ``forge_accept_partial_step()`` to go on from the partial sum): the buffers are not
    copied to undo it, which would cost 4 bytes per fused parameter.
    """

    def __init__(self, model, optimizer=None, *, scheduler=None, max_norm=None, clipping="exact", gradients="fused",
                 norm="gradient"):
        if gradients not in GRADIENTS:
            raise ValueError(f"gradients must be one of {GRADIENTS}, got {gradients!r}")
        check_clipping_mode(clipping, max_norm, default="exact")
        check_norm(norm, max_norm)
        if norm != "gradient" and gradients != "fused":
            raise ValueError("norm='tiles' takes the norm without the gradient, on the fused path; "
                             "gradients='materialized' stores every gradient and clips by clip_grad_norm_")
        if clipping != "exact" and gradients != "fused":
            raise ValueError("gradients='materialized' clips exactly in one pass; clipping='previous-norm' is for "
                             "the fused path")
        check_max_norm(max_norm)
        self.model, self.gradients, self.max_norm, self.clipping = model, gradients, max_norm, clipping
        self.norm = norm
        self.layers = fused_layers(model)
        if not self.layers:
            raise ValueError("the model has no fused layers; call fk.fuse(model, rule) first")
        captured = [layer.forge_name for layer in self.layers if layer.forge_owner is not None]
        if captured:
            raise RuntimeError(f"fused layers {captured[:3]} are captured by a CapturedStep: release() it before "
                               "training the model with a Trainer")
        sharded = [layer.forge_name for layer in self.layers if is_dtensor(layer.weight)]
        if sharded:
            raise NotImplementedError(
                f"the Trainer does not handle tensor-parallel fused layers yet ({sharded[0]!r} holds a DTensor "
                "weight): its clipping and accumulation passes would take gradients of the whole weight. Let "
                "those layers step in their own backward, without a Trainer")
        self.rules = []
        for layer in self.layers:
            if not any(layer.rule is r for r in self.rules):
                self.rules.append(layer.rule)
        if scheduler is not None and not callable(scheduler):
            raise TypeError("scheduler must be a callable optimizer -> LRScheduler (e.g. lambda opt: "
                            "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)): it has to be built after "
                            "the trainer adds the fused groups to the optimizer")
        # A refused Trainer leaves the user's optimizer and rules as they were: its groups
        # added, and a scheduler's values set when it is built, are undone.
        undo = _restorer(optimizer, self.rules)
        try:
            self.optimizer = self._with_fused_groups(optimizer)
            self._synced = {}  # rule index -> its group's values at the last sync
            self._sync_hyperparameters(done=NOT_MADE)
            self.scheduler = None if scheduler is None else self._built_scheduler(scheduler)
        except BaseException:
            undo()
            raise
        self.last_norm = None

    def _with_fused_groups(self, optimizer):
        check_unfused_optimizer(self.model, optimizer)
        groups = [_fused_group(rule, [layer.weight for layer in self.layers if layer.rule is rule], index)
                  for index, rule in enumerate(self.rules)]
        if optimizer is None:
            return _FusedGroupsOnly(groups)
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

    def _built_scheduler(self, build):
        """The scheduler ``build(optimizer)`` makes, checked, its values given to the rules."""
        scheduler = build(self.optimizer)
        name = type(scheduler).__name__
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("ReduceLROnPlateau steps on a metric (scheduler.step(val_loss)) that the Trainer does not "
                            "have: pass no scheduler=, build it on trainer.optimizer after the Trainer and call its "
                            "step(metric) yourself; the Trainer hands the reduced lr to the fused rules at the next "
                            f"step; {NOT_MADE}")
        self._check_cycled_momenta(name)
        # A scheduler may set them when it is built (OneCycleLR's momentum).
        self._sync_hyperparameters(done=f"{name} set it when it was built; {NOT_MADE}")
        return scheduler

    def _check_cycled_momenta(self, name):
        """Refuse a scheduler that cycles a momentum (OneCycleLR, CyclicLR: ``max_momentum``
        and ``base_momentum`` in every group, the optimizer's kind of momentum cycled
        between them) that a fused rule does not have, or through values it refuses:
        found when it is built, not after a step has been taken with it (``name``: the
        scheduler's). Nothing is written."""
        key = "betas" if "betas" in self.optimizer.defaults else "momentum"  # as torch's schedulers choose
        for group in self.optimizer.param_groups:
            if _GROUP_KEY not in group or "max_momentum" not in group:
                continue
            rule = self.rules[group[_GROUP_KEY]]
            rule_name = type(rule).__name__
            if key not in group[_HELD_KEY]:
                raise ValueError(f"{name} cycles the {key!r} of every param group (cycle_momentum=True), the fused "
                                 f"{rule_name} group's too, but {rule_name} has no {key} (it has "
                                 f"{list(rule.hyperparameters())}): the cycle would be lost. Build the scheduler "
                                 f"with cycle_momentum=False; {NOT_MADE}")
            low, high = group["base_momentum"], group["max_momentum"]
            for momentum in (low, high):
                value = momentum if key == "momentum" else (momentum, *_as_rule_value(group["betas"])[1:])
                _check_rule_takes(rule, {key: _as_rule_value(value)}, previous={}, done=(
                    f"{name} cycles the fused {rule_name} group's {key} between {low!r} and {high!r}. Build the "
                    f"scheduler with cycle_momentum=False; {NOT_MADE}"))

    def _sync_hyperparameters(self, done=NOTHING_STEPPED):
        """Give each fused rule its group's hyperparameters, where a scheduler moves them.
        One set on the rule itself since the last sync (``rule.lr = ...``) is adopted into
        the group first, as a change of ``group["lr"]`` by hand would be; one set on both
        is refused. A momentum that a scheduler moves in the group but the rule does not
        have (SGD's momentum for AdamW) is refused: the rule would never see it. Every
        group is checked before any rule or group is written, so a refused value (its
        error ends with ``done``) reaches no rule and is refused again at the next sync."""
        updates = [self._group_update(group, done) for group in self.optimizer.param_groups if _GROUP_KEY in group]
        for group, values, adopted, record in updates:
            group.update(adopted)
            _set_hyperparameters(self.rules[group[_GROUP_KEY]], values)
            self._synced[group[_GROUP_KEY]] = record

    def _group_update(self, group, done):
        """(group, the values its rule takes, those adopted into the group from the rule,
        the record of this sync) for one fused group, checked; nothing is written."""
        index = group[_GROUP_KEY]
        rule, synced = self.rules[index], self._synced.get(index, {})
        held = group[_HELD_KEY]
        own = rule.hyperparameters()
        values, adopted = {}, {}
        for name in held:
            mine, theirs = _as_rule_value(own[name]), _as_rule_value(group[name])
            if name in synced and mine != synced[name]:  # set on the rule
                if theirs not in (synced[name], mine):
                    raise ValueError(f"{type(rule).__name__}'s {name} was set to {mine!r} on the rule and to "
                                     f"{theirs!r} in its param group since the last step: set it in one place; "
                                     f"{done}")
                adopted[name] = theirs = mine
            values[name] = theirs
        if any(value != _as_rule_value(own[name]) for name, value in values.items()):
            # Values the rule already holds need no trial (most steps: nothing moved).
            _check_rule_takes(rule, values, previous={**own, **synced}, done=done)
        moved = [name for name in _SCHEDULED_MOMENTA if name in synced and name not in held
                 and _as_rule_value(group[name]) != synced[name]]
        if moved:
            raise ValueError(f"the fused {type(rule).__name__} group's {moved[0]!r} was moved (to "
                             f"{group[moved[0]]!r}, by a scheduler?), but {type(rule).__name__} has no "
                             f"{moved[0]} (it has {list(own)}): the change would be lost. Build the scheduler "
                             f"without it (OneCycleLR, CyclicLR: cycle_momentum=False); {done}")
        record = {name: values[name] if name in values else _as_rule_value(group[name])
                  for name in (*held, *_SCHEDULED_MOMENTA) if name in group}
        return group, values, adopted, record

    def step(self, closures):
        """One optimizer step over the micro-batches ``closures``; returns their losses
        (detached, from the pass that stepped)."""
        closures = [closures] if callable(closures) else list(closures)
        if not closures or not all(callable(c) for c in closures):
            raise TypeError("step takes a callable returning the loss, or a non-empty list of them")
        self._sync_hyperparameters()
        self._refuse_stopped_layers()
        if self.gradients == "fused" and len(closures) > 1:
            self._check_accumulates_in_state()
        steps_before = {layer: layer._counters()[0] for layer in self.layers}
        try:
            if self.gradients == "materialized":
                losses = self._materialized_step(closures)
            elif self.max_norm is not None and self.clipping == "previous-norm" and self.last_norm is not None:
                losses = self._previous_norm_step(closures)
            elif self.max_norm is not None:
                losses = self._clipped_fused_step(closures)
            else:
                losses = self._fused_step(closures, steps_before)
            # The fused steps were deferred: their outcome, read once for every layer.
            check_updates(self.model)
        except BaseException as error:
            self._name_layers_stepped(error, steps_before)
            # Unfused gradients of a step that did not finish must not leak into the next.
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        # So the rules always show the next step's values; one the scheduler moved to a value
        # refused here is refused again, before anything runs, by the next step().
        self._sync_hyperparameters(done=STEP_TAKEN)
        return losses

    def _refuse_stopped_layers(self):
        """A fused layer stopped by a failed step would raise in its own backward, after
        the layers before it in the backward had stepped: refuse the step before anything runs."""
        refuse_stopped_layers(self.layers, "Restore a checkpoint (trainer.load_state_dict), or call "
                                           "forge_accept_partial_step() on each to go on from here; nothing was stepped")

    def _name_layers_stepped(self, error, steps_before):
        """Say in ``error`` which fused layers stepped in this step before it: their steps
        stay taken (their deferred outcomes read first), the torch optimizer's is not."""
        for layer in self.layers:
            if layer.forge_owner is not None:
                continue  # a CapturedStep's (refused in _run): it took no step here
            try:
                layer.forge_check()
            except FloatingPointError:
                pass  # wrote nothing, or stopped (the next step says so): it did not step
        stepped = [layer.forge_name for layer, step in steps_before.items() if layer._counters()[0] > step]
        if stepped:
            _tell(error, f" [fused layers {stepped} had stepped in this step before this error and keep their steps; "
                         "the torch optimizer did not step]")

    def _layers_in_forward(self):
        """The fused layers whose forward ran and whose backward has not."""
        return [layer.forge_name for layer in self.layers if layer._pending]

    def _run(self, closures, backward_for, before_backward=None):
        """Forward and backward every micro-batch, with ``backward_for(index)`` as the fused
        layers' backward action and ``before_backward(index, loss)``, if given, called
        between the forward and the backward."""
        losses = []
        captured = [layer.forge_name for layer in self.layers if layer.forge_owner is not None]
        if captured:
            raise RuntimeError(f"fused layers {captured[:3]} were captured by a CapturedStep after this Trainer was "
                               "made: release() it before the Trainer steps them")
        try:
            for index, closure in enumerate(closures):
                self._set_backward(_refuse_backward_in_closure)
                loss = closure()
                if before_backward is not None:
                    before_backward(index, loss)
                self._set_backward(backward_for(index))
                loss.backward()
                losses.append(loss.detach())
        finally:
            self._set_backward(None)
        return losses

    def _set_backward(self, action):
        for layer in self.layers:
            layer.forge_backward = action

    def _fused_step(self, closures, steps_before):
        if len(closures) == 1:
            return self._run(closures, lambda index: _deferred_step)
        steps = _MicroBatchSteps(len(closures), steps_before)
        try:
            losses = self._run(closures, steps.backward_for)
            steps.finish(self.layers)
            check_updates(self.model)
        except BaseException as error:
            partial = steps.stop_partial()
            if partial:
                _tell(error, f". The accumulated step stopped part-way: the momentum buffers of fused layers "
                             f"{[layer.forge_name for layer in partial]} hold a partial sum of its micro-batches and "
                             "their weights did not step; those layers are stopped: restore a checkpoint, or call "
                             "forge_accept_partial_step() on each to go on from the partial sums")
            raise
        return losses

    def _check_accumulates_in_state(self):
        for layer in self.layers:
            if layer.input_check == "tiles":
                raise ValueError(
                    f"fused layer {layer.forge_name!r}: gradient accumulation with gradients='fused' adds each "
                    "micro-batch into the state, and with input_check='tiles' a non-finite input in one micro-batch "
                    "would leave only the parts it does not reach holding that micro-batch: fuse the layers with "
                    "input_check='step' to accumulate")
            rule = layer.rule
            ok = isinstance(rule, SGD) and rule.slots == ("momentum_buffer",) and not rule.nesterov
            if not ok or self.max_norm is not None or rule.state_format(layer.forge_state) != "fp32":
                raise ValueError(
                    f"fused layer {layer.forge_name!r}: gradient accumulation with gradients='fused' needs SGD with "
                    "momentum (not Nesterov), fp32 state and no clipping: only then can the micro-batches' "
                    "gradients be added into the state before the rule. Alternatives: "
                    "Trainer(..., gradients='materialized') (any rule, clipping too; an fp32 gradient buffer, "
                    "4 bytes per fused parameter), or one larger micro-batch per step")

    def _clipped_fused_step(self, closures):
        rewind = rng_rewinder()
        norms = {}
        inputs = _InputCheck()
        norm_pass = []  # each micro-batch's (loss, fused layers in its forward)

        def measure(layer, x2d, dy2d):
            norms[id(layer.weight)] = _layer_norm(layer, x2d, dy2d, self.norm, inputs)

        # A copy of each loss: a closure may return one buffer it writes each time, which
        # the stepping pass would overwrite before the comparison.
        self._run(closures, lambda index: measure, before_backward=lambda index, loss: norm_pass.append(
            (loss.detach().clone(), self._layers_in_forward())))
        scale = self._clip_scale(norms, inputs)
        scale_value = float(scale)
        put_back = set_aside_clipped_gradients(self.model, scale)
        rewind()
        stepped = set()

        def clipped_step(layer, x2d, dy2d):
            # Past the checks of the forward (_check_repeated_pass), the backward can still
            # differ: a layer the loss reached in one pass only.
            if id(layer.weight) not in norms:
                raise RuntimeError(f"fused layer {layer.forge_name!r} ran its backward in the stepping pass but not in "
                                   "the norm pass: the closure must run the same layers each time it is called")
            layer._apply_step(x2d, dy2d, grad_scale=scale_value, report="defer")
            stepped.add(id(layer.weight))

        losses = self._run(closures, lambda index: clipped_step, before_backward=lambda index, loss: (
            _check_repeated_pass(norm_pass[index], (loss.detach(), self._layers_in_forward()))))
        unstepped = [layer.forge_name for layer in self.layers if id(layer.weight) in norms.keys() - stepped]
        if unstepped:
            raise RuntimeError(f"fused layers {unstepped} ran their backward in the norm pass but not in the stepping "
                               "pass (their norms are in the clip factor; they did not step): the closure must run "
                               "the same layers each time it is called")
        put_back()
        return losses

    def _previous_norm_step(self, closures):
        """APPROXIMATE clipping: one pass, the gradient scaled by the clip factor of the
        previous step's global norm (the current one is known only after every layer has
        stepped). With ``norm="gradient"`` each layer's gradient is materialized, one layer
        at a time, for its norm and the step is taken from it (the bits the fused kernel
        would give); with ``"tiles"`` the layer steps fused and its norm comes from the
        fused step's own tile sums (no second pass over the tokens)."""
        scale = clip_coefficient(self.max_norm, self.last_norm)
        scale_value = float(scale)
        norms = {}

        def measure_and_step(layer, x2d, dy2d):
            if self.norm == "tiles":
                norms[id(layer.weight)] = _step_keeping_norm(layer, x2d, dy2d, scale_value)
                return
            grad = _layer_gradient(layer, x2d, dy2d)
            norms[id(layer.weight)] = torch.linalg.vector_norm(grad, 2.0)
            # apply_rule (and the fused step) refuse a non-finite gradient or operand
            # themselves: nothing is written for that layer, and check_updates below says so.
            layer._apply_step(None, None, grad=grad, grad_scale=scale_value, report="defer")

        losses = self._run(closures, lambda index: measure_and_step)
        check_updates(self.model)  # the steps' own errors first: they name what was (not) written
        # This step's norm, for the next step; a non-finite one is refused, but the fused
        # layers have stepped by now (this mode steps them before the norm is known).
        self._clip_scale(norms, stepped=PREVIOUS_NORM_STEPPED)
        scale_unfused_gradients(self.model, scale)
        return losses

    def _clip_scale(self, fused_norms, inputs=None, stepped=NOTHING_STEPPED):
        self.last_norm, coefficient = clip_scale(self.model.parameters(), self.max_norm, fused_norms, inputs, stepped)
        return coefficient

    def _materialized_step(self, closures):
        buffers = {}
        inputs = _InputCheck()

        def accumulate(layer, x2d, dy2d):
            grad = _layer_gradient(layer, x2d, dy2d, inputs)
            if layer in buffers:
                buffers[layer].add_(grad)  # what autograd does to an existing .grad
            else:
                buffers[layer] = grad

        losses = self._run(closures, lambda index: accumulate)
        scale = 1.0
        if self.max_norm is not None:
            coefficient = self._clip_scale({id(layer.weight): torch.linalg.vector_norm(grad, 2.0)
                                            for layer, grad in buffers.items()}, inputs)
            scale_unfused_gradients(self.model, coefficient)
            scale = float(coefficient)
        else:
            inputs.raise_if_any()
        for layer, grad in buffers.items():
            layer._apply_step(None, None, grad=grad, grad_scale=scale, report="defer")
        return losses

    def state_dict(self) -> dict:
        """The whole training state: the model (weights, fused state, step counts, rounding
        seeds, and each fused layer's record of its rule: the class and its hyperparameters
        but the lr), the torch optimizer (its fused groups hold every hyperparameter of
        their rules, the lr and any scheduled momentum among them), the scheduler and the
        last global norm."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "last_norm": self.last_norm}

    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict()``'s state, or refuse it and change nothing: a checkpoint
        whose groups are not this trainer's (another rule's hyperparameters in a fused
        group), with values a rule refuses, or that a fused layer refuses (its state format,
        rule, hyperparameters: ``ForgeLinear``) raises before the model is loaded, the
        optimizer, scheduler and rules put back. (An error of torch's own model load, a
        shape or a missing key, leaves the model as torch leaves it; the rest is put back.)
        A fused group saved before groups held every hyperparameter held the lr alone: it
        takes its rule's others, which the fused layers' records are then checked against."""
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise ValueError(f"the checkpoint and this trainer disagree on having a scheduler; {NOTHING_LOADED}")
        # Before the optimizer's load, whose own error for another layout names nothing.
        self._check_group_layout(state["optimizer"]["param_groups"])
        restore = self._state_restorer()
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self._bring_groups_up_to_date()
            self._check_group_rules()
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            # The loaded groups replace the old ones: the rules take their values (a scheduler's
            # momentum among them) before the fused layers check their checkpoint's record of them.
            self._synced = {}
            self._sync_hyperparameters(done=NOTHING_LOADED)
            self._check_layer_records(state["model"])
            self.model.load_state_dict(state["model"])
        except BaseException:
            restore()
            raise
        self.last_norm = state["last_norm"]  # clipping='previous-norm' scales the next step by it

    def _check_group_layout(self, saved_groups):
        """Refuse a checkpoint whose param groups are not where this trainer's are (saved by
        another model or optimizer)."""
        saved, ours = ([_group_kind(group) for group in groups]
                       for groups in (saved_groups, self.optimizer.param_groups))
        if saved != ours:
            raise ValueError(f"the checkpoint's param groups are {saved}, this trainer's are {ours}: it was saved by "
                             f"another model or optimizer; {NOTHING_LOADED}")

    def _bring_groups_up_to_date(self):
        """A loaded fused group saved before groups held every hyperparameter held the lr
        alone: it is given its rule's other hyperparameters (those the fused layers'
        records are checked against) and their names, as the Trainer makes its groups."""
        for group in self.optimizer.param_groups:
            if _GROUP_KEY in group and _HELD_KEY not in group:
                hyperparameters = self.rules[group[_GROUP_KEY]].hyperparameters()
                group.update({name: value for name, value in hyperparameters.items() if name != "lr"})
                group[_HELD_KEY] = tuple(hyperparameters)

    def _check_group_rules(self):
        """Refuse loaded fused groups holding the hyperparameter names of another rule than
        this trainer's (its rule would be given values it has no name for)."""
        for group in self.optimizer.param_groups:
            if _GROUP_KEY not in group:
                continue
            rule = self.rules[group[_GROUP_KEY]]
            names = list(rule.hyperparameters())
            if set(group[_HELD_KEY]) != set(names):
                raise ValueError(f"the checkpoint's fused group {group[_GROUP_KEY]} holds the hyperparameters "
                                 f"{list(group[_HELD_KEY])} of another rule: this trainer's {type(rule).__name__} has "
                                 f"{names} (load a checkpoint of this rule, or fuse with the checkpoint's); "
                                 f"{NOTHING_LOADED}")

    def _check_layer_records(self, model_state):
        """Raise what the fused layers refuse in ``model_state`` before the model is loaded:
        torch's ``load_state_dict`` raises their refusals after loading every other module."""
        refused = [mismatch for name, module in self.model.named_modules() if isinstance(module, ForgeLinear)
                   for mismatch in [module._checkpoint_mismatch(model_state, f"{name}." if name else "")]
                   if mismatch is not None]
        if refused:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.model).__name__} ({NOTHING_LOADED}):"
                               + "".join(f"\n\t{mismatch}" for mismatch in refused))

    def _state_restorer(self):
        """A function that puts the optimizer (its groups and state), the scheduler, the rules'
        hyperparameters and the sync record back as they are now, copying no tensor: a load
        replaces the optimizer's state tensors and writes none of them."""
        optimizer = self.optimizer.state_dict()
        scheduler = None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict())
        rules, synced = _restorer(None, self.rules), self._synced

        def restore():
            self.optimizer.load_state_dict(optimizer)
            if scheduler is not None:
                self.scheduler.load_state_dict(scheduler)
            rules()
            self._synced = synced
        return restore
