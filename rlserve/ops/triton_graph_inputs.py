"""A decode step's inputs written into its CUDA graph's static buffers, in one launch.

A graph reads fixed addresses, so each step's token ids, positions, cache slots, lengths,
launch order and block tables are copied into them, and the rows the graph pads the batch
with are given a harmless form (no cache slot, length 1, block 0). As separate torch ops
that is ten small kernels a step; here it is one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "width", "table_stride"])
def _stage_kernel(ids, positions, slots, seq_lens, order, tables, n, width, table_stride,
                  ids_out, positions_out, slots_out, seq_lens_out, order_out, tables_out,
                  tables_out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if row < n:
        tl.store(ids_out + row, tl.load(ids + row))
        tl.store(positions_out + row, tl.load(positions + row))
        tl.store(slots_out + row, tl.load(slots + row))
        tl.store(seq_lens_out + row, tl.load(seq_lens + row))
        tl.store(order_out + row, tl.load(order + row))
        src = tables + row.to(tl.int64) * table_stride
        dst = tables_out + row.to(tl.int64) * tables_out_stride
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            tl.store(dst + cols, tl.load(src + cols, mask=ok), mask=ok)
    else:  # a padding row: writes no KV, attends to one slot of block 0, runs last
        tl.store(slots_out + row, -1)
        tl.store(seq_lens_out + row, 1)
        tl.store(order_out + row, row)
        tl.store(tables_out + row.to(tl.int64) * tables_out_stride, 0)


def stage_graph_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       seq_lens: torch.Tensor, order: torch.Tensor, tables: torch.Tensor,
                       ids_out: torch.Tensor, positions_out: torch.Tensor, slots_out: torch.Tensor,
                       seq_lens_out: torch.Tensor, order_out: torch.Tensor, tables_out: torch.Tensor,
                       size: int) -> None:
    """Rows [0, n) of the outputs take the step's n rows (each table row's first
    tables.shape[1] entries); rows [n, size) become padding: slot -1, length 1, order equal
    to the row, table entry 0. Token ids and positions of padding rows, and table entries
    past the step's width, are left as they were (nothing reads them)."""
    n, width = tables.shape
    if ids.shape[0] != n or n > size or size > ids_out.shape[0] or width > tables_out.shape[1]:
        raise ValueError(f"stage_graph_inputs: {n} rows of width {width} do not fit {size} graph rows "
                         f"of {tables_out.shape[0]} x {tables_out.shape[1]}")
    if tables.stride(1) != 1 or tables_out.stride(1) != 1:
        raise ValueError("stage_graph_inputs: block tables must have unit column stride")
    if size == 0:
        return
    block = min(256, triton.next_power_of_2(max(tables_out.shape[1], 16)))
    _stage_kernel[(size,)](ids, positions, slots, seq_lens, order, tables, n, width, tables.stride(0),
                           ids_out, positions_out, slots_out, seq_lens_out, order_out, tables_out,
                           tables_out.stride(0), BLOCK=block, num_warps=1)
