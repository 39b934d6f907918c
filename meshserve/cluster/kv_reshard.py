"""KV hand-over between pools of different tensor-parallel sizes (dcp = 1 on both sides).

Which heads a rank stores is decided in one place, parallel/transform.py: with tp ranks, rank r
holds KV heads [kv_head_offset, kv_head_offset + local_kv_heads): split when there are at least
tp heads, one (replicated) head per rank otherwise. A latent (MLA) cache has no head axis: every
rank holds all of it.

Plan: for each decode rank j, its heads are cut into `Slice`s, each taken from the lowest prefill
rank that holds them (`sources_of`). A prefill rank offers its shard once per decode rank that
takes from it (`pullers_of`), under `pull_key(request_id, j)` (an offer serves one pull). Decode
rank j pulls each source into a staging cache shaped like that source's shard, checks it (the
connector's checksum), then copies the heads it needs into its own blocks (`copy_heads`). A
latent cache is pulled whole from prefill rank j % src_tp, straight into the decode rank's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.attention.backend import KVCache
from meshserve.parallel.transform import kv_head_offset, local_kv_heads


@dataclass(frozen=True)
class Slice:
    """Heads [src_lo, src_hi) of source rank `src_rank`'s shard go to [dst_lo, dst_hi) of ours
    (local head indices). None ranges: the whole cache (no head axis)."""

    src_rank: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None


def head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Global KV heads [lo, hi) that `rank` of `tp` stores."""
    lo = kv_head_offset(num_kv_heads, tp, 1, rank)
    return lo, lo + local_kv_heads(num_kv_heads, tp, 1)


def sources_of(dst_rank: int, num_kv_heads: int | None, src_tp: int, dst_tp: int) -> list[Slice]:
    """Where decode rank `dst_rank` of `dst_tp` gets its heads from prefill ranks of `src_tp`.

    num_kv_heads None: the caches have no head axis (latent); one whole copy.
    """
    if num_kv_heads is None:
        return [Slice(dst_rank % src_tp, None, None)]
    lo, hi = head_range(num_kv_heads, dst_tp, dst_rank)
    ranges = [head_range(num_kv_heads, src_tp, r) for r in range(src_tp)]
    out, h = [], lo
    while h < hi:
        src = min(r for r, (a, b) in enumerate(ranges) if a <= h < b)
        a, b = ranges[src]
        end = min(hi, b)
        out.append(Slice(src, (h - a, end - a), (h - lo, end - lo)))
        h = end
    return out


def pullers_of(src_rank: int, num_kv_heads: int | None, src_tp: int, dst_tp: int) -> list[int]:
    """Decode ranks that take some of `src_rank`'s shard."""
    return [j for j in range(dst_tp)
            if any(s.src_rank == src_rank for s in sources_of(j, num_kv_heads, src_tp, dst_tp))]


def pull_key(request_id: str, dst_rank: int) -> str:
    """The offer a decode rank pulls (each prefill rank offers its shard once per puller)."""
    return f"{request_id}>{dst_rank}"


def staging_caches(caches: Sequence[object | None], src_heads: int, num_blocks: int) -> list[KVCache | None]:
    """Caches shaped like a source rank's shard (`src_heads` local KV heads), blocks 1..num_blocks
    (block 0 is the null block, as in every cache). Layers that share a tensor (a hybrid KV
    layout) share their staging tensor too, so the staging layout is the source's."""
    out: list[KVCache | None] = []
    shared: dict[int, torch.Tensor] = {}
    for cache in caches:
        if cache is None:
            out.append(None)
            continue
        data = shared.get(id(cache.data))
        if data is None:
            _, two, bs, _, head_size = cache.data.shape
            data = shared[id(cache.data)] = torch.empty((num_blocks + 1, two, bs, src_heads, head_size),
                                                        dtype=cache.data.dtype, device=cache.data.device)
        out.append(KVCache(data, cache.k_scale, cache.v_scale))
    return out


def copy_heads(caches: Sequence[KVCache | None], staging: Sequence[KVCache | None], blocks: Sequence[int],
               piece: Slice) -> None:
    """Copy `piece`'s heads of staging blocks 1..n into our `blocks` (same order), every layer."""
    (slo, shi), (dlo, dhi) = piece.src_heads, piece.dst_heads
    done: set[int] = set()
    for cache, stage in zip(caches, staging):
        if cache is None or id(cache.data) in done:
            continue
        done.add(id(cache.data))
        idx = torch.tensor(list(blocks), dtype=torch.long, device=cache.data.device)
        # [n, 2, block_size, heads, head_size]: one block per row, K and V together
        cache.data[idx, :, :, dlo:dhi] = stage.data[1:, :, :, slo:shi]


def is_headless(caches: Sequence[object | None]) -> bool:
    """True when the caches have no KV-head axis (latent / MLA caches)."""
    return not any(isinstance(c, KVCache) for c in caches if c is not None)
