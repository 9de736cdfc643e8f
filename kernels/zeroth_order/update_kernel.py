"""GRZO's update (and its estimate) as one Triton kernel per target: U regenerated tile by
tile in registers, the sum over examples taken in example order, the rule applied and
the weight stored; nothing weight-sized besides the weight.

The torch path (``GRZO._block_estimate`` and ``GRZO.step``) is the oracle, and the
kernel repeats its arithmetic operation for operation in the work dtype, for element
(j, k) of a matrix target (a vector target is one row with no column signs):

    mixed = 0;  for i = 0, ..., B - 1:  mixed = mixed + (c_i r_i[j]) · s_i[k]
    ĝ = (U[j, k] · mixed) / B         (0 on an embedding's padding row)
    W[j, k] ← W - lr · (ĝ + weight_decay · W), rounded once to W's dtype

where c_i r_i[j] is the torch path's ``weighted`` (given), U is ``draw_kernel``'s normal
rounded to the work dtype (as ``CallDraws.base`` returns it), and lr and weight_decay are
rounded to the work dtype first, as torch does with a Python scalar. Each term ±c_i is
exact, so the running sum is the same rounded sum as torch's ``addr_``, FMA or not.

The division by B is what torch does on the parameter's device: on the CPU a true
division; on CUDA torch divides a tensor by a CPU scalar as a multiplication by its
reciprocal rounded to the work dtype (``div_true_kernel_cuda``: "compute a *
reciprocal(b) ... may lose one bit"), so ``reciprocal=True`` there. The two differ in the
last bit for some B that are not powers of two: the torch path's update bits already
differ between CPU and CUDA, and the kernel keeps each device's.

bfloat16 weights are stored rounded to nearest even by integer arithmetic
(``stochastic_round.rn_bf16``: the interpreter's cast truncates), as torch's ``copy_``
rounds them; NaN payloads are not reproduced (a NaN weight has no finite loss, so no
step is taken).
"""

import torch
import triton
import triton.language as tl

from .._backend import on_device
from ..ops.stochastic_round import rn_bf16
from .draw_kernel import constant_table, grid_counter, normal_from_words

BLOCK_ROWS, BLOCK_COLS, VECTOR_BLOCK = 8, 128, 1024


@triton.jit(do_not_specialize=["rows", "cols", "batch", "row_offset", "full_cols", "col_offset", "key", "padding"])
def _grzo_update_kernel(w_ptr, out_ptr, weighted_ptr, columns_ptr, scalars_ptr, table_ptr, rows, cols, batch,
                        row_offset, full_cols, col_offset, key, padding,
                        MATRIX: tl.constexpr, RECIPROCAL: tl.constexpr, HAS_PADDING: tl.constexpr,
                        WRITE_ESTIMATE: tl.constexpr, STORE_BF16: tl.constexpr, WORK_FP64: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # CUDA caps grid axis 1 at 65,535 programs and axis 0 at 2**31 - 1: a matrix puts its
    # row blocks (an embedding's many rows) on axis 0, a vector (one row) its column blocks.
    if MATRIX:
        j = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        k = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    else:
        j = tl.arange(0, BLOCK_R).to(tl.int64)
        k = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows, in_cols = j < rows, k < cols
    mask = in_rows[:, None] & in_cols[None, :]
    work = scalars_ptr.dtype.element_ty
    w0, w1, _, _ = tl.randint4x(key, grid_counter(j[:, None], k[None, :], row_offset, full_cols, col_offset))
    u = normal_from_words(w0, w1, table_ptr).to(work)
    mixed = tl.zeros((BLOCK_R, BLOCK_C), dtype=work)
    for i in range(batch):
        # int64: example i's row starts at i * rows, which passes 2**31 for a large batch of
        # a large embedding (the torch path indexes in int64 too).
        example = tl.cast(i, tl.int64)
        if MATRIX:
            weight_row = tl.load(weighted_ptr + example * rows + j, mask=in_rows, other=0.0)
            column = tl.load(columns_ptr + example * cols + k, mask=in_cols, other=0.0)
            mixed = mixed + weight_row[:, None] * column[None, :]
        else:
            mixed = mixed + tl.load(weighted_ptr + example * cols + k, mask=in_cols, other=0.0)[None, :]
    estimate = u * mixed
    if RECIPROCAL:
        estimate = estimate * tl.load(scalars_ptr + 2)
    elif WORK_FP64:
        estimate = estimate / tl.load(scalars_ptr + 3)
    else:
        estimate = tl.div_rn(estimate, tl.load(scalars_ptr + 3))
    if HAS_PADDING:
        estimate = tl.where((j == padding)[:, None], 0.0, estimate)
    offsets = j[:, None] * cols + k[None, :]
    if WRITE_ESTIMATE:
        tl.store(out_ptr + offsets, estimate, mask=mask)
    else:
        current = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(work)
        lr = tl.load(scalars_ptr + 0)
        weight_decay = tl.load(scalars_ptr + 1)
        new = current - lr * (estimate + weight_decay * current)
        if STORE_BF16:
            tl.store(out_ptr + offsets, rn_bf16(new), mask=mask)
        else:
            tl.store(out_ptr + offsets, new.to(out_ptr.dtype.element_ty), mask=mask)


def grzo_update(target, key: int, weighted: torch.Tensor, columns, batch: int, lr: float, weight_decay: float,
                *, reciprocal: bool, estimate_only: bool = False):
    """Update ``target.param`` in place with GRZO's rule (or, with ``estimate_only``,
    return ĝ in the work dtype and write nothing). ``weighted``: (B, rows) c_i · r_i in
    the work dtype (rows = a vector's elements); ``columns``: (B, cols) s_i, None for a
    vector; ``key``: the target's BASE stream; ``reciprocal``: divide by B as torch does
    on CUDA (see the module docstring). The caller has checked that every counter of the
    target fits one stream."""
    param = target.param.data
    work = target.work_dtype
    if not param.is_contiguous():
        raise ValueError(f"grzo_update writes contiguous parameters; '{target.name}' is not")
    device = param.device
    scalars = torch.tensor([lr, weight_decay, 0.0, float(batch)], dtype=work)
    scalars[2] = torch.tensor(1.0, dtype=work) / batch
    scalars = scalars.to(device)
    out = torch.empty(param.shape, dtype=work, device=device) if estimate_only else param
    padding = getattr(target.module, "padding_idx", None) if target.role == "embedding" else None
    if target.is_matrix:
        rows, cols = target.rows, target.cols
        layout = dict(row_offset=target.row_offset, full_cols=target.full_cols, col_offset=target.col_offset)
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
        blocks = dict(BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
    else:
        rows, cols = 1, target.rows
        layout = dict(row_offset=0, full_cols=1, col_offset=target.row_offset)
        grid = (triton.cdiv(cols, VECTOR_BLOCK), 1)
        blocks = dict(BLOCK_R=1, BLOCK_C=VECTOR_BLOCK)
    if param.numel() == 0:
        return out
    with on_device(device):
        _grzo_update_kernel[grid](
            param, out, weighted.contiguous(), weighted if columns is None else columns.contiguous(), scalars,
            constant_table(device), rows, cols, batch, layout["row_offset"], layout["full_cols"],
            layout["col_offset"], key, -1 if padding is None else padding,
            MATRIX=target.is_matrix, RECIPROCAL=reciprocal, HAS_PADDING=padding is not None,
            WRITE_ESTIMATE=estimate_only, STORE_BF16=param.dtype == torch.bfloat16,
            WORK_FP64=work == torch.float64, **blocks, enable_fp_fusion=False)
    return out
