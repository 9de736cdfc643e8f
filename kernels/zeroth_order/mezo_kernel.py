"""MeZO's in-place shift θ ← θ + factor · (ε z) and its update θ ← θ - lr (p z + wd θ) as
one Triton kernel per parameter: z regenerated in registers (``draw_kernel``'s normal),
the parameter read and written once, no block of z in memory.

The torch path (``MeZO._shift`` and ``MeZO.step`` over blocks) is the oracle, and the
kernel repeats its operations in its order in the work dtype: z is the normal rounded
to the work dtype, ε, factor, lr, p = (L⁺ - L⁻)/(2ε) and weight_decay are rounded to the
work dtype first (torch's Python scalars), then

    shift:  θ + factor · (ε · z)
    update: θ - lr · (p · z + weight_decay · θ)

each operation rounded once (``enable_fp_fusion=False``), the result rounded once to the
parameter's dtype (bf16: to nearest even by integer arithmetic, as torch's ``copy_``;
NaN payloads are not reproduced). Element g of the flat parameter draws the counter
``MeZO._counters`` gives it, described as (cols, row_offset, full_cols, col_offset).
"""

import torch
import triton
import triton.language as tl

from .._backend import on_device
from ..ops.stochastic_round import rn_bf16
from .draw_kernel import constant_table, grid_counter, normal_from_words

BLOCK = 1024


@triton.jit(do_not_specialize=["n", "cols", "row_offset", "full_cols", "col_offset", "key"])
def _mezo_kernel(w_ptr, scalars_ptr, table_ptr, n, cols, row_offset, full_cols, col_offset, key,
                 UPDATE: tl.constexpr, STORE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = g < n
    j = g // cols
    k = g - j * cols
    work = scalars_ptr.dtype.element_ty
    w0, w1, _, _ = tl.randint4x(key, grid_counter(j, k, row_offset, full_cols, col_offset))
    z = normal_from_words(w0, w1, table_ptr).to(work)
    current = tl.load(w_ptr + g, mask=mask, other=0.0).to(work)
    if UPDATE:
        new = current - tl.load(scalars_ptr + 0) * (tl.load(scalars_ptr + 1) * z + tl.load(scalars_ptr + 2) * current)
    else:
        new = current + tl.load(scalars_ptr + 1) * (tl.load(scalars_ptr + 0) * z)
    if STORE_BF16:
        tl.store(w_ptr + g, rn_bf16(new), mask=mask)
    else:
        tl.store(w_ptr + g, new.to(w_ptr.dtype.element_ty), mask=mask)


def _launch(param, work, key, layout, scalars, update):
    flat = param.data.view(-1)
    if flat.numel() == 0:
        return
    scalars = torch.tensor(scalars, dtype=work).to(flat.device)
    with on_device(flat.device):
        _mezo_kernel[(triton.cdiv(flat.numel(), BLOCK),)](
            flat, scalars, constant_table(flat.device), flat.numel(), layout["cols"], layout.get("row_offset", 0),
            layout.get("full_cols", 1), layout.get("col_offset", 0), key, UPDATE=update,
            STORE_BF16=param.dtype == torch.bfloat16, BLOCK=BLOCK, enable_fp_fusion=False)


def mezo_shift(param, work, key: int, layout: dict, eps: float, factor: float):
    """θ ← θ + factor · (ε z) in place (``layout``: ``MeZO._layout``'s counter description)."""
    _launch(param, work, key, layout, [eps, factor], update=False)


def mezo_update(param, work, key: int, layout: dict, lr: float, projected: float, weight_decay: float):
    """θ ← θ - lr (projected · z + weight_decay · θ) in place."""
    _launch(param, work, key, layout, [lr, projected, weight_decay], update=True)
