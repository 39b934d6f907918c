"""K/V tiles of the paged cache read through tensor descriptors (TMA on Hopper and later).

The cache [num_blocks, 2, page, kv_heads, D] is seen as one 2-D tensor of rows
[num_blocks * 2 * page, kv_heads * D]: the key of token t in block b is row b * 2 * page + t,
column kv_head * D. A descriptor over that view, with rows counted from the first K row (for
keys) or the first V row (for values), loads one page of a sequence with one copy-engine
request straight into shared memory, without the per-element gather addresses of the pointer
path. Pages of a sequence are not contiguous, so a tile of BLOCK_N keys over pages of PAGE < BLOCK_N
tokens takes BLOCK_N / PAGE requests whose rows are stacked in registers; with PAGE >= BLOCK_N a
tile is one request. Rows past the end of the cache read as zero (the descriptor's bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stack_rows(a, b):
    """[R, D] on top of [R, D] -> [2R, D], in order."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), [2 * a.shape[0], a.shape[1]])


@triton.jit
def _page_rows(desc, bt_row_ptr, n, kv_len, col, rows_per_block, PAGE: tl.constexpr):
    """The rows of keys [n, n + ROWS) of one page (they never cross a page). A page past the
    sequence's end reads block 0 (its keys are masked, its values zeroed by the caller)."""
    blk = tl.load(bt_row_ptr + n // PAGE, mask=n < kv_len, other=0)
    return desc.load([blk * rows_per_block + n % PAGE, col])


@triton.jit
def load_kv_pages(
    desc,  # tensor descriptor over the cache rows, block [min(PAGE, BLOCK_N), BLOCK_D]
    bt_row_ptr,  # this sequence's block-table row
    start_n,  # first key of the tile, a multiple of BLOCK_N
    kv_len,  # keys of the sequence
    col,  # first column: kv_head * head stride
    rows_per_block,  # rows between two blocks of the 2-D view (2 * PAGE for a K/V cache)
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] tile of keys (or values) [start_n, start_n + BLOCK_N), storage dtype."""
    if PAGE >= BLOCK_N:
        x = _page_rows(desc, bt_row_ptr, start_n, kv_len, col, rows_per_block, PAGE)
    else:
        tl.static_assert(BLOCK_N // PAGE <= 8, "descriptor K/V loads stack at most 8 pages per tile")
        x = _page_rows(desc, bt_row_ptr, start_n, kv_len, col, rows_per_block, PAGE)
        x = _stack_rows(x, _page_rows(desc, bt_row_ptr, start_n + PAGE, kv_len, col, rows_per_block, PAGE))
        if BLOCK_N // PAGE >= 4:
            y = _page_rows(desc, bt_row_ptr, start_n + 2 * PAGE, kv_len, col, rows_per_block, PAGE)
            y = _stack_rows(y, _page_rows(desc, bt_row_ptr, start_n + 3 * PAGE, kv_len, col, rows_per_block, PAGE))
            x = _stack_rows(x, y)
        if BLOCK_N // PAGE == 8:
            z = _page_rows(desc, bt_row_ptr, start_n + 4 * PAGE, kv_len, col, rows_per_block, PAGE)
            z = _stack_rows(z, _page_rows(desc, bt_row_ptr, start_n + 5 * PAGE, kv_len, col, rows_per_block, PAGE))
            w = _page_rows(desc, bt_row_ptr, start_n + 6 * PAGE, kv_len, col, rows_per_block, PAGE)
            w = _stack_rows(w, _page_rows(desc, bt_row_ptr, start_n + 7 * PAGE, kv_len, col, rows_per_block, PAGE))
            x = _stack_rows(x, _stack_rows(z, w))
    return x


def kv_page_descriptors(data: torch.Tensor, block_n: int, block_d: int):
    """(K descriptor, V descriptor) over the rows of `data` (descriptor_reasons must be empty).

    Both use rows_per_block = 2 * page; the V descriptor starts `page` rows later."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, _, page, kv_heads, head = data.shape
    rows, width = num_blocks * 2 * page, kv_heads * head
    box = [min(page, block_n), block_d]
    k_desc = TensorDescriptor(data, [rows, width], [width, 1], box)
    v_desc = TensorDescriptor(data[:, 1], [rows - page, width], [width, 1], box)
    return k_desc, v_desc
