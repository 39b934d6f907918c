"""K/V tiles of the step's own new tokens read through tensor descriptors (TMA on Hopper and later).

A prefill sequence with no cached context attends only over the keys of this step, which the
layer hands to the backend as [num_tokens, kv_heads, D] next to the query (after writing them to
the cache). Seen as rows [num_tokens, kv_heads * D], the keys of one sequence are consecutive
rows from its first query's row, so a tile of BLOCK_N keys is ONE descriptor request whatever
the cache's page size (kernels/kv_pages.py needs pages >= BLOCK_N for that). Rows past the last
token read as zero (the descriptor's bounds); rows of the next sequence are masked by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_rows(
    desc,  # tensor descriptor over the step's K (or V) rows, block [BLOCK_N, BLOCK_D]
    first_row,  # the sequence's first token row (query_start_loc[seq])
    start_n,  # first key of the tile
    col,  # first column: kv_head * head stride
):
    """[BLOCK_N, BLOCK_D] tile of keys (or values) [start_n, start_n + BLOCK_N), storage dtype."""
    return desc.load([(first_row + start_n).to(tl.int32), col])  # descriptor coordinates are 32-bit


def kv_row_descriptors(key: torch.Tensor, value: torch.Tensor, block_n: int, block_d: int):
    """(K descriptor, V descriptor) over the rows of key/value [num_tokens, kv_heads, D]
    (host_plans.row_descriptor_reasons must be empty for both)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def rows(x: torch.Tensor):
        tokens, kv_heads, head = x.shape
        return TensorDescriptor(x, [tokens, kv_heads * head], [x.stride(0), 1], [block_n, block_d])

    return rows(key), rows(value)
