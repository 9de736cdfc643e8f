"""GRZO: zeroth-order fine-tuning with one pseudo-independent perturbation per example.

For a matrix parameter W (d_out × d_in) the perturbation of example i is
Δ_i = U ⊙ r_i s_iᵀ (Flipout): U a standard normal base shared by the batch, regenerated
from the seed and never stored, r_i and s_i Rademacher signs; a vector parameter has
Δ_i = u ⊙ t_i. Two batched forwards with hooks (+σ, -σ) give per-example losses
ℓ_i^±, δ_i = (ℓ_i^+ - ℓ_i^-)/(2σ), and the estimate ĝ = (1/B) Σ_i c_i Δ_i with c_i = δ_i
(``normalize="none"``: unbiased for the mean loss's gradient) or
c_i = δ_i / (std(δ) + eps) (``"std"``, Bessel-corrected, as in the paper; biased).
Both forwards draw the same torch random numbers (``common_random``: dropout masks).
The step is W ← W - lr (ĝ + weight_decay W), row block by row block; the sum over
examples is taken one example at a time in example order (each term ±c_i is exact, so
every element is the same rounded sum on every machine, at any position in any block).
Where the draws run as kernels (``draws.kernels_for``: CUDA by default) the update and
the estimate of a target are one ``update_kernel`` launch with the same bits.

Data parallelism (``group``): each rank holds b examples, the losses are all-gathered
(``data_parallel``: 2B float64 numbers per step) and each rank's step is the
single-process step with B. Tensor parallelism (``shards``): a parameter declared as a
shard of a larger one draws at the whole's global indices, so its estimate and update
are the slice of the whole's, given the same losses.

Exact statistics on quadratic losses (proofs/zeroth_order.md): E[ĝ | U] = U ⊙ U ⊙ ḡ,
E[ĝ] = ḡ, trace of the covariance ((d - 1)/B) mean‖g_i‖² + 2‖ḡ‖².
"""

import warnings
from dataclasses import dataclass

import torch

from ..errors import NoStepWarning, NonFiniteLossError, check_nonnegative
from ..ops.stochastic_round import check_seed
from . import data_parallel
from . import update_kernel
from .common_random import SameRandomNumbers
from .draws import BASE, COL, ROW, CallDraws
from .param_group import OneGroupOptimizer, check_positive, check_state, hyperparameter
from .targets import Perturbed, find_targets, row_blocks

NORMALIZATIONS = ("std", "none")
#: default size of a row block of U (elements) regenerated at a time
BLOCK_ELEMENTS = 2**20


@dataclass
class ZerothOrderStep:
    """What one step saw: the losses at +σ and -σ, the per-example coefficients c_i
    (None when no step was taken) and whether the weights moved."""

    losses_plus: torch.Tensor
    losses_minus: torch.Tensor
    coefficients: torch.Tensor
    stepped: bool


def check_normalize(name, value):
    if value not in NORMALIZATIONS:
        raise ValueError(f"{name} must be one of {NORMALIZATIONS}, got {value!r}")
    return value


def _check_block_elements(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"block_elements must be a positive integer, got {value!r}")
    return value


def per_example_losses(value, what="the closure") -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
        raise TypeError(f"{what} must return the B per-example losses as a 1-D floating tensor, got "
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    return value.detach()


def coefficients(losses_plus, losses_minus, sigma, normalize, eps):
    """c_i in float64, or None when ``"std"`` finds every δ_i equal (std 0: a_i would be
    δ_i / eps). Raises on non-finite losses and on B = 1 under ``"std"``."""
    lp, lm = losses_plus.to(torch.float64), losses_minus.to(torch.float64)
    if not (torch.isfinite(lp).all() and torch.isfinite(lm).all()):
        raise NonFiniteLossError("a per-example loss is not finite (NaN or infinity); no step was taken")
    delta = (lp - lm) / (2 * sigma)
    if normalize == "none":
        return delta
    if delta.numel() < 2:
        raise ValueError('normalize="std" needs at least 2 examples: the standard deviation of one '
                         'difference is undefined (use normalize="none" for B = 1)')
    spread = delta.std(correction=1)
    if spread == 0:
        return None
    return delta / (spread + eps)


def unmoved_message(method, knob, value, losses: str, params) -> str:
    """Why a step has no direction when no loss moved, naming the perturbation size and
    the parameters' dtypes (in bf16 models a small perturbation is rounded away)."""
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    text = (f"{method}: {knob} = {value:g} moved no loss ({losses} at +{knob} and -{knob} are equal bit for "
            f"bit), so the step has no direction; the parameters are {', '.join(dtypes)}")
    if "bfloat16" in dtypes:
        text += (f": in bfloat16 a perturbation below half an ulp of what it is added to is rounded away "
                 f"(GRZO: each perturbed module's output; MeZO: each weight), so raise {knob}")
    return text


class GRZO(OneGroupOptimizer):
    """``GRZO(model, lr, sigma=1e-3, normalize="std", eps=1e-8, weight_decay=0.0, seed=0,
    group=None, shards=None)``: a ``torch.optim.Optimizer`` whose one parameter group
    holds lr, sigma, normalize, eps and weight_decay, read at every call (``param_group``:
    torch LR schedulers drive lr).

    ``step(closure)`` and ``estimate(closure)``: the closure runs the model's forward
    (hooks perturb it; weights are never touched by the forwards) and returns the B
    per-example losses, a 1-D tensor. Both advance the draw counter, so the k-th call
    of either uses the draws of call k; ``estimate`` returns {name: ĝ} (fp32 for fp32
    and bf16 parameters, fp64 for fp64) and writes nothing.

    Refused, with nothing written and the counter kept: non-finite losses
    (``NonFiniteLossError``), B = 1 under ``"std"``, a closure of the wrong shape, a
    target whose module's forward did not run in both forwards (its weight is used
    outside that forward, where no hook perturbs it, e.g. nn.MultiheadAttention's
    out_proj: freeze it).
    Under ``"std"`` all-equal δ takes no step (``NoStepWarning``; the counter advances),
    and so does, under either normalization, a σ that moved no loss at all (the warning
    names σ and the dtype: in bf16 a small σ is rounded away).

    ``group``: the data-parallel process group whose ranks hold the other examples of
    the batch, b each, rank r global examples r·b, ..., r·b + b - 1 (None: this process
    holds the whole batch). Every refusal is then collective: one rank's bad closure,
    unequal local batches, or a seed, counter, hyperparameter or (at the first step after
    construction or ``load_state_dict``) weights differing from rank 0's refuse the step
    on every rank, naming what differs (``data_parallel``).
    ``shards``: {parameter name: ``Shard(full_shape, offset)`` or (full_shape, offset)}
    for parameters that are tensor-parallel shards of a larger whole of the same name.
    """

    method = "GRZO"
    HYPERPARAMETERS = {"lr": check_nonnegative, "sigma": check_positive, "normalize": check_normalize,
                       "eps": check_nonnegative, "weight_decay": check_nonnegative}
    lr, sigma, normalize = hyperparameter("lr"), hyperparameter("sigma"), hyperparameter("normalize")
    eps, weight_decay = hyperparameter("eps"), hyperparameter("weight_decay")

    def __init__(self, model, lr, sigma=1e-3, normalize="std", eps=1e-8, weight_decay=0.0, seed=0,
                 block_elements=BLOCK_ELEMENTS, group=None, shards=None):
        hyperparameters = self._checked(dict(lr=lr, sigma=sigma, normalize=normalize, eps=eps,
                                             weight_decay=weight_decay))
        self.seed = check_seed(seed)
        self.block_elements = _check_block_elements(block_elements)
        self.targets = find_targets(model, self.method, shards)
        self.group = group
        self.data_rank, self.data_world = data_parallel.group_rank(group)
        self.call = 0
        self.digest_weights = True  # the ranks' weights are compared at the next step
        super().__init__([t.param for t in self.targets], hyperparameters)

    def _local_forwards(self, closure, draws):
        self.check_group()  # first, and inside the refusal every rank shares (``_forwards``)
        batches, losses, fired = [], [], []
        randomness = SameRandomNumbers(t.param for t in self.targets)
        with torch.no_grad():
            for sign in (1, -1):
                if sign == -1:
                    randomness.rewind()  # the first forward's dropout masks again
                with Perturbed(self.targets, draws, self.sigma, sign, self.block_elements,
                               self.data_rank) as hooks:
                    losses.append(per_example_losses(closure()))
                batches.append(hooks.batch)
                fired.append(hooks.fired)
        self._check_perturbed(fired)
        batch = losses[0].numel()
        for seen in batches:
            if seen is not None and seen != batch:
                raise ValueError(f"the closure returned {batch} losses but the perturbed modules saw batch {seen}")
        if losses[1].numel() != batch:
            raise ValueError(f"the closure returned {batch} losses at +sigma and {losses[1].numel()} at -sigma")
        return losses[0], losses[1], batch

    def _check_perturbed(self, fired):
        """Refuse targets whose module's forward did not run in both forwards: their
        hooks never perturbed them, so δ says nothing about them and their update
        would be noise."""
        silent = [t.name for t in self.targets if not all(t.module in seen for seen in fired)]
        if silent:
            raise ValueError(f"{self.method}: parameter(s) {silent} were not perturbed: their module's forward "
                             f"did not run in both forwards of the closure (a weight applied outside its module's "
                             f"forward, such as nn.MultiheadAttention's out_proj, which it calls through F.linear, "
                             f"or a module the closure skipped); no step was taken: freeze them "
                             f"(requires_grad_(False)) to train the rest")

    def _forwards(self, closure, draws):
        """The losses of the whole batch at +σ and -σ and its size B (all ranks')."""
        if self.group is None:
            return self._local_forwards(closure, draws)
        plus, minus, batch = data_parallel.agreed(self, lambda: self._local_forwards(closure, draws),
                                                  lambda result: result[2])
        plus, minus = data_parallel.gather_losses(self.group, plus, minus)
        return plus, minus, plus.numel()

    def _draw(self, closure, draws):
        """The two forwards, B, the coefficients c_i and, when there is no direction (c
        None), why: no loss moved, or all-equal δ under "std"."""
        plus, minus, batch = self._forwards(closure, draws)
        c = coefficients(plus, minus, self.sigma, self.normalize, self.eps)
        if torch.equal(plus, minus):
            return plus, minus, batch, None, unmoved_message(self.method, "sigma", self.sigma,
                                                               f"all {batch} per-example losses",
                                                               [t.param for t in self.targets])
        if c is None:
            return plus, minus, batch, None, (f"{self.method}: all {batch} differences δ_i are equal, so their "
                                              f"standard deviation is 0 and normalize='std' has no direction")
        return plus, minus, batch, c, None

    def _block_estimate(self, target, draws, c, batch, rows):
        """ĝ at ``rows`` of a matrix target (or the whole vector when ``rows`` is None).

        Σ_i c_i r_i s_iᵀ is summed example by example, in example order, not by a matmul:
        each term is ±c_i exactly (the signs are ±1), so every element gets the same
        sequence of roundings whatever the BLAS, the CPU, the device, its place in the
        block or the shard (a shard's update is then the slice of the whole's)."""
        work = target.work_dtype
        weighted = c.to(work)[:, None] * draws.signs(target, ROW, batch)
        if rows is None:
            mixed = torch.zeros_like(weighted[0])
            for term in weighted:
                mixed += term
            return draws.base(target, None) * mixed / batch
        weighted = weighted[:, rows]
        columns = draws.signs(target, COL, batch)
        mixed = torch.zeros(len(rows), target.cols, dtype=work, device=target.param.device)
        for i in range(batch):
            mixed.addr_(weighted[i], columns[i])
        estimate = draws.base(target, rows) * mixed / batch
        padding = getattr(target.module, "padding_idx", None) if target.role == "embedding" else None
        if padding is not None:
            estimate[rows == padding] = 0
        return estimate

    def _kernel_update(self, target, draws, c, batch, estimate_only=False):
        """ĝ of the target (``estimate_only``) or its update by ``update_kernel``, the
        torch path's bits; None where the torch path runs instead: the draws are not
        ``CallDraws``' own (the harness's enumerated patterns), the device is not one
        ``kernels_for``, the weight is not contiguous, or a counter leaves the stream."""
        if type(draws) is not CallDraws or not draws.kernel_base(target) or not target.param.data.is_contiguous():
            return None
        work = target.work_dtype
        weighted = c.to(work)[:, None] * draws.signs(target, ROW, batch)
        columns = draws.signs(target, COL, batch) if target.is_matrix else None
        return update_kernel.grzo_update(target, draws.key(target, BASE), weighted, columns, batch, self.lr,
                                         self.weight_decay, reciprocal=target.param.device.type == "cuda",
                                         estimate_only=estimate_only)

    def _blocks(self, target):
        return row_blocks(target, self.block_elements) if target.is_matrix else [None]

    def estimate(self, closure) -> dict:
        """{parameter name: ĝ} with the draws ``step`` would use now; nothing written.
        All-equal δ under ``"std"`` gives zeros (and the warning)."""
        out = self.estimate_with(CallDraws(self.seed, self.call), closure)
        self.call += 1
        return out

    def estimate_with(self, draws, closure) -> dict:
        """``estimate`` with given draws (any object with ``base`` and ``signs`` like
        ``CallDraws``; the harness passes enumerated sign patterns); the counter stays."""
        _, _, batch, c, why = self._draw(closure, draws)
        if c is None:
            warnings.warn(NoStepWarning(f"{why}; the estimate is zero"), stacklevel=3)
        out = {}
        with torch.no_grad():
            for target in self.targets:
                if c is None:
                    out[target.name] = torch.zeros(target.param.shape, dtype=target.work_dtype,
                                                   device=target.param.device)
                    continue
                fast = self._kernel_update(target, draws, c, batch, estimate_only=True)
                if fast is not None:
                    out[target.name] = fast
                    continue
                parts = [self._block_estimate(target, draws, c, batch, rows) for rows in self._blocks(target)]
                out[target.name] = (torch.cat(parts) if target.is_matrix else parts[0]).reshape(target.param.shape)
        return out

    def step(self, closure) -> ZerothOrderStep:
        """One update W ← W - lr (ĝ + weight_decay W) of every target, row block by row
        block (torch) or in one ``update_kernel`` launch (the same bits) where the draws
        run as kernels."""
        draws = CallDraws(self.seed, self.call)
        plus, minus, batch, c, why = self._draw(closure, draws)
        self.call += 1
        if c is None:
            warnings.warn(NoStepWarning(f"{why}; no step taken (the weights are unchanged)"), stacklevel=2)
            return ZerothOrderStep(plus, minus, None, False)
        with torch.no_grad():
            for target in self.targets:
                self._update(target, draws, c, batch)
        return ZerothOrderStep(plus, minus, c, True)

    def _update(self, target, draws, c, batch):
        """W ← W - lr (ĝ + weight_decay W) for one target: one ``update_kernel`` launch, or
        the torch path row block by row block."""
        if self._kernel_update(target, draws, c, batch) is not None:
            return
        flat = target.param.data if target.is_matrix else target.param.data.view(-1)
        for rows in self._blocks(target):
            block = flat if rows is None else flat[rows[0]:rows[-1] + 1]
            current = block.to(target.work_dtype)
            grad = self._block_estimate(target, draws, c, batch, rows)
            block.copy_(current - self.lr * (grad + self.weight_decay * current))

    def state_dict(self) -> dict:
        """The seed, the call counter, param_groups (the hyperparameters and what a
        scheduler keeps there), block_elements (a row block's matmul may round the
        hooked outputs differently, so another size is another run) and the names."""
        return {"method": self.method, "seed": self.seed, "call": self.call, "param_groups": self.group_state(),
                "block_elements": self.block_elements, "parameters": [t.name for t in self.targets]}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the same draws follow, so a resumed run is bitwise the uninterrupted one.
        Every value is checked before any is assigned: a refused state changes nothing."""
        check_state(state, self.method, ("seed", "call", "param_groups", "block_elements", "parameters"))
        names = [t.name for t in self.targets]
        if state["parameters"] != names:
            raise ValueError(f"the state was saved for parameters {state['parameters']}, this model has {names}")
        if state["block_elements"] != self.block_elements:
            raise ValueError(f"GRZO: the state was saved with block_elements={state['block_elements']!r}, this "
                             f"optimizer has {self.block_elements}: the hooks' row blocks may round the losses "
                             f"differently, so the resumed run would not be the saved one's; build it with "
                             f"block_elements={state['block_elements']!r}")
        self.resume(state)
