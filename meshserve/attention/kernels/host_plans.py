"""Host-side launch planning of the Triton attention kernels: grids, tiles, splits, block sizes,
and whether tensor descriptors can read a cache.

Backends plan on the host before any kernel runs, so this module imports no Triton: a backend
imports it at the top like any module, and the `@triton.jit` modules hold only device code.
"""

from __future__ import annotations

import torch

from meshserve.core.arith import cdiv


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 << (max(n, 1) - 1).bit_length()


def choose_partition(
    max_keys: int, num_decodes: int, programs_per_decode: int, target_programs: int, block_n: int,
    min_partition: int,
) -> tuple[int, int]:
    """(partition size, number of splits) of a split-KV decode so that the grid has about
    `target_programs` programs; programs_per_decode: a decode's programs per split (its KV heads
    for the GQA kernel, its blocks of heads for the MLA kernel).

    Many short programs balance the waves of equal-length work over the multiprocessors; each
    split costs one partial (o, lse) write and a merge read, small next to its KV reads until a
    split holds fewer than `min_partition` keys. Partitions are whole BLOCK_N tiles.
    """
    max_keys = max(max_keys, 1)
    want = max(1, cdiv(target_programs, max(num_decodes * programs_per_decode, 1)))
    most = max(1, max_keys // max(min_partition, block_n))
    splits = min(want, most)
    partition = cdiv(max_keys, splits)
    partition = cdiv(partition, block_n) * block_n
    return partition, cdiv(max_keys, partition)


def prefill_tiles(
    query_lens: tuple[int, ...], kv_lens: tuple[int, ...], block_m: int, causal: bool
) -> tuple[list[int], list[int]]:
    """(sequence, first query) of every program, the ones with most keys to visit first."""
    tiles = []
    for s, (q_len, kv_len) in enumerate(zip(query_lens, kv_lens)):
        context = kv_len - q_len
        for q0 in range(0, q_len, block_m):
            work = context + min(q0 + block_m, q_len) if causal else kv_len
            tiles.append((-work, s, q0))
    tiles.sort()
    return [s for _, s, _ in tiles], [q0 for _, _, q0 in tiles]


def mla_prefill_tiles(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_m: int
) -> tuple[list[int], list[int]]:
    """(sequence, first query) of every program, the ones with the most keys to visit first."""
    tiles = sorted(
        (-(seq_len - q_len + min(q0 + block_m, q_len)), s, q0)
        for s, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens))
        for q0 in range(0, q_len, block_m)
    )
    return [s for _, s, _ in tiles], [q0 for _, _, q0 in tiles]


def merge_block_sizes(num_heads: int, head_size: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): the whole head padded to a power of two; about 2K elements per program."""
    block_d = next_power_of_2(head_size)
    block_h = max(1, min(next_power_of_2(num_heads), 2048 // block_d))
    return block_h, block_d


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 models get IEEE fp32 products, not TF32: fp32 is chosen for accuracy. Others: default."""
    return "ieee" if dtype == torch.float32 else None


def descriptor_reasons(
    data: torch.Tensor, head_size: int, block_d: int, block_n: int, compute_capability: tuple[int, int] | None
) -> list[str]:
    """Why the K/V cache `data` [num_blocks, 2, page, kv_heads, D] cannot be read by descriptors
    (empty: it can). On CPU the Triton interpreter emulates them."""
    out = []
    if data.is_cuda and (compute_capability is None or compute_capability < (9, 0)):
        out.append(f"tensor descriptors need compute capability >= 9.0 (have {compute_capability})")
    if data.dim() != 5 or data.shape[1] != 2:
        out.append(f"cache shape {tuple(data.shape)} is not [num_blocks, 2, page, kv_heads, head]")
        return out
    if not data.is_contiguous():
        out.append("the cache is not contiguous")
    if block_d != head_size:
        out.append(f"head_size={head_size} is not a power of two >= 16 (a descriptor box is the whole head)")
    row_bytes = data.shape[3] * data.shape[4] * data.element_size()
    if row_bytes % 16:
        out.append(f"a cache row of kv_heads * head = {row_bytes} bytes is not a multiple of 16")
    if data.shape[0] * 2 * data.shape[2] >= 2**31:
        out.append("the cache has 2**31 rows or more (descriptor coordinates are 32-bit)")
    if data.data_ptr() % 16:
        out.append("the cache is not 16-byte aligned")
    page = data.shape[2]
    if page < block_n and block_n // page > 8:
        out.append(f"block_n={block_n} spans more than 8 pages of {page}")
    return out


def row_descriptor_reasons(
    x: torch.Tensor, head_size: int, block_d: int, compute_capability: tuple[int, int] | None
) -> list[str]:
    """Why the step's K or V `x` [num_tokens, kv_heads, D] cannot be read by descriptors over its
    rows [num_tokens, kv_heads * D] (empty: it can; kernels/kv_rows.py)."""
    out = []
    if x.is_cuda and (compute_capability is None or compute_capability < (9, 0)):
        out.append(f"tensor descriptors need compute capability >= 9.0 (have {compute_capability})")
    if x.dim() != 3:
        return out + [f"shape {tuple(x.shape)} is not [num_tokens, kv_heads, head]"]
    if block_d != head_size:
        out.append(f"head_size={head_size} is not a power of two >= 16 (a descriptor box is the whole head)")
    if x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        out.append(f"strides {tuple(x.stride())}: the heads of a token are not one packed row")
    if (x.stride(0) * x.element_size()) % 16 or (x.shape[1] * x.shape[2] * x.element_size()) % 16:
        out.append("a token row is not a multiple of 16 bytes")
    if x.data_ptr() % 16:
        out.append("the tensor is not 16-byte aligned")
    if x.shape[0] >= 2**31:
        out.append("2**31 tokens or more (descriptor coordinates are 32-bit)")
    return out
