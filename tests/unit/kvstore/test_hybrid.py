"""Layer groups (KVGroupLayout) and KVCacheManager with several groups over one shared pool."""

import pytest

from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype
from meshserve.errors import ConfigError
from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvstore.cache_tensors import allocate_caches, copy_blocks
from meshserve.kvstore.groups import KVGroupLayout
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.prefix import PrefixHit
from meshserve.kvstore.retention import RetentionPolicy

FULL = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8)
LOCAL = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, sliding_window=4)
WINDOW, ALL = RetentionPolicy(4), RetentionPolicy()


def manager(num_blocks=64, block_size=4, **kw) -> KVCacheManager:
    """Group 0 windowed (4 tokens), group 1 full attention."""
    return KVCacheManager(num_blocks, block_size, retentions=[WINDOW, ALL], **kw)


def admit(kv, rid, tokens, chunk=None):
    hit = kv.lookup_prefix(tokens)
    assert kv.allocate_slots(rid, len(tokens) - hit.num_tokens if chunk is None else chunk, tokens, prefix=hit)
    return hit


def decode(kv, rid, tokens, start):
    for n in range(start + 1, len(tokens) + 1):
        assert kv.allocate_slots(rid, 1, tokens[:n])


# ---- layouts -------------------------------------------------------------------------------
def test_layout_groups_layers_of_one_retention_in_equal_groups():
    gemma2 = KVGroupLayout.from_specs([LOCAL, FULL] * 2)
    assert gemma2.groups == ((0, 2), (1, 3)) and gemma2.retentions == (WINDOW, ALL)
    assert gemma2.layer_slots(4) == [0, 0, 1, 1] and gemma2.group_of_layer(4) == [0, 1, 0, 1]
    gemma3 = KVGroupLayout.from_specs(([LOCAL] * 5 + [FULL]) * 2)  # 10 local, 2 global: groups of 2
    assert gemma3.num_groups == 6 and gemma3.num_slots == 2
    assert gemma3.groups[-1] == (5, 11) and gemma3.retentions.count(ALL) == 1
    assert KVGroupLayout.from_wire(gemma3.to_wire()) == gemma3
    uneven = KVGroupLayout.from_specs([LOCAL, LOCAL, FULL])  # gcd(2, 1) = 1: three groups of one
    assert uneven.groups == ((0,), (1,), (2,))


def test_layouts_that_stay_one_group():
    plain = KVGroupLayout.from_specs([FULL] * 3)
    assert not plain.is_hybrid and plain.retentions == (ALL,) and plain.layer_slots(3) == [0, 1, 2]  # a tensor each
    fp8_local = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, sliding_window=4,
                              kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    mixed = KVGroupLayout.from_specs([fp8_local, FULL])  # page shapes differ: the union, as before
    assert not mixed.is_hybrid and mixed.retentions == (ALL,)
    with pytest.raises(ConfigError, match="equal size"):
        KVGroupLayout(((0, 1), (2,)), (WINDOW, ALL))


def test_slots_share_one_tensor_and_copies_apply_once():
    layout = KVGroupLayout.from_specs([LOCAL, FULL] * 2)
    caches = allocate_caches([LOCAL, FULL] * 2, num_blocks=8, block_size=4, dtype="float32",
                             layer_slots=layout.layer_slots(4))
    assert caches[0].data is caches[1].data and caches[2].data is caches[3].data
    assert caches[0].data is not caches[2].data and caches[0].k_scale is not caches[1].k_scale
    for c in (caches[0], caches[2]):
        c.data.copy_(c.data.new_tensor(range(8)).view(8, 1, 1, 1, 1).expand_as(c.data))
    copy_blocks(caches, [(1, 2), (2, 3)])  # a chain: every tensor reads the old contents once
    assert caches[0].data[:, 0, 0, 0, 0].tolist() == [0, 1, 1, 2, 4, 5, 6, 7]


# ---- allocation ----------------------------------------------------------------------------
def test_windowed_group_releases_while_the_full_group_keeps_everything():
    kv = manager()
    tokens = list(range(1, 41))
    admit(kv, "a", tokens[:8])
    decode(kv, "a", tokens, 8)
    local, full = kv.block_tables("a")
    assert NULL_BLOCK not in full and len(full) == 10
    assert [b == NULL_BLOCK for b in local] == [True] * 9 + [False]  # the last query reads 36..39
    assert not set(local) & set(full) - {NULL_BLOCK}
    assert kv.stats.window_released_blocks == 9
    kv.check_invariants()


def test_admission_is_all_or_nothing_when_the_pool_runs_out_mid_group():
    kv = manager(num_blocks=8)  # 7 usable: a 12-token prompt needs 3 + 3
    admit(kv, "a", list(range(12)))
    assert kv.num_free_blocks == 1
    before = (list(kv.pool.ref_counts), kv.num_free_blocks)
    assert not kv.can_allocate("b", 4)
    assert not kv.allocate_slots("b", 4, [9] * 4)  # group 0 alone would fit, group 1 would not
    assert "b" not in kv and (list(kv.pool.ref_counts), kv.num_free_blocks) == before
    kv.check_invariants()


def test_growth_is_all_or_nothing_and_counts_what_the_window_returns():
    kv = manager(num_blocks=8)  # 7 usable
    admit(kv, "a", list(range(8)))  # 2 + 2 blocks
    admit(kv, "b", [50, 51, 52])  # 1 + 1 blocks: one free
    assert kv.num_free_blocks == 1
    before = {r: [list(t) for t in kv.block_tables(r)] for r in ("a", "b")}
    assert not kv.allocate_slots("b", 2, [50, 51, 52, 53, 54])  # both groups need a block
    assert {r: [list(t) for t in kv.block_tables(r)] for r in ("a", "b")} == before
    # "a" at 8 tokens: both groups need block 2, but the windowed one gives block 0 back (window 4)
    assert kv.can_allocate("a", 1)
    assert kv.allocate_slots("a", 1, list(range(9)))
    assert kv.block_tables("a")[0][0] == NULL_BLOCK and kv.num_free_blocks == 0
    kv.check_invariants()


def test_nothing_leaks_after_free_abort_and_preemption():
    kv = manager(num_blocks=24)
    start = kv.num_free_blocks
    admit(kv, "a", list(range(30)), chunk=10)
    assert kv.allocate_slots("a", 10, list(range(20)))
    admit(kv, "b", list(range(30)))  # a prefix hit on what "a" wrote
    kv.fork("b", "c")
    assert kv.allocate_slots("c", 1, list(range(31)))
    assert not kv.allocate_slots("a", 200, list(range(220)))
    for rid in ("b", "a"):
        kv.free(rid)  # finish, preempt
    kv.free("c", keep_cache=False)  # abort after a failed step
    assert kv.num_requests == 0 and kv.num_free_blocks == start
    kv.check_invariants()


# ---- prefix hits ---------------------------------------------------------------------------
def test_a_hit_has_one_length_in_every_group_and_is_served_from_both():
    kv = manager()
    tokens = list(range(1, 41))
    admit(kv, "a", tokens[:8])
    decode(kv, "a", tokens, 8)
    kv.free("a")
    hit = kv.lookup_prefix(tokens + [99])
    assert isinstance(hit, PrefixHit) and hit.num_tokens == 40
    local, full = hit.block_ids
    assert len(local) == len(full) == 10 and NULL_BLOCK not in full
    assert local[:9] == (NULL_BLOCK,) * 9 and local[9] != NULL_BLOCK  # the first query's window only
    assert kv.allocate_slots("b", 1, tokens + [99], prefix=hit)
    assert kv.block_tables("b")[1][:10] == list(full)
    assert kv.stats.prefix_hit_tokens == 40
    kv.check_invariants()


def test_hits_are_cut_to_the_shortest_group_and_rechecked_there():
    """Two windowed groups (window 4: a hit of k blocks needs only block k - 1) and a full one, all
    cached for 40 tokens. Evicted: blocks 4.. of group 1, block 3 of group 0. Group 0 first hits 10
    blocks, group 1 only 4; cut to 4, group 0 needs its block 3: gone, so 3 blocks; group 1 at 3
    blocks needs block 2: cached. Every group ends at 12 tokens."""
    kv = KVCacheManager(64, 4, retentions=[WINDOW, WINDOW, ALL])
    tokens = list(range(1, 41))
    admit(kv, "a", tokens[:8])
    decode(kv, "a", tokens, 8)
    blocks = [[kv.pool.lookup(h) for h in hashes] for hashes in kv.block_hashes("a")]
    kv.free("a")
    assert kv.lookup_prefix(tokens + [0]).num_tokens == 40
    for b in blocks[1][4:] + [blocks[0][3]]:
        kv.pool.uncache(b)
    hit = kv.lookup_prefix(tokens + [0])
    assert [len(ids) for ids in hit.block_ids] == [3, 3, 3] and hit.num_tokens == 12
    assert hit.block_ids[0] == (NULL_BLOCK, NULL_BLOCK, blocks[0][2])
    assert hit.block_ids[1] == (NULL_BLOCK, NULL_BLOCK, blocks[1][2])
    assert hit.block_ids[2] == tuple(blocks[2][:3])
    assert kv.allocate_slots("b", 29, tokens + [0], prefix=hit)
    kv.check_invariants()


def test_one_groups_allocation_never_evicts_another_groups_hit():
    """The LRU's oldest blocks are the full group's hit; the windowed group allocates first and
    must evict something else (pinned hits)."""
    kv = manager(num_blocks=9)
    a, c = list(range(1, 9)), list(range(20, 28))
    admit(kv, "a", a)
    admit(kv, "c", c)
    kv.free("a")  # oldest in the LRU: a's full-group blocks, freed first
    kv.free("c")
    hit = kv.lookup_prefix(a + [9, 10, 11, 12, 13])
    assert hit.num_tokens == 8 and kv.pool.num_cached_blocks == 8
    assert kv.allocate_slots("b", 5, a + [9, 10, 11, 12, 13], prefix=hit)
    assert kv.block_tables("b")[1][:2] == list(hit.block_ids[1])
    kv.check_invariants()


def test_group_hashes_never_collide():
    kv = manager()
    admit(kv, "a", list(range(9)))
    local, full = kv.block_hashes("a")
    assert len(local) == len(full) == 2 and not set(local) & set(full)
    one_group = KVCacheManager(64, 4, retentions=[ALL])
    with pytest.raises(ConfigError, match="PrefixHit"):
        kv.allocate_slots("b", 1, [1], prefix=one_group.lookup_prefix([1]))
    assert "b" not in kv


# ---- forks, imports ------------------------------------------------------------------------
def test_fork_copies_the_shared_partial_block_in_every_group():
    kv = manager()
    admit(kv, "p", list(range(6)))
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1, list(range(7)))
    copies = kv.take_copies()
    assert len(copies) == 2  # one per group
    for (src, dst), parent, child in zip(copies, kv.block_tables("p"), kv.block_tables("c")):
        assert (src, dst) == (parent[1], child[1]) and parent[0] == child[0]
    kv.check_invariants()
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_total_blocks


def test_import_allocates_every_group_or_nothing():
    kv = manager(num_blocks=6)  # 5 usable
    assert kv.allocate_for_import("x", 12, [[0, 1, 2], [0, 1, 2]]) is None
    with pytest.raises(ConfigError, match="block_positions"):
        kv.allocate_for_import("z", 8, [[0], [1, 0]])  # group 0 allocates, group 1 refuses
    assert "z" not in kv and kv.num_free_blocks == 5
    blocks = kv.allocate_for_import("y", 12, [[2], [0, 1, 2]])
    assert blocks is not None and [len(b) for b in blocks] == [1, 3]
    assert kv.block_tables("y") == ([NULL_BLOCK, NULL_BLOCK, blocks[0][0]], blocks[1])
    kv.check_invariants()


def test_encoder_decoder_layout_keeps_cross_layers_in_their_own_group():
    """BART's specs: 3 decoder self-attention layers, then their 3 cross-attention layers."""
    cross = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=16, attn_type=AttentionType.CROSS)
    own = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=16)
    layout = KVGroupLayout.from_specs([own] * 3 + [cross] * 3)
    assert layout.groups == ((0, 1, 2), (3, 4, 5)) and layout.encoder_group == 1
    assert layout.decoder_retentions == (RetentionPolicy(),)  # the KV manager's one group
    assert layout.layer_slots(6) == [0, 1, 2, 0, 1, 2]  # self layer j and cross layer j share tensor j
    assert layout.group_of_layer(6) == [0] * 6  # cross layers read group 0's metadata (encoder tables)
    assert KVGroupLayout.from_wire(layout.to_wire()) == layout
    with pytest.raises(ConfigError, match="attention_specs"):  # page shapes differ
        KVGroupLayout.from_specs([own] * 2 + [AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16,
                                                            attn_type=AttentionType.CROSS)] * 2)
    with pytest.raises(ConfigError, match="encoder_group"):
        KVGroupLayout(((0,), (1,)), (RetentionPolicy(),) * 2, encoder_group=0)
