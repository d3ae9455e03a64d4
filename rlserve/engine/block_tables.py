"""Every request's block ids as rows of one 2-D array: what each step hands to the model
runner (engine/kv_cache.py keeps it)."""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Every request's block ids as one row of a 2-D array, written as blocks are added,
    so a step's block table is one gather rather than a copy of every request's list.

    Rows are padded with 0 (a released row is zeroed), as a table built from lists is.
    """

    def __init__(self, rows: int = 64, cols: int = 64):
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() takes the lowest

    def new_row(self) -> int:
        if not self.free_rows:
            rows, cols = self.array.shape
            self.array = np.concatenate([self.array, np.zeros((rows, cols), dtype=np.int32)])
            self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def append(self, row: int, blocks: list[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(blocks)
        rows, cols = self.array.shape
        if end > cols:
            wider = np.zeros((rows, max(end, 2 * cols)), dtype=np.int32)
            wider[:, :cols] = self.array
            self.array = wider
        self.array[row, start:end] = blocks
        self.lengths[row] = end

    def release(self, row: int) -> None:
        self.array[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self.free_rows.append(row)

    def gather(self, rows: list[int]) -> np.ndarray:
        """The tables of `rows`, as wide as the longest of them."""
        idx = np.asarray(rows, dtype=np.int64)
        width = int(self.lengths[idx].max()) if len(rows) else 0
        return self.array[idx, :width]
