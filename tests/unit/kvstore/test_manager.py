"""KVCacheManager: prefix reuse, fork/copy-on-write, all-or-nothing, windows and sinks, DCP."""

import pytest

from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.errors import ConfigError, MeshserveError
from meshserve.kvstore.block_hash import hash_blocks
from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.retention import RetentionPolicy


def admit(kv, rid, tokens, chunk=None, extra_keys=()):
    hit = kv.lookup_prefix(tokens, extra_keys=extra_keys)
    n = len(tokens) - hit.num_tokens if chunk is None else chunk
    assert kv.allocate_slots(rid, n, tokens, prefix=hit)
    return hit


def test_prefix_hit_is_the_longest_cached_prefix_and_leaves_the_last_token():
    kv = KVCacheManager(32, 4)
    prompt = list(range(16))
    admit(kv, "a", prompt)
    assert kv.lookup_prefix(prompt).num_tokens == 12  # 16 cached, the last token is recomputed
    hit = kv.lookup_prefix(prompt[:10] + [99] * 8)
    assert hit.num_tokens == 8 and list(hit.block_ids[0]) == kv.block_tables("a")[0][:2]
    assert kv.lookup_prefix([5] + prompt[1:]).num_tokens == 0  # the chain starts at token 0
    admit(kv, "b", prompt[:10] + [99] * 8)
    assert kv.block_tables("b")[0][:2] == kv.block_tables("a")[0][:2]  # equal prefixes share blocks
    assert kv.block_tables("b")[0][2] not in kv.block_tables("a")[0]
    assert kv.stats.prefix_hit_tokens == 8 and kv.stats.prefix_query_tokens == 34
    kv.check_invariants()


def test_extra_keys_separate_otherwise_equal_prefixes():
    kv = KVCacheManager(32, 4)
    prompt = list(range(13))
    admit(kv, "a", prompt, extra_keys=("lora-a",))
    assert kv.lookup_prefix(prompt, extra_keys=("lora-b",)).num_tokens == 0
    assert kv.lookup_prefix(prompt).num_tokens == 0
    assert kv.lookup_prefix(prompt, extra_keys=("lora-a",)).num_tokens == 12


def test_blocks_are_hashed_as_decode_fills_them_and_survive_free():
    kv = KVCacheManager(32, 4)
    tokens = [1, 2, 3]
    admit(kv, "a", tokens)
    for t in range(4, 10):
        tokens.append(t)
        assert kv.allocate_slots("a", 1, tokens)
    assert kv.block_hashes("a") == (hash_blocks(tokens, 4),)
    table = list(kv.block_tables("a")[0])
    kv.free("a")
    assert kv.num_free_blocks == kv.num_total_blocks and kv.pool.num_cached_blocks == 2
    hit = kv.lookup_prefix(tokens + [10])
    assert hit.num_tokens == 8 and list(hit.block_ids[0]) == table[:2]


def test_stale_prefix_hit_is_refused():
    kv = KVCacheManager(4, 2)
    admit(kv, "a", [1, 2, 3])
    kv.free("a")
    hit = kv.lookup_prefix([1, 2, 3])
    assert hit.num_tokens == 2
    assert kv.allocate_slots("b", 6, list(range(6)))  # evicts the cached block
    with pytest.raises(MeshserveError, match="stale PrefixHit"):
        kv.allocate_slots("c", 1, [1, 2, 3], prefix=hit)
    assert "c" not in kv


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(5, 4)  # 4 usable blocks
    admit(kv, "a", list(range(10)))
    before = (kv.num_free_blocks, list(kv.block_tables("a")[0]), kv.num_tokens("a"))
    assert not kv.can_allocate("a", 7)
    assert not kv.allocate_slots("a", 7, list(range(17)))
    assert (kv.num_free_blocks, list(kv.block_tables("a")[0]), kv.num_tokens("a")) == before
    assert not kv.allocate_slots("b", 9, list(range(9)))
    assert "b" not in kv and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 6, list(range(16)))
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(16, 4)
    tokens = list(range(6))
    admit(kv, "p", tokens)
    kv.fork("p", "c")
    assert kv.block_tables("c")[0] == kv.block_tables("p")[0]
    shared = kv.block_tables("p")[0][1]
    assert kv.pool.ref_counts[shared] == 2
    assert kv.allocate_slots("c", 1, tokens + [100])
    (copy,) = kv.take_copies()
    assert copy[0] == shared and kv.block_tables("c")[0][1] == copy[1] != shared
    assert kv.block_tables("c")[0][0] == kv.block_tables("p")[0][0]  # the full block stays shared
    assert kv.allocate_slots("p", 1, tokens + [200])  # the parent now owns its block alone
    assert kv.take_copies() == [] and kv.block_tables("p")[0][1] == shared
    assert kv.stats.cow_copies == 1
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == kv.num_total_blocks
    kv.check_invariants()


def test_fork_needs_a_free_block_for_the_copy():
    kv = KVCacheManager(3, 4)  # 2 usable blocks
    admit(kv, "p", [1, 2])
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1, [1, 2, 3])  # copy takes the second block
    assert not kv.can_allocate("p", 3) and not kv.allocate_slots("p", 3, [1, 2, 4, 5, 6])
    kv.check_invariants()


def test_errors_name_the_field():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ConfigError, match="num_new_tokens=-1"):
        kv.allocate_slots("a", -1, [])
    with pytest.raises(ConfigError, match="request_id='nope'"):
        kv.block_tables("nope")[0]
    admit(kv, "a", [1, 2, 3])
    with pytest.raises(ConfigError, match="child_id='a'"):
        kv.fork("a", "a")
    with pytest.raises(ConfigError, match="prefix"):
        kv.allocate_slots("a", 1, [1, 2, 3, 4], prefix=kv.lookup_prefix([1, 2]))
    assert not kv.free("nope")


def brute_force_needed(specs_or_pairs, base, num_blocks, tpb):
    """Blocks a query at position >= base can read, straight from the masking rule."""
    out = []
    for idx in range(num_blocks):
        needed = False
        for window, sinks in specs_or_pairs:
            for k in range(idx * tpb, (idx + 1) * tpb):
                for q in range(base, max(base, k) + 1):
                    if k <= q and (window is None or q - k < window or k < sinks):
                        needed = True
        out.append(needed)
    return out


@pytest.mark.parametrize(
    "groups",
    [
        [(8, 0)],
        [(8, 3)],
        [(5, 2), (11, 0)],  # hybrid: two windows, sinks in one group
        [(6, 0), (None, 0)],  # hybrid with a full-attention group: nothing is released
        [(1, 0)],
    ],
)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_window_and_sink_retention_match_brute_force(groups, chunk):
    specs = [
        AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, sliding_window=w, num_sink_tokens=s)
        for w, s in groups
    ]
    specs.append(
        AttentionSpec(num_heads=2, num_kv_heads=2, head_size=8, attn_type=AttentionType.ENCODER_ONLY)
    )
    policy = RetentionPolicy.from_specs(specs)
    tpb = 2
    kv = KVCacheManager(64, tpb, retentions=[policy])
    tokens: list[int] = []
    peak = 0
    while len(tokens) < 60:
        base = len(tokens)
        tokens += [len(tokens) % 7] * chunk
        assert kv.allocate_slots("s", chunk, tokens)
        table = kv.block_tables("s")[0]
        held = [b != NULL_BLOCK for b in table]
        assert held == brute_force_needed(groups, base, len(table), tpb), (base, table)
        peak = max(peak, kv.num_total_blocks - kv.num_free_blocks)
        kv.check_invariants()
    if all(w is not None for w, _ in groups):  # StreamingLLM: bounded memory, blocks reused cyclically
        window, sinks = max(w for w, _ in groups), max(s for _, s in groups)
        assert peak <= -(-sinks // tpb) + (window + chunk) // tpb + 2
        assert kv.stats.window_released_blocks > 0


def test_windowed_prefix_hit_needs_only_sinks_and_the_window():
    tpb = 2
    kv = KVCacheManager(64, tpb, retentions=[RetentionPolicy(sliding_window=4, num_sink_tokens=2)])
    prompt = list(range(20))
    admit(kv, "a", prompt)
    table = list(kv.block_tables("a")[0])
    kv.free("a")
    for i in range(2, 7):  # drop blocks that the next request's first query no longer reads
        kv.pool.uncache(table[i])
    hit = kv.lookup_prefix(prompt)
    # 19 of 20 tokens may be cached: 18 (9 blocks); the first query at 18 reads keys 15..18 + sinks 0, 1
    assert hit.num_tokens == 18
    assert [b != NULL_BLOCK for b in hit.block_ids[0]] == brute_force_needed([(4, 2)], 18, 9, tpb)
    admit(kv, "b", prompt)
    assert kv.num_tokens("b") == 20
    kv.check_invariants()


def test_dcp_capacity_and_logical_blocks():
    kv = KVCacheManager(9, 4, dcp_size=2)
    assert kv.tokens_per_block == 8 and kv.capacity_tokens == 8 * 8
    admit(kv, "a", list(range(17)))
    assert len(kv.block_tables("a")[0]) == 3 and kv.free_capacity_tokens == 5 * 8


def test_import_allocation_is_all_or_nothing_and_adopts_hashes():
    kv = KVCacheManager(6, 2)
    assert kv.allocate_for_import("x", 12, [[0, 1, 2, 3, 4, 5]]) is None
    assert "x" not in kv and kv.num_free_blocks == 5
    (blocks,) = kv.allocate_for_import("y", 7, [[0, 2, 3]], extra_keys=("k",))
    assert kv.block_tables("y")[0] == [blocks[0], NULL_BLOCK, blocks[1], blocks[2]]
    hashes = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    kv.register_hashes("y", [hashes])
    assert kv.pool.lookup(hashes[2]) == blocks[1] and kv.pool.lookup(hashes[1]) is None
    with pytest.raises(ConfigError, match="block_positions"):
        kv.allocate_for_import("z", 4, [[1, 0]])
    kv.check_invariants()


def test_a_decode_step_that_cannot_get_a_block_leaves_the_request_unchanged():
    kv = KVCacheManager(6, 2)  # 5 usable blocks
    tokens = {r: [1, 2, 3, 4] if r != "c" else [7] for r in "abc"}
    for r, t in tokens.items():
        assert kv.allocate_slots(r, len(t), t)
    assert kv.num_free_blocks == 0
    for t in tokens.values():
        t.append(9)
    assert kv.allocate_slots("c", 1, tokens["c"])  # room in its last block
    assert not kv.allocate_slots("a", 1, tokens["a"])  # a needs a block
    assert kv.num_tokens("c") == 2 and kv.num_tokens("a") == 4 and kv.num_tokens("b") == 4
    kv.free("b")
    assert kv.allocate_slots("a", 1, tokens["a"]) and kv.num_tokens("a") == 5
    assert kv.block_hashes("a") == (hash_blocks(tokens["a"], 2),)
    kv.check_invariants()


def test_a_fork_hashes_its_own_tokens_not_the_parents_prompt():
    """Regression (found by the state machine): the parent's lookup hashed its whole prompt
    ahead of computing it; a fork that diverges inside that block must not inherit the hash."""
    kv = KVCacheManager(16, 2)
    prompt = [7, 7, 7]
    assert kv.allocate_slots("p", 1, prompt, prefix=kv.lookup_prefix(prompt))  # chunk of one token
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1, [7, 0])
    assert kv.lookup_prefix(prompt).num_tokens == 0
    assert kv.lookup_prefix([7, 0, 5]).num_tokens == 2
    assert kv.allocate_slots("p", 1, prompt[:2])
    assert kv.lookup_prefix(prompt).num_tokens == 2
