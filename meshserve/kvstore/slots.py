"""Where each new token's K/V goes: slot mapping from block tables, with DCP sharding.

Without DCP, position p of a sequence lives in block table[p // block_size] at offset
p % block_size, slot = block * block_size + offset. With DCP of size d (vLLM semantics) a
logical block covers block_size * d positions: position p lives on rank p % d, at local position
p // d, i.e. in physical block table[p // (block_size * d)] at offset (p // d) % block_size of
that rank's cache. Tokens that belong to another rank get slot -1 (write_kv skips them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.errors import MeshserveError, check
from meshserve.kvstore.block_pool import NULL_BLOCK


def local_seq_len(seq_len: int, dcp_size: int = 1, dcp_rank: int = 0) -> int:
    """How many of positions [0, seq_len) a DCP rank stores."""
    return max(0, (seq_len - dcp_rank + dcp_size - 1) // dcp_size)


def slot_mapping(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """[T] int64 cache slots of the new tokens of a packed batch (T = sum(query_lens)).

    block_tables: per sequence, physical block ids by logical block index (KVCacheManager)
    context_lens: per sequence, tokens already cached; query_lens: new tokens this step.
    Slots are on `dcp_rank`'s cache; -1 where another rank stores the token.
    """
    check(block_size >= 1, "block_size", block_size, "an integer >= 1")
    check(dcp_size >= 1, "dcp_size", dcp_size, "an integer >= 1")
    check(0 <= dcp_rank < dcp_size, "dcp_rank", dcp_rank, f"in [0, {dcp_size})")
    num = len(block_tables)
    check(
        len(context_lens) == num and len(query_lens) == num,
        "query_lens",
        len(query_lens),
        f"one entry per block table ({num}), like context_lens",
    )
    if num == 0 or sum(query_lens) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    tpb = block_size * dcp_size
    width = max(len(t) for t in block_tables)
    table = torch.zeros((num, max(width, 1)), dtype=torch.int64)
    for i, row in enumerate(block_tables):
        need = -(-(context_lens[i] + query_lens[i]) // tpb)
        check(len(row) >= need, f"block_tables[{i}]", len(row), f">= {need} blocks for the new tokens")
        if row:
            table[i, : len(row)] = torch.tensor(list(row), dtype=torch.int64)
    lens = torch.tensor(list(query_lens), dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(num), lens)  # [T] sequence of each token
    starts = torch.tensor(list(context_lens), dtype=torch.int64)
    first = torch.cumsum(lens, 0) - lens
    positions = starts[seq] + torch.arange(int(lens.sum())) - first[seq]  # [T]
    blocks = table[seq, positions // tpb]
    if bool((blocks == NULL_BLOCK).any()):
        raise MeshserveError("a new token maps to the null block: its block was released or never allocated")
    slots = blocks * block_size + (positions // dcp_size) % block_size
    if dcp_size > 1:
        slots = torch.where(positions % dcp_size == dcp_rank, slots, torch.full_like(slots, -1))
    return slots.to(device)
