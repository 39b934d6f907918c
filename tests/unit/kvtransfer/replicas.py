"""Tiny replicas (manager + caches + connector) with random cache bytes, for hand-over tests.

Deterministic from (kind, seed): a peer process can rebuild the sender's state to check bytes.
"""

from __future__ import annotations

import torch

from meshserve.attention.spec import AttentionSpec, AttentionType, IndexerDims, KVCacheDtype, MLADims
from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvstore.cache_tensors import allocate_caches, block_tensors
from meshserve.kvstore.groups import KVGroupLayout
from meshserve.kvstore.manager import KVCacheManager
from tests.kv_connector import KVConnector

_GQA = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8)
SPARSE = MLADims(16, 8, 4, 8, indexer=IndexerDims(num_heads=2, head_dim=8, topk=4))
SPECS = {
    "gqa": [
        _GQA,
        AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, attn_type=AttentionType.ENCODER_ONLY),
        _GQA,
    ],
    "fp8": [AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, kv_cache_dtype=KVCacheDtype.FP8_E4M3)]
    * 2,
    "mla": [AttentionSpec(num_heads=4, num_kv_heads=4, head_size=12, mla=MLADims(16, 8, 4, 8))] * 2,
    # sparse MLA (DeepSeek-V3.2): an index key cache beside each latent cache; FP8 keys carry scales
    "sparse_mla": [AttentionSpec(num_heads=4, num_kv_heads=1, head_size=12, mla=SPARSE)] * 2,
    "sparse_mla_fp8": [AttentionSpec(num_heads=4, num_kv_heads=1, head_size=12, mla=SPARSE,
                                     kv_cache_dtype=KVCacheDtype.FP8_E4M3)] * 2,
    "window": [AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, sliding_window=8, num_sink_tokens=2)]
    * 2,
    # windowed and full layers of one page shape: a hybrid layout of 2 groups of 2 layers
    "hybrid": [AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, sliding_window=6), _GQA] * 2,
    # the same with another window: 2 groups too, but a different group layout
    "hybrid_w10": [AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, sliding_window=10), _GQA] * 2,
}


class Replica:
    def __init__(
        self,
        kind: str = "gqa",
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: str = "bfloat16",
        model_id: str = "tiny",
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        specs = SPECS[kind]
        self.layout = KVGroupLayout.from_specs(specs)
        self.kv = KVCacheManager(num_blocks, block_size, retentions=self.layout.retentions)
        self.caches = allocate_caches(specs, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                                      device=device, layer_slots=self.layout.layer_slots(len(specs)))
        gen = torch.Generator().manual_seed(seed)
        for tensor in {id(t): t for c in self.caches if c is not None for t in block_tensors(c)}.values():
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))  # CPU bytes: any device
        self.connector = KVConnector(self.kv, self.caches, model_id=model_id)

    def add_request(self, rid: str, tokens: list[int], *, step: int = 0) -> None:
        """Prefill in one chunk, or decode one token at a time after `step` prompt tokens."""
        first = step or len(tokens)
        assert self.kv.allocate_slots(rid, first, tokens[:first])
        for n in range(first + 1, len(tokens) + 1):
            assert self.kv.allocate_slots(rid, 1, tokens[:n])

    def fragment(self, count: int) -> None:
        """Leave every other block of the next `2 * count` free blocks taken, so new requests get
        scattered block ids."""
        for i in range(count):
            assert self.kv.allocate_slots(
                f"filler-{i}", self.kv.tokens_per_block, [0] * self.kv.tokens_per_block
            )
            assert self.kv.allocate_slots(
                f"gap-{i}", self.kv.tokens_per_block, [1] * self.kv.tokens_per_block
            )
        for i in range(count):
            self.kv.free(f"gap-{i}", keep_cache=False)

    def request_bytes(self, rid: str) -> list[torch.Tensor]:
        """Per KV layer group and cached layer: the bytes of the request's held blocks, in position order."""
        out = []
        for table in self.kv.block_tables(rid):
            held = [b for b in table if b != NULL_BLOCK]
            out += [t.view(torch.uint8)[held].cpu() for c in self.caches if c is not None for t in block_tensors(c)]
        return out

    def held_positions(self, rid: str) -> list[list[int]]:
        """Per KV layer group, the table indices that hold a block."""
        return [[i for i, b in enumerate(t) if b != NULL_BLOCK] for t in self.kv.block_tables(rid)]
