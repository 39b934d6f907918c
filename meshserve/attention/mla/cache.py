"""The latent KV cache of an MLA layer: one vector per token, compressed KV plus the shared rope key.

Layout [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: a token's row is its latent
c (after kv_a_layernorm) followed by its rope-rotated key k_pe. With DeepSeek-V3's 512 + 64 that
is 576 values per token and layer, against 2 * 128 heads * 128 = 32768 for the expanded K/V:
the reason MLA caches so many more tokens per byte.

FP8 caches store value / scale in float8 (one scale for the whole layer, latent and rope alike)
and read back stored * scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshserve.attention.backend import FP8_DTYPES
from meshserve.attention.spec import KVCacheDtype, MLADims
from meshserve.core.arith import cdiv
from meshserve.errors import check


@dataclass
class LatentCache:
    """One MLA layer's paged latent cache.

    data:  [num_blocks, block_size, kv_lora_rank + rope_dim], model dtype or float8
    scale: [] float32 dequantisation scale (real = stored * scale); 1 for non-FP8 caches
    index_keys:  [num_blocks, block_size, index_head_dim] sparse MLA's indexer key cache (same
                 block ids as `data`), model dtype or float8_e4m3fn; None without an indexer
    index_scale: [num_blocks, block_size] float32 per-token scale of FP8 index keys, else None
    """

    data: torch.Tensor
    kv_lora_rank: int
    scale: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))
    index_keys: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check(self.data.dim() == 3, "data", tuple(self.data.shape), "a [num_blocks, block_size, width] tensor")
        check(
            0 < self.kv_lora_rank < self.data.shape[2],
            "kv_lora_rank",
            self.kv_lora_rank,
            f"an integer in [1, {self.data.shape[2] - 1}] (the row width is {self.data.shape[2]})",
        )

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        dims: MLADims,
        *,
        dtype: torch.dtype,
        kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
        device: torch.device | str = "cpu",
        scale: float = 1.0,
    ) -> LatentCache:
        """An empty cache for `num_blocks` blocks; `dtype` is the model dtype."""
        check(num_blocks >= 1, "num_blocks", num_blocks, "an integer >= 1")
        check(block_size >= 1, "block_size", block_size, "an integer >= 1")
        store = FP8_DTYPES[kv_cache_dtype] if kv_cache_dtype.is_fp8 else dtype
        data = torch.zeros(num_blocks, block_size, dims.latent_size, dtype=store, device=device)
        return cls.over(data, dims, kv_cache_dtype=kv_cache_dtype, scale=torch.tensor(float(scale), device=device))

    @classmethod
    def over(cls, data: torch.Tensor, dims: MLADims, *, kv_cache_dtype: KVCacheDtype, dtype: torch.dtype | None = None,
             scale: torch.Tensor) -> LatentCache:  # fmt: skip
        """A cache over latent rows `data`, plus a zeroed indexer key cache when `dims.indexer` is set
        (FP8 with per-token scales when the KV cache is FP8; else `dtype`, default data's dtype)."""
        keys = key_scale = None
        if dims.indexer is not None:
            shape = (*data.shape[:2], dims.indexer.head_dim)
            if kv_cache_dtype.is_fp8:
                keys = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=data.device)
                key_scale = torch.ones(shape[:2], dtype=torch.float32, device=data.device)
            else:
                keys = torch.zeros(shape, dtype=dtype or data.dtype, device=data.device)
        return cls(data, dims.kv_lora_rank, scale, keys, key_scale)

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def rope_dim(self) -> int:
        return self.data.shape[2] - self.kv_lora_rank

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype in FP8_DTYPES.values()

    @property
    def latent(self) -> torch.Tensor:
        """[num_blocks, block_size, kv_lora_rank] view (strided: rows are latent + rope wide)."""
        return self.data[..., : self.kv_lora_rank]

    @property
    def rope(self) -> torch.Tensor:
        """[num_blocks, block_size, rope_dim] view."""
        return self.data[..., self.kv_lora_rank :]


def latent_bytes_per_token(dims: MLADims, dtype: torch.dtype, kv_cache_dtype: KVCacheDtype) -> int:
    """Bytes one token occupies in one layer's latent cache (and indexer key cache, if any)."""
    itemsize = 1 if kv_cache_dtype.is_fp8 else torch.empty((), dtype=dtype).element_size()
    total = dims.latent_size * itemsize
    if dims.indexer is not None:  # FP8 index keys carry a float32 scale per token
        total += dims.indexer.head_dim * itemsize + (4 if kv_cache_dtype.is_fp8 else 0)
    return total


def write_latent_kv(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' latent [T, kv_lora_rank] and rope key [T, rope_dim] at `slot_mapping` [T].

    A slot of -1 skips the token (another DCP rank stores it). Triton on CUDA (no host sync, so
    it can be captured in a CUDA graph), plain indexing elsewhere; both store identical bits.
    """
    _check_write(latent, k_pe, cache, slot_mapping)
    if cache.data.is_cuda:
        from meshserve.attention.kernels.mla_write import write_latent_kv_triton

        write_latent_kv_triton(latent, k_pe, cache, slot_mapping)
    else:
        write_latent_kv_torch(latent, k_pe, cache, slot_mapping)


def write_latent_kv_torch(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    rows = torch.cat([latent[keep].float(), k_pe[keep].float()], dim=-1)
    if cache.is_fp8:
        limit = torch.finfo(cache.data.dtype).max
        rows = (rows / cache.scale.float()).clamp(-limit, limit)
    flat = cache.data.view(-1, cache.data.shape[2])
    flat[slot_mapping[keep]] = rows.to(cache.data.dtype)


def _check_write(latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor) -> None:
    tokens = slot_mapping.shape[0]
    check(
        tuple(latent.shape) == (tokens, cache.kv_lora_rank),
        "latent",
        tuple(latent.shape),
        f"[{tokens}, {cache.kv_lora_rank}] (one latent row per slot)",
    )
    check(
        tuple(k_pe.shape) == (tokens, cache.rope_dim),
        "k_pe",
        tuple(k_pe.shape),
        f"[{tokens}, {cache.rope_dim}] (one rope key per slot)",
    )


def gather_latent(cache: LatentCache, block_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` cached rows, dequantised to float32.

    block_row: [max_blocks] int32. Returns latent [length, kv_lora_rank], k_pe [length, rope_dim].
    """
    bs = cache.block_size
    num_blocks = cdiv(length, bs)
    rows = cache.data[block_row[:num_blocks].long()].reshape(num_blocks * bs, -1)[:length].float()
    if cache.is_fp8:
        rows = rows * cache.scale.float()
    return rows[:, : cache.kv_lora_rank], rows[:, cache.kv_lora_rank :]
