"""The block tables of the requests one rank holds, as host arrays (vLLM v1's persistent batch).

Per KV layer group one int32 array [rows, width] with one row per request the rank knows, and
how many entries of each row are the request's (`lens`). A step plan carries table changes
(workers/step.py: whole tables the first time, then the blocks from an offset on); they are
written into the request's row as slices, and a step gathers its rows by index: no per-block
Python, no list copies of whole tables. Entries right of a row's length are stale and never
read (sequence lengths bound every read).

Rows are reused: a forgotten request's row goes back to a free list. Both dimensions grow by
doubling when a request arrives or a table outgrows the width.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshserve.core.arith import cdiv
from meshserve.errors import check
from meshserve.workers.step import ScheduledSeq


class RequestTables:
    def __init__(self, num_groups: int, *, rows: int = 16, width: int = 16) -> None:
        check(num_groups >= 1, "num_groups", num_groups, "an integer >= 1")
        self.num_groups = num_groups
        self.table = np.zeros((num_groups, rows, width), np.int32)  # [G, rows, width] block ids
        self.lens = np.zeros((num_groups, rows), np.int64)  # [G, rows] entries held per row
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def add(self, request_id: str) -> int:
        """A row for a request (empty tables); its index."""
        check(request_id not in self.row_of, "request_id", request_id, "an id without a row")
        if not self._free:
            self._grow(rows=2 * self.table.shape[1])
        row = self.row_of[request_id] = self._free.pop()
        self.lens[:, row] = 0
        return row

    def remove(self, request_id: str) -> None:
        """Forget a request (no error if unknown); its row is reused."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def apply(self, seq: ScheduledSeq) -> int:
        """Apply `seq`'s table changes to its request's row in place; the row's index."""
        row = self.row_of[seq.request_id]
        changes, offsets = seq.block_tables, seq.table_offsets
        check(len(changes) == self.num_groups, "block_tables", len(changes),
              f"one table per KV layer group ({self.num_groups})")
        if offsets is None:
            offsets = (0,) * self.num_groups
        else:
            check(len(offsets) == self.num_groups, "table_offsets", offsets,
                  f"one offset per KV layer group ({self.num_groups})")
        if seq.table_offsets is not None:  # every group checked before any is written
            for g, offset in enumerate(offsets):
                held = int(self.lens[g, row])
                check(0 <= offset <= held, "table_offsets", offset,
                      f"an index in [0, {held}] (the blocks held for {seq.request_id})")
        for g, (offset, blocks) in enumerate(zip(offsets, changes)):
            end = offset + len(blocks)
            if blocks:
                if end > self.table.shape[2]:
                    self._grow(width=max(end, 2 * self.table.shape[2]))
                self.table[g, row, offset:end] = blocks
            self.lens[g, row] = end  # after any growth: _grow replaces the arrays
        return row

    def check_changes(self, rows: np.ndarray, request_ids: Sequence[str], offsets: np.ndarray) -> None:
        """That changes fit the rows held: per row and group ([n, G] offsets, workers/step.py
        CachedRows) the table is replaced from an index within its held blocks. Nothing changes."""
        held = self.lens[:, rows].T  # [n, G]
        bad = ((offsets < 0) | (offsets > held)).any(axis=1)
        if bad.any():
            i = int(bad.argmax())
            check(False, "table_offsets", offsets[i].tolist(),
                  f"indices in [0, held] (the blocks held for {request_ids[i]}: {held[i].tolist()} per group)")

    def apply_rows(self, rows: np.ndarray, offsets: np.ndarray, counts: np.ndarray, blocks: np.ndarray) -> None:
        """Apply checked changes (check_changes) in place: per row and group, `counts` blocks taken
        in turn from `blocks` replace the table from its offset. Most decode steps bring no block
        and name the held length as their offset: then nothing is written."""
        moved = (counts > 0) | (offsets != self.lens[:, rows].T)  # [n, G]
        if not moved.any():
            return
        starts = np.cumsum(counts.reshape(-1)) - counts.reshape(-1)  # where each (row, group)'s blocks begin
        for i in np.flatnonzero(moved.any(axis=1)).tolist():
            row = int(rows[i])
            for g in range(self.num_groups):
                n, offset = int(counts[i, g]), int(offsets[i, g])
                end = offset + n
                if n:
                    if end > self.table.shape[2]:
                        self._grow(width=max(end, 2 * self.table.shape[2]))
                    start = int(starts[i * self.num_groups + g])
                    self.table[g, row, offset:end] = blocks[start:start + n]
                self.lens[g, row] = end  # after any growth: _grow replaces the arrays

    def gather(self, rows: np.ndarray, group: int) -> np.ndarray:
        """[len(rows), w] int32: the rows' tables of one group, w = the longest of them (>= 1)."""
        width = max(int(self.lens[group, rows].max(initial=1)), 1)
        return self.table[group, rows, :width]

    def table_of(self, request_id: str) -> list[list[int]]:
        """A request's tables as lists, per group (tests, debugging)."""
        row = self.row_of[request_id]
        return [self.table[g, row, : self.lens[g, row]].tolist() for g in range(self.num_groups)]

    def check_cover(self, rows: np.ndarray, local_lens: np.ndarray, block_size: int,
                    request_ids: Sequence[str]) -> None:
        """Every row holds blocks for its sequence's `local_lens` tokens, in every group."""
        needed = cdiv(local_lens, block_size)  # [n] blocks
        short = (self.lens[:, rows] < needed[None, :]).any(axis=0)
        if short.any():
            i = int(short.argmax())
            check(False, "block_tables", self.table_of(request_ids[i]),
                  f">= {int(needed[i])} blocks per group for {request_ids[i]} ({int(local_lens[i])} tokens "
                  f"at block_size {block_size})")

    def _grow(self, *, rows: int | None = None, width: int | None = None) -> None:
        g, old_rows, old_width = self.table.shape
        rows, width = rows or old_rows, width or old_width
        table = np.zeros((g, rows, width), np.int32)
        table[:, :old_rows, :old_width] = self.table
        lens = np.zeros((g, rows), np.int64)
        lens[:, :old_rows] = self.lens
        self.table, self.lens = table, lens
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
