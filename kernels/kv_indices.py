"""Attention metadata from the request -> token slot table, built on the device.

Each sequence's first ``lens[b]`` slots of its table row are copied, back to back, into a flat
``kv_indices``; ``kv_indptr`` (``[B + 1]``, a cumulative sum) says where each one starts. Nothing
is read back to the host: the caller passes ``total`` (an upper bound on ``sum(lens)``) from the
lengths it already holds as Python ints.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(Table, Rows, Lens, Indptr, Out, stride_row, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Rows + b).to(tl.int64)
    n = tl.load(Lens + b)
    start = tl.load(Indptr + b).to(tl.int64)
    for i in range(0, tl.cdiv(n, BLOCK)):
        offs = i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(Table + row * stride_row + offs, mask=mask)
        tl.store(Out + start + offs, slots.to(Out.dtype.element_ty), mask=mask)


def build_kv_indices(
    table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, total: int, block: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``kv_indptr`` int32 ``[B + 1]``, ``kv_indices`` int32 ``[max(total, 1)]``) for the sequences in
    table rows ``rows`` ``[B]`` with lengths ``lens`` ``[B]``; entries past ``sum(lens)`` are left unset."""
    b = rows.shape[0]
    if lens.shape != (b,) or table.dim() != 2 or (table.stride(1) != 1 and table.shape[1] > 1):
        raise ValueError(f"build_kv_indices: table {tuple(table.shape)}, rows {tuple(rows.shape)}, lens {tuple(lens.shape)}")
    indptr = torch.zeros(b + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.empty(max(total, 1), dtype=torch.int32, device=table.device)
    if b:
        _gather_rows_kernel[(b,)](table, rows, lens, indptr, indices, table.stride(0), BLOCK=block)
    return indptr, indices
