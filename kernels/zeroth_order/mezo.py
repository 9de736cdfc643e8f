"""MeZO (the baseline): one Gaussian direction z over every trainable parameter, shared
by the batch, applied in place: θ += εz, L⁺; θ -= 2εz, L⁻; θ += εz (restore); then
ĝ = (L⁺ - L⁻)/(2ε) · z and θ ← θ - lr (ĝ + weight_decay θ). z is regenerated block by
block from (seed, call, parameter name) whenever it is needed, never stored. Both
forwards draw the same torch random numbers (``common_random``: dropout masks).

The restore is not exact: each in-place write rounds, so θ comes back within
½ (ulp(θ₁) + ulp(θ₂) + ulp(θ₃)) of where it was (fp32; bf16 adds its double rounding),
θ_k the three stored values (proofs/zeroth_order.md, "MeZO's restore"); ``estimate``
therefore changes the weights by at most that drift, and nothing else.

Data parallelism (``group``): every rank draws the same z (shared seed and counter) and
the two losses are averaged over the ranks (``data_parallel.average_losses``: 2 float64
numbers per rank per step), so every rank takes the same step: the single-process step
whose loss is the mean of the ranks' mean losses. Each rank's mean weighs 1/W whatever
its local batch: unequal local batches are not refused (a scalar loss does not show
its batch, so the ranks cannot compare them) but weigh their examples unequally. Tensor parallelism (``shards``): z of
a shard is drawn at the whole's global (row-major) indices, the slice of the whole's z.

Where the draws run as kernels (``draws.kernels_for``: CUDA by default), each shift and
the update of a parameter is one ``mezo_kernel`` launch that regenerates z in registers,
the torch path's operations in its order, so the same bits.
"""

import warnings

import torch

from ..errors import NoStepWarning, NonFiniteLossError, check_nonnegative
from ..ops.stochastic_round import check_seed
from . import data_parallel
from . import draw_kernel, mezo_kernel
from .common_random import SameRandomNumbers
from .draws import BASE, check_fits_one_stream, kernels_for, last_counter, standard_normal, stream_key
from .grzo import BLOCK_ELEMENTS, ZerothOrderStep, _check_block_elements, unmoved_message
from .param_group import OneGroupOptimizer, check_positive, check_state, hyperparameter
from .targets import SUPPORTED_DTYPES, check_shards


def _scalar_loss(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return value.detach().reshape(())
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    raise TypeError(f"the closure must return the (mean) loss as a scalar, got "
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")


class MeZO(OneGroupOptimizer):
    """``MeZO(model, lr, eps=1e-3, weight_decay=0.0, seed=0, group=None, shards=None)``;
    ``step(closure)``, ``estimate(closure)`` (the closure returns a scalar loss),
    ``state_dict()``. A ``torch.optim.Optimizer`` whose one parameter group holds lr, eps
    and weight_decay, read at every call (torch LR schedulers drive lr).

    Every trainable floating parameter is perturbed, whatever its module; refused at
    construction, naming it: a parameter that is not contiguous (shifted through a flat
    view) or whose counters pass a stream's 2**32 (a shard far into a large whole). If
    anything fails between the shifts, exactly the parameters already shifted are
    shifted back (to the restore's rounding, module docstring) before the error propagates. A non-finite
    loss raises ``NonFiniteLossError`` after the restore, with no step and the counter kept.
    An ε that moved no loss (L⁺ = L⁻ bit for bit: in bf16 a small ε is rounded away)
    takes no step and warns (``NoStepWarning``, naming ε and the dtype; the counter advances).
    ``group`` and ``shards`` as for ``GRZO`` (the module docstring says what is exchanged),
    except that unequal local batches are not refused (module docstring).
    """

    method = "MeZO"
    HYPERPARAMETERS = {"lr": check_nonnegative, "eps": check_positive, "weight_decay": check_nonnegative}
    lr, eps, weight_decay = hyperparameter("lr"), hyperparameter("eps"), hyperparameter("weight_decay")

    def __init__(self, model, lr, eps=1e-3, weight_decay=0.0, seed=0, block_elements=BLOCK_ELEMENTS,
                 group=None, shards=None):
        hyperparameters = self._checked(dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.seed = check_seed(seed)
        self.block_elements = _check_block_elements(block_elements)
        self.params, seen = [], set()
        for name, param in model.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            if param.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"MeZO: parameter '{name}' is {param.dtype}; float32, bfloat16 and "
                                f"float64 are supported")
            seen.add(id(param))
            self.params.append((name, param))
        if not self.params:
            raise ValueError("MeZO: the model has no trainable parameters")
        self.shards = check_shards(self.params, shards, self.method)
        for name, param in self.params:
            self._check_shiftable(name, param)
        self.group = group
        data_parallel.group_rank(group)
        self.call = 0
        self.digest_weights = True  # the ranks' weights are compared at the next step
        super().__init__([p for _, p in self.params], hyperparameters)

    def _check_shiftable(self, name, param):
        """Refuse, before anything is written, what a shift would fail on part-way: a
        parameter it cannot view flat (not contiguous) or whose counters leave the stream."""
        if not param.data.is_contiguous():
            raise ValueError(f"MeZO: parameter '{name}' is not contiguous (shape {tuple(param.shape)}, "
                             f"strides {param.stride()}); it is shifted in place through a flat view: "
                             f"make it contiguous (nn.Parameter(p.contiguous()))")
        check_fits_one_stream("MeZO", name, "z", self._layout(name, param)[1])

    @staticmethod
    def _work(param):
        return torch.float64 if param.dtype == torch.float64 else torch.float32

    def _counters(self, name, param, start, stop):
        """The global (row-major, in the whole) indices of flat elements [start, stop)."""
        local = torch.arange(start, stop, device=param.device)
        shard = self.shards.get(name)
        if shard is None:
            return local
        if param.dim() == 1:
            return local + shard.offset[0]
        rows = torch.div(local, param.shape[1], rounding_mode="floor")
        cols = local - rows * param.shape[1]
        return (rows + shard.offset[0]) * shard.full_shape[1] + shard.offset[1] + cols

    def _layout(self, name, param) -> dict:
        """``draw_kernel.draw``'s description of the parameter's counters (the global,
        row-major index in the whole, as ``_counters``), and the last of them."""
        shard = self.shards.get(name)
        if shard is None:
            layout = dict(cols=param.numel())
        elif param.dim() == 1:
            layout = dict(cols=param.numel(), col_offset=shard.offset[0])
        else:
            layout = dict(cols=param.shape[1], row_offset=shard.offset[0], full_cols=shard.full_shape[1],
                          col_offset=shard.offset[1])
        rows = max(1, param.numel() // max(1, layout["cols"]))
        return layout, last_counter(rows=rows, **layout)

    def _blocks(self, name, param):
        """(flat view of a block, z of that block in the work dtype) over the parameter:
        drawn by ``draw_kernel`` where ``kernels_for`` the device, else by the torch path
        (every counter fits one stream: ``_check_shiftable``)."""
        flat = param.data.view(-1)
        key = stream_key(self.seed, self.call, name, BASE)
        layout, _ = self._layout(name, param)
        kernel = kernels_for(param.device)
        for start in range(0, flat.numel(), self.block_elements):
            stop = min(start + self.block_elements, flat.numel())
            if kernel:
                z = draw_kernel.draw(True, key, stop - start, self._work(param), param.device, start=start, **layout)
            else:
                z = standard_normal(key, self._counters(name, param, start, stop), self._work(param))
            yield flat[start:stop], z

    def _kernel_layout(self, name, param):
        """The counter layout for ``mezo_kernel`` where it runs (the device ``kernels_for``;
        the parameter is contiguous and its counters fit one stream, ``_check_shiftable``),
        else None (the torch path)."""
        return self._layout(name, param)[0] if kernels_for(param.device) else None

    def _shift_one(self, name, param, factor):
        """θ ← θ + factor · εz for one parameter."""
        layout = self._kernel_layout(name, param)
        if layout is not None:
            mezo_kernel.mezo_shift(param, self._work(param), stream_key(self.seed, self.call, name, BASE),
                                   layout, self.eps, factor)
            return
        for block, z in self._blocks(name, param):
            block.copy_(block.to(z.dtype) + factor * (self.eps * z))

    def _shift(self, factor, displaced=None):
        """θ ← θ + factor · εz for every parameter, each added to ``displaced`` (name:
        total factor) as soon as its own shift is done."""
        for name, param in self.params:
            self._shift_one(name, param, factor)
            if displaced is not None:
                displaced[name] = displaced.get(name, 0.0) + factor

    def _local_losses(self, closure):
        """This process's losses at θ + εz and θ - εz; θ restored whatever happens, even
        when a shift fails part-way: each parameter is counted as displaced once its own
        shift is done, and exactly those are shifted back."""
        self.check_group()  # first, and inside the refusal every rank shares (``_draw``)
        losses, displaced = [], {}  # parameter name: θ sits at θ + displaced · εz
        randomness = SameRandomNumbers(p for _, p in self.params)
        try:
            with torch.no_grad():
                for shift in (1.0, -2.0):
                    self._shift(shift, displaced)
                    randomness.rewind()  # the same dropout masks in both forwards
                    losses.append(_scalar_loss(closure()))
        finally:
            with torch.no_grad():
                for name, param in self.params:
                    if displaced.get(name):
                        self._shift_one(name, param, -displaced[name])
        return torch.stack([v.to(torch.float64) for v in losses])

    def _draw(self, closure):
        if self.group is None:
            plus, minus = self._local_losses(closure)
        else:
            # the closure's scalar loss says nothing of the local batch: 1 stands for it
            local = data_parallel.agreed(self, lambda: self._local_losses(closure), lambda _: 1)
            plus, minus = data_parallel.average_losses(self.group, local)
        if not (torch.isfinite(plus) and torch.isfinite(minus)):
            raise NonFiniteLossError("the loss is not finite (NaN or infinity); no step was taken "
                                     "(the weights were restored from the perturbation)")
        return plus, minus, (plus - minus) / (2 * self.eps)

    def _unmoved(self, plus, minus) -> str | None:
        if not torch.equal(plus, minus):
            return None
        return unmoved_message(self.method, "eps", self.eps, "the losses", [p for _, p in self.params])

    def estimate(self, closure) -> dict:
        """{parameter name: ĝ = (L⁺ - L⁻)/(2ε) z} in the work dtype (fp32 for fp32 and bf16)."""
        plus, minus, projected = self._draw(closure)
        why = self._unmoved(plus, minus)
        if why:
            warnings.warn(NoStepWarning(f"{why}; the estimate is zero"), stacklevel=2)
        out = {}
        for name, param in self.params:
            parts = [float(projected) * z for _, z in self._blocks(name, param)]
            out[name] = torch.cat(parts).reshape(param.shape)
        self.call += 1
        return out

    def step(self, closure) -> ZerothOrderStep:
        plus, minus, projected = self._draw(closure)
        why = self._unmoved(plus, minus)
        if why:
            self.call += 1
            warnings.warn(NoStepWarning(f"{why}; no step taken (the weights are as the restore left them)"),
                          stacklevel=2)
            return ZerothOrderStep(plus, minus, None, False)
        with torch.no_grad():
            for name, param in self.params:
                self._update(name, param, float(projected))
        self.call += 1
        return ZerothOrderStep(plus, minus, projected, True)

    def _update(self, name, param, projected: float):
        """θ ← θ - lr (projected · z + weight_decay θ) for one parameter: one
        ``mezo_kernel`` launch, or the torch path block by block."""
        layout = self._kernel_layout(name, param)
        if layout is not None:
            mezo_kernel.mezo_update(param, self._work(param), stream_key(self.seed, self.call, name, BASE),
                                    layout, self.lr, projected, self.weight_decay)
            return
        for block, z in self._blocks(name, param):
            current = block.to(z.dtype)
            block.copy_(current - self.lr * (projected * z + self.weight_decay * current))

    def state_dict(self) -> dict:
        """The seed, the call counter, param_groups (the hyperparameters and what a
        scheduler keeps there) and the names (block_elements changes no bit: every
        operation on z is element-wise)."""
        return {"method": self.method, "seed": self.seed, "call": self.call, "param_groups": self.group_state(),
                "parameters": [n for n, _ in self.params]}

    def load_state_dict(self, state: dict) -> None:
        """Resume (as ``GRZO.load_state_dict``): every value is checked before any is
        assigned, so a refused state changes nothing."""
        check_state(state, self.method, ("seed", "call", "param_groups", "parameters"))
        names = [n for n, _ in self.params]
        if state["parameters"] != names:
            raise ValueError(f"the state was saved for parameters {state['parameters']}, this model has {names}")
        self.resume(state)
