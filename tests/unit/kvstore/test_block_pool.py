"""BlockPool: states, eviction order, counters, errors."""

import pytest

from meshserve.errors import ConfigError, MeshserveError
from meshserve.kvstore.block_hash import hash_block, hash_blocks
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool, OutOfBlocksError


def test_fresh_pool_hands_out_ascending_ids_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_total_blocks == 5 and pool.num_free_blocks == 5
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert NULL_BLOCK not in pool.allocate(0)
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_cached_blocks_are_reused_until_evicted_oldest_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A" * 32)
    pool.cache_block(b, b"B" * 32)
    pool.free([b, a, c])  # b freed first: first in line for eviction; c has no hash: free list
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    assert pool.lookup(b"A" * 32) == a
    assert pool.allocate(1) == [c]  # the free list goes before the LRU
    assert pool.allocate(1) == [b] and pool.stats.evictions == 1
    assert pool.lookup(b"B" * 32) is None and pool.lookup(b"A" * 32) == a
    pool.touch([a])  # a prefix hit revives the cached block
    assert pool.ref_counts[a] == 1 and pool.stats.revived == 1 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_shared_block_is_freed_when_the_last_reference_goes():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert pool.ref_counts[a] == 1 and pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2
    with pytest.raises(MeshserveError, match="holds no reference"):
        pool.free([a])
    with pytest.raises(MeshserveError, match="which is free"):
        pool.touch([a])
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"H" * 32)
    assert not pool.cache_block(b, b"H" * 32)
    assert pool.block_hash(b) is None and pool.lookup(b"H" * 32) == a


def test_reset_prefix_cache_frees_cached_blocks_and_keeps_held_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"A" * 32)
    pool.cache_block(b, b"B" * 32)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.lookup(b"B" * 32) is None and pool.ref_counts[b] == 1
    pool.check_invariants()


def test_usage_counts_only_referenced_blocks():
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"A" * 32)
    pool.free([a])
    assert pool.usage == pytest.approx(1 / 4)


def test_bad_size_names_the_field():
    with pytest.raises(ConfigError, match="num_blocks=1"):
        BlockPool(1)


def test_check_invariants_catches_a_block_both_free_and_referenced():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool._free.append(a)  # break it on purpose
    with pytest.raises(AssertionError, match="free xor referenced"):
        pool.check_invariants()


def test_block_hash_chains_the_prefix_and_the_extra_keys():
    tokens = [1, 2, 3, 4, 5, 6]
    h = hash_blocks(tokens, 2)
    assert len(h) == 3 and h[1] == hash_block(h[0], [3, 4])
    other = hash_blocks([9, 9, 3, 4], 2)
    assert other[1] != h[1]  # same block tokens, different parent
    assert hash_blocks(tokens, 2, extra=b"lora")[0] != h[0]
    assert hash_blocks(tokens, 4) == [hash_block(None, [1, 2, 3, 4])]
