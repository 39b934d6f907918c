"""Which cached block is evicted first: the policy block_pool.py and docs/kvstore.md state.

BlockPool: cached (ref 0, hashed) blocks form an LRU by the time they were last freed; the
free list is used up before any of them is evicted, then the least recently freed goes first
(a block revived by a prefix hit and freed again counts from its new free).
KVCacheManager.free: a request's blocks are freed tail first, so its tail is evicted before
the head blocks that other requests are likelier to share.
"""

import pytest

from meshserve.kvstore.block_pool import BlockPool
from meshserve.kvstore.manager import KVCacheManager


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def _evict(pool: BlockPool, how: str) -> list[int]:
    """Allocate one block `how` the pool offers it; the ids of the blocks whose hash it dropped."""
    before = {b for b in range(1, pool.num_blocks) if pool.block_hash(b) is not None}
    (pool.allocate_one() if how == "allocate_one" else pool.allocate(1)[0])
    return sorted(b for b in before if pool.block_hash(b) is None)


@pytest.fixture
def pool_freed_in_a_known_order():
    """6 blocks: five hashed ones freed in the order 3, 1, 5, 2, 4, one plain block freed among
    them; then block 1 is revived by a prefix hit and freed again (now the most recent)."""
    pool = BlockPool(7)
    blocks = pool.allocate(6)
    assert blocks == [1, 2, 3, 4, 5, 6]
    for b in (1, 2, 3, 4, 5):
        assert pool.cache_block(b, _hash(b))
    pool.free([3])
    pool.free([1, 5])
    pool.free([6])  # no hash: the free list
    pool.free([2])
    pool.free([4])
    pool.touch([1])  # a prefix hit takes block 1 back out of the LRU ...
    pool.free([1])  # ... and freeing it again makes it the most recently freed
    pool.check_invariants()
    return pool


@pytest.mark.parametrize("how", ["allocate_one", "allocate"])
def test_cached_blocks_are_evicted_least_recently_freed_first(pool_freed_in_a_known_order, how):
    pool = pool_freed_in_a_known_order
    assert _evict(pool, how) == []  # the plain free block goes before any eviction
    order = [_evict(pool, how) for _ in range(5)]
    assert order == [[3], [5], [2], [4], [1]], f"eviction order {order}, expected LRU 3, 5, 2, 4, 1"
    assert pool.stats.evictions == 5 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_a_batch_allocation_evicts_the_oldest_cached_blocks(pool_freed_in_a_known_order):
    pool = pool_freed_in_a_known_order
    out = pool.allocate(4)  # the plain block plus the three least recently freed
    assert out == [2, 3, 5, 6]
    assert [b for b in (1, 2, 3, 4, 5) if pool.lookup(_hash(b)) == b] == [1, 4]
    pool.check_invariants()


def test_a_freed_request_loses_its_tail_before_its_head():
    kv = KVCacheManager(5, 4)  # 4 usable blocks of 4 tokens
    prompt = list(range(16))
    hit = kv.lookup_prefix(prompt)
    assert kv.allocate_slots("a", 16, prompt, prefix=hit)
    table = list(kv.block_tables("a")[0])
    kv.free("a")
    assert kv.pool.num_cached_blocks == 4
    assert kv.lookup_prefix(prompt + [99]).num_tokens == 16
    assert kv.allocate_slots("b", 4, [7] * 4)  # evicts one block of "a"
    assert kv.block_tables("b")[0] == [table[3]], "the tail block of the freed request goes first"
    assert kv.lookup_prefix(prompt + [99]).num_tokens == 12
    assert kv.allocate_slots("c", 8, [8] * 8)  # two more
    assert kv.block_tables("c")[0] == sorted(table[1:3])
    assert kv.lookup_prefix(prompt + [99]).num_tokens == 4  # the head block is still a prefix hit
    kv.check_invariants()
