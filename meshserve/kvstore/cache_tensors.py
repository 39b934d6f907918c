"""Per-layer KV cache tensors sized from a memory budget.

Layouts (one tensor per layer, block id = dim 0, shared by all layers and the block table; a
hybrid layout (kvstore/groups.py) gives layer slot j of every group one shared tensor):
  standard  KVCache.data  [num_blocks, 2, block_size, num_kv_heads_local, head_size]  (0 = K, 1 = V)
  MLA       MLACache.data [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
FP8 caches (spec.kv_cache_dtype fp8_e4m3 / fp8_e5m2) hold float8 data plus float32 scalar
scales beside it (stored = real / scale). Layers that keep no cache (encoder-only) get None.
Layers with a different head_size_v are stored with max(head_size, head_size_v) so K and V
share one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.attention.backend import DTYPES, FP8_DTYPES, KVCache
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.spec import AttentionSpec
from meshserve.errors import ConfigError, check

# The latent cache type is the one the MLA backends read (attention/mla/cache.py).
MLACache = LatentCache

LayerCache = KVCache | MLACache


def cache_dtype(spec: AttentionSpec, model_dtype: str | torch.dtype) -> torch.dtype:
    """Storage dtype of a layer's cache: the float8 type for an FP8 cache, else the model dtype."""
    if spec.kv_cache_dtype.is_fp8:
        return FP8_DTYPES[spec.kv_cache_dtype]
    if isinstance(model_dtype, torch.dtype):
        return model_dtype
    check(model_dtype in DTYPES, "dtype", model_dtype, f"one of {sorted(DTYPES)}")
    return DTYPES[model_dtype]


def local_kv_heads(spec: AttentionSpec, tp_size: int = 1) -> int:
    """KV heads on one TP rank: split across ranks, replicated when fewer heads than ranks."""
    check(tp_size >= 1, "tp_size", tp_size, "an integer >= 1")
    if spec.num_kv_heads >= tp_size:
        check(
            spec.num_kv_heads % tp_size == 0,
            "tp_size",
            tp_size,
            f"a divisor of num_kv_heads={spec.num_kv_heads} (or larger than it)",
        )
        return spec.num_kv_heads // tp_size
    return 1


def block_shape(spec: AttentionSpec, block_size: int, *, tp_size: int = 1) -> tuple[int, ...] | None:
    """Shape of one block of a layer's cache (dims after num_blocks); None: no cache."""
    if not spec.uses_kv_cache:
        return None
    if spec.mla is not None:
        return (block_size, spec.mla.latent_size)
    head = max(spec.head_size, spec.v_size)
    return (2, block_size, local_kv_heads(spec, tp_size), head)


def block_bytes(
    specs: Sequence[AttentionSpec], block_size: int, model_dtype: str | torch.dtype, *, tp_size: int = 1
) -> int:
    """Bytes one block id costs across all layers of one rank (sparse MLA: with its index keys)."""
    total = 0
    for spec in specs:
        shape = block_shape(spec, block_size, tp_size=tp_size)
        if shape is not None:
            total += torch.Size(shape).numel() * cache_dtype(spec, model_dtype).itemsize
        if spec.mla is not None and spec.mla.indexer is not None:  # FP8 keys keep a float32 scale per token
            fp8 = spec.kv_cache_dtype.is_fp8
            total += block_size * (spec.mla.indexer.head_dim * cache_dtype(spec, model_dtype).itemsize + 4 * fp8)
    return total


def num_blocks_for_budget(
    specs: Sequence[AttentionSpec],
    block_size: int,
    model_dtype: str | torch.dtype,
    memory_bytes: int,
    *,
    tp_size: int = 1,
) -> int:
    """Blocks (including the null block 0) that fit in `memory_bytes` on one rank."""
    per_block = block_bytes(specs, block_size, model_dtype, tp_size=tp_size)
    check(per_block > 0, "specs", len(specs), "at least one layer that keeps a KV cache")
    num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise ConfigError(
            "memory_bytes",
            memory_bytes,
            f">= {2 * per_block} (two blocks of {per_block} bytes: null block + one)",
        )
    return num_blocks


def allocate_caches(
    specs: Sequence[AttentionSpec],
    *,
    num_blocks: int,
    block_size: int,
    dtype: str | torch.dtype,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
    layer_slots: Sequence[int | None] | None = None,
) -> list[LayerCache | None]:
    """One cache per layer (None where the layer keeps none), zero-filled, scales 1.0.

    layer_slots (KVGroupLayout.layer_slots): layers with the same slot share one data tensor
    (each keeps its own scales); None entries, or no list, get a tensor of their own.
    """
    check(num_blocks >= 2, "num_blocks", num_blocks, "an integer >= 2")
    check(block_size >= 1, "block_size", block_size, "an integer >= 1")
    slots = list(layer_slots) if layer_slots is not None else [None] * len(specs)
    check(len(slots) == len(specs), "layer_slots", len(slots), f"one entry per layer ({len(specs)})")
    shared: dict[int, torch.Tensor] = {}
    out: list[LayerCache | None] = []
    for spec, slot in zip(specs, slots):
        shape = block_shape(spec, block_size, tp_size=tp_size)
        if shape is None:
            out.append(None)
            continue
        data = shared.get(slot) if slot is not None else None
        if data is None:
            data = torch.zeros((num_blocks, *shape), dtype=cache_dtype(spec, dtype), device=device)
            if slot is not None:
                shared[slot] = data
        check(data.shape[1:] == shape and data.dtype == cache_dtype(spec, dtype), "layer_slots", slot,
              "slots shared only by layers of one page shape and cache dtype")
        one = torch.tensor(1.0, dtype=torch.float32, device=device)
        if spec.mla is not None:
            out.append(MLACache.over(data, spec.mla, kv_cache_dtype=spec.kv_cache_dtype, scale=one,
                                     dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype))
        else:
            out.append(KVCache(data=data, k_scale=one, v_scale=one.clone()))
    return out


def allocate_caches_for_budget(
    specs: Sequence[AttentionSpec],
    *,
    memory_bytes: int,
    block_size: int,
    dtype: str | torch.dtype,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
) -> tuple[int, list[LayerCache | None]]:
    """(num_blocks, caches) using as many blocks as `memory_bytes` holds on one rank."""
    num_blocks = num_blocks_for_budget(specs, block_size, dtype, memory_bytes, tp_size=tp_size)
    caches = allocate_caches(
        specs, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device, tp_size=tp_size
    )
    return num_blocks, caches


def copy_blocks(caches: Sequence[LayerCache | None], pairs: Sequence[tuple[int, int]]) -> None:
    """Apply copy-on-write pairs (src, dst) from KVCacheManager.take_copies to every cache
    tensor (once per tensor: layers of a hybrid layout share them)."""
    if not pairs:
        return
    seen: set[int] = set()
    for cache in caches:
        if cache is None:
            continue
        for tensor in block_tensors(cache):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            data = tensor.view(torch.uint8)  # byte view: index ops exist for every storage dtype
            src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=data.device)
            dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=data.device)
            # all sources are read before any write, so chains (a->b, b->c) stay correct
            data.index_copy_(0, dst, data.index_select(0, src))


def block_tensors(cache: LayerCache) -> list[torch.Tensor]:
    """Every tensor of a layer's cache indexed by block id (dim 0): the data, and sparse MLA's
    indexer keys and their FP8 scales."""
    if not isinstance(cache, MLACache):
        return [cache.data]
    return [t for t in (cache.data, cache.index_keys, cache.index_scale) if t is not None]
