"""Paged KV cache: block pool, prefix reuse, window/sink retention, block tables, cache tensors.

Block logic (block_pool, block_hash, retention, groups, prefix, tables, manager) is plain Python;
torch appears only in cache_tensors and slots. Moving KV between replicas is kvtransfer/. See
docs/kvstore.md.
"""

from meshserve.kvstore.block_hash import BlockHash, encode_extra_keys, hash_block, hash_blocks
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool, OutOfBlocksError, PoolStats
from meshserve.kvstore.manager import KVCacheManager, KVCacheStats
from meshserve.kvstore.prefix import PrefixHit
from meshserve.kvstore.retention import RetentionPolicy

__all__ = [
    "NULL_BLOCK",
    "BlockHash",
    "BlockPool",
    "KVCacheManager",
    "KVCacheStats",
    "OutOfBlocksError",
    "PoolStats",
    "PrefixHit",
    "RetentionPolicy",
    "encode_extra_keys",
    "hash_block",
    "hash_blocks",
]
