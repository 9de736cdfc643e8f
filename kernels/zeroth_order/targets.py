"""What zeroth-order fine-tuning perturbs: one ``Target`` per trainable parameter, found
by module type, and the forward hooks that add a per-example perturbation to a module's
output without touching its weights.

Supported (the module's own forward, not a subclass that overrides it):

* ``nn.Linear``: weight (matrix: Δ_i = U ⊙ r_i s_iᵀ, output gains r_i ⊙ (U (s_i ⊙ x_i)))
  and bias (vector: Δ_i = u ⊙ t_i);
* ``nn.Embedding`` without ``max_norm``: weight (matrix over vocabulary × width; the
  output of token v in example i gains U[v] ⊙ r_i[v] s_i; the ``padding_idx`` row, which
  torch never trains, is neither perturbed nor updated);
* ``nn.LayerNorm`` (weight, bias) and ``nn.RMSNorm`` (weight): vectors; the output
  gains n(x_i) ⊙ u ⊙ t_i for the weight (n the normalisation without affine) and
  u ⊙ t_i for the bias.

Each hook adds exactly the first-order change of the output, which for these modules
is the whole change: the output is affine in each of their parameters, so the hooked
forward equals the forward with the parameter moved by ±σ Δ_i for example i (up to
rounding). Example i is index i along dim 0 of the module's input; under data
parallelism it is global example ``first + i`` (``Perturbed``'s ``data_rank``).

A tensor-parallel shard (a row or column range of a matrix, a range of a vector) is
declared with ``Shard(full_shape, offset)`` for its parameter name: its base, signs and
updates are then drawn at the whole's global indices, i.e. they are the slice of the
whole's (``check_shards``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .draws import COL, ROW, check_fits_one_stream, last_counter

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_SUPPORTED_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


@dataclass(frozen=True)
class Shard:
    """The place of a parameter inside the whole it is a shard of: ``full_shape`` the
    whole's shape, ``offset`` the index of the shard's first element in it (one entry
    per dimension; a matrix's (row, column), a vector's (element,))."""

    full_shape: tuple
    offset: tuple


@dataclass(eq=False)
class Target:
    """One trainable parameter and how it is perturbed.

    ``role``: "linear" or "embedding" (a matrix with row and column signs), "scale"
    (a norm's weight) or "shift" (a bias); ``rows``, ``cols``: the matrix shape (a vector
    has cols = 0)."""

    name: str
    module: nn.Module
    param: nn.Parameter
    role: str
    shard: Shard = None

    @property
    def is_matrix(self) -> bool:
        return self.role in ("linear", "embedding")

    @property
    def row_offset(self) -> int:
        return self.shard.offset[0] if self.shard else 0

    @property
    def col_offset(self) -> int:
        return self.shard.offset[1] if self.shard and self.is_matrix else 0

    @property
    def full_rows(self) -> int:
        return self.shard.full_shape[0] if self.shard else self.rows

    @property
    def full_cols(self) -> int:
        return self.shard.full_shape[1] if self.shard and self.is_matrix else self.cols

    @property
    def rows(self) -> int:
        return self.param.shape[0] if self.is_matrix else self.param.numel()

    @property
    def cols(self) -> int:
        return self.param.shape[1] if self.is_matrix else 0

    @property
    def last_base_counter(self) -> int:
        """The last counter of U: its last element's row-major index in the whole."""
        if not self.is_matrix:
            return last_counter(self.rows, col_offset=self.row_offset)
        return last_counter(self.cols, self.rows, self.row_offset, self.col_offset, self.full_cols)

    @property
    def work_dtype(self) -> torch.dtype:
        """float64 for a float64 parameter, float32 otherwise (bf16 is computed in fp32)."""
        return torch.float64 if self.param.dtype == torch.float64 else torch.float32


def _roles(module: nn.Module) -> dict:
    if isinstance(module, nn.Linear):
        return {"weight": "linear", "bias": "shift"}
    if isinstance(module, nn.Embedding):
        return {"weight": "embedding"}
    return {"weight": "scale", "bias": "shift"}


def _base_type(module):
    return next((t for t in _SUPPORTED_MODULES if isinstance(module, t)), None)


def find_targets(model: nn.Module, method: str, shards=None) -> list:
    """The model's trainable parameters as targets, in ``named_modules`` order; anything
    this method cannot perturb is refused naming its module. ``shards``: see
    ``check_shards``."""
    targets, seen = [], {}
    for module_name, module in model.named_modules():
        trainable = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not trainable:
            continue
        where = f"module '{module_name or '(root)'}' ({type(module).__name__})"
        base = _base_type(module)
        if base is None or type(module).forward is not base.forward:
            raise TypeError(
                f"{method} perturbs the parameters of nn.Linear, nn.Embedding, nn.LayerNorm and "
                f"nn.RMSNorm (their own forward); {where} has trainable parameters "
                f"{[n for n, _ in trainable]}: freeze them (requires_grad_(False)) to train the rest, and "
                f"any Linear inside it whose weight it applies itself (nn.MultiheadAttention's out_proj)")
        if isinstance(module, nn.Embedding) and module.max_norm is not None:
            raise TypeError(f"{method}: {where} renormalises rows in its forward (max_norm), which "
                            f"a perturbation added to its output cannot represent")
        for local, param in trainable:
            name = f"{module_name}.{local}" if module_name else local
            if id(param) in seen:
                raise ValueError(f"{method}: parameter '{name}' is the same tensor as '{seen[id(param)]}' "
                                 f"(tied weights): each use would be perturbed independently; untie or freeze it")
            if param.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{method}: parameter '{name}' of {where} is {param.dtype}; "
                                f"float32, bfloat16 and float64 are supported")
            seen[id(param)] = name
            targets.append(Target(name, module, param, _roles(module)[local]))
    if not targets:
        raise ValueError(f"{method}: the model has no trainable parameters")
    checked = check_shards([(t.name, t.param) for t in targets], shards, method)
    for target in targets:
        target.shard = checked.get(target.name)
        # U is drawn whole by the update but only in part by an embedding's hook (its used
        # rows): an overflow would surface after other targets had been updated
        check_fits_one_stream(method, target.name, "U", target.last_base_counter)
    return targets


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_shards(names_and_params, shards, method: str) -> dict:
    """{parameter name: Shard} from ``shards`` ({name: Shard or (full_shape, offset)}),
    each checked against its parameter: a known trainable name, one entry per dimension,
    non-negative integers, the shard inside the whole. None gives {}."""
    if shards is None:
        return {}
    if not isinstance(shards, dict):
        raise TypeError(f"{method}: shards must be a dict {{parameter name: (full_shape, offset)}}, "
                        f"got {type(shards).__name__}")
    params = dict(names_and_params)
    checked = {}
    for name, spec in shards.items():
        if name not in params:
            raise ValueError(f"{method}: shards names '{name}', which is not a trainable parameter of the "
                             f"model (have {sorted(params)})")
        shape = tuple(params[name].shape)
        try:
            full_shape, offset = (tuple(spec.full_shape), tuple(spec.offset)) if isinstance(spec, Shard) \
                else (tuple(spec[0]), tuple(spec[1]))
        except (TypeError, IndexError):
            raise TypeError(f"{method}: the shard of '{name}' must be Shard(full_shape, offset) or a pair "
                            f"(full_shape, offset), got {spec!r}") from None
        if len(shape) not in (1, 2):
            raise ValueError(f"{method}: '{name}' has shape {shape}; shards are of 1-D or 2-D parameters")
        if len(full_shape) != len(shape) or len(offset) != len(shape) \
                or not all(_is_index(v) for v in full_shape + offset):
            raise ValueError(f"{method}: the shard of '{name}' (shape {shape}) needs a full shape and an offset "
                             f"of {len(shape)} non-negative integers each, got {full_shape} and {offset}")
        if any(o + n > f for o, n, f in zip(offset, shape, full_shape)):
            raise ValueError(f"{method}: the shard of '{name}' (shape {shape} at offset {offset}) does not fit "
                             f"inside the full shape {full_shape}")
        checked[name] = Shard(full_shape, offset)
    return checked


def row_blocks(target: Target, block_elements: int):
    """Row-index tensors covering the target in blocks of about ``block_elements``."""
    per_block = max(1, block_elements // max(1, target.cols))
    for start in range(0, target.rows, per_block):
        yield torch.arange(start, min(start + per_block, target.rows), device=target.param.device)


def _per_example(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """(B, *tail) -> (B, 1, ..., 1, *tail) broadcasting against an ``ndim``-dim activation."""
    return values.reshape(values.shape[0], *([1] * (ndim - values.dim())), *values.shape[1:])


def output_change(target: Target, draws, x: torch.Tensor, batch: int, block_elements: int,
                  first: int = 0) -> torch.Tensor:
    """The change of the module's output per unit σ, example by example (work dtype);
    the local examples are global examples first, ..., first + batch - 1."""
    work = target.work_dtype
    if target.role == "linear":
        xs = x.to(work) * _per_example(draws.signs(target, COL, batch, first), x.dim())
        # filled block by block and scaled in place: one activation-sized tensor, no copies
        change = torch.empty(*x.shape[:-1], target.rows, dtype=work, device=x.device)
        for rows in row_blocks(target, block_elements):
            change[..., rows[0]:rows[-1] + 1] = xs @ draws.base(target, rows).T
        return change.mul_(_per_example(draws.signs(target, ROW, batch, first), change.dim()))
    if target.role == "embedding":
        flat = x.reshape(batch, -1)
        used, inverse = torch.unique(flat, return_inverse=True)
        rows = draws.signs(target, ROW, batch, first).gather(1, flat)
        if target.module.padding_idx is not None:
            rows = rows * (flat != target.module.padding_idx)  # the padding row is not trained
        columns = draws.signs(target, COL, batch, first)[:, None, :]
        # the used rows' U in row blocks too: the draws' temporaries stay block-sized
        per_block = max(1, block_elements // target.cols)
        base = torch.cat([draws.base(target, used[start:start + per_block])
                          for start in range(0, len(used), per_block)])
        change = base[inverse] * rows[..., None] * columns
        return change.reshape(*x.shape, target.cols)
    shape = target.param.shape
    direction = (draws.base(target, None) * draws.signs(target, ROW, batch, first)).reshape(batch, *shape)
    if target.role == "shift":
        return _per_example(direction, x.dim())
    module = target.module
    if isinstance(module, nn.LayerNorm):
        normalised = F.layer_norm(x.to(work), module.normalized_shape, None, None, module.eps)
    else:
        normalised = F.rms_norm(x.to(work), module.normalized_shape, None, module.eps)
    return normalised * _per_example(direction, x.dim())


def _accumulate(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """total + part, in place when total already has the broadcast shape (a bias's change
    is (B, 1, ..., n) and broadcasts against the output)."""
    if total.shape == torch.broadcast_shapes(total.shape, part.shape):
        return total.add_(part)
    return total + part


class Perturbed:
    """Context: forward hooks on every target's module adding ``sign · scale`` times the
    targets' output change; records the batch size every hooked call saw and which
    modules' forwards ran (``fired``: a target whose module did not run was not
    perturbed, e.g. a weight its owner applies with F.linear). ``data_rank``
    r: this process holds global examples r·b, ..., r·b + b - 1 of its local batch b
    (data parallelism with equal local batches)."""

    def __init__(self, targets, draws, scale: float, sign: int, block_elements: int, data_rank: int = 0):
        self.by_module = {}
        for target in targets:
            self.by_module.setdefault(target.module, []).append(target)
        self.draws, self.scale, self.sign, self.block_elements = draws, scale, sign, block_elements
        self.data_rank = data_rank
        self.batch = None
        self.fired = set()
        self.handles = []

    def _hook(self, module, inputs, output):
        x = inputs[0]
        targets = self.by_module[module]
        batch = x.shape[0] if x.dim() else 0
        if x.dim() == 0 or (self.batch is not None and batch != self.batch):
            name = targets[0].name.rpartition(".")[0] or "(root)"
            raise ValueError(f"every perturbed module must see the batch along dim 0: module '{name}' "
                             f"saw input shape {tuple(x.shape)} after batch {self.batch} (a module "
                             f"shared by all examples, such as a position embedding called with "
                             f"arange(T), must be frozen)")
        self.batch = batch
        self.fired.add(module)
        first = self.data_rank * batch
        # accumulated in place (the widest module's output may be the logits): the same
        # operations, so the same bits, as output + (sign · scale) · Σ changes
        change = output_change(targets[0], self.draws, x, batch, self.block_elements, first)
        for target in targets[1:]:
            change = _accumulate(change, output_change(target, self.draws, x, batch, self.block_elements, first))
        return _accumulate(change.mul_(self.sign * self.scale), output).to(output.dtype)

    def __enter__(self):
        self.handles = [m.register_forward_hook(self._hook) for m in self.by_module]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return False
