"""Per-layer paged KV cache tensors for one rank, sized from a byte budget."""

from __future__ import annotations

import torch

from meshserve.attention.backend import KVCache


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_size * itemsize


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                       dtype: torch.dtype, device: torch.device | str) -> list[KVCache]:
    """One KVCache per layer: data [num_blocks, 2, block_size, num_kv_heads, head_size] in `dtype`."""
    return [
        KVCache(torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
