"""The hand-over's host paths without Python per block (issue 19) against the per-block code they
replaced, kept here as the oracle: frame plans, the pool's hash adoption,
reservation for an import, and the sent blocks of a pin. Random cases, exact state."""

import random

import pytest

from meshserve.errors import ConfigError, MeshserveError
from meshserve.kvstore.block_hash import hash_blocks
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.kvtransfer.pins import HandoverBlocks
from meshserve.kvtransfer.wire import plan_frames


# ---- the per-block code (before issue 19's host-path work), as the oracle --------------------
def plan_frames_per_block(blocks, block_nbytes, max_frame_bytes):
    frames = []
    for layer, per_block in enumerate(block_nbytes):
        cap = max(1, max_frame_bytes // per_block)
        i = 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and j - i < cap and blocks[j] == blocks[j - 1] + 1:
                j += 1
            frames.append((layer, i, j - i))
            i = j
    return frames


class PerBlockPool(BlockPool):
    """BlockPool adopting hashes one `cache_block` call at a time."""

    def cache_blocks(self, blocks, block_hashes):
        for block, block_hash in zip(blocks, block_hashes):
            self.cache_block(block, block_hash)


def state(pool: BlockPool) -> tuple:
    """Everything a pool's later behaviour depends on, orders included."""
    return (list(pool.ref_counts), list(pool._free), list(pool._cached), dict(pool._by_hash), list(pool._hash),
            pool.stats)


# ---- tests ------------------------------------------------------------------------------------
def random_blocks(rng: random.Random, n: int) -> list[int]:
    out, x = [], rng.randrange(1, 5)
    for _ in range(n):
        x = x + 1 if rng.random() < 0.8 else rng.randrange(1, 10_000)
        out.append(x)
    return out


def test_plan_frames_equals_the_per_block_plan():
    rng = random.Random(0)
    for _ in range(2000):
        blocks = random_blocks(rng, rng.choice([0, 1, 2, rng.randrange(3, 80), rng.randrange(200, 400)]))
        nbytes = [rng.choice([1, 3, 8, 64, 4096]) for _ in range(rng.randrange(1, 5))]
        cap = rng.choice([1, 2, 7, 100, 5000, 1 << 40])
        got = plan_frames(blocks, nbytes, cap)
        assert got == plan_frames_per_block(blocks, nbytes, cap), (blocks, nbytes, cap)
        assert all(type(v) is int for frame in got for v in frame)  # msgpack-able, as before


def test_pool_hash_adoption_equals_the_per_block_pool():
    """Random fork / free / hash adoption (new hashes, known ones, blocks hashed already) /
    allocation sequences: same state after every operation, same errors."""
    rng = random.Random(2)
    for _ in range(60):
        size = rng.choice([80, 300])
        fast, slow = BlockPool(size), PerBlockPool(size)
        held: list[list[int]] = []  # lists of blocks each holding one reference
        for _ in range(40):
            op = rng.random()
            if op < 0.3 and fast.num_free_blocks:
                n = rng.randrange(1, fast.num_free_blocks + 1)
                got = fast.allocate(n)
                assert got == slow.allocate(n)
                held.append(got)
            elif op < 0.45 and held:  # a fork: one more reference to a held list
                blocks = list(rng.choice(held))
                if rng.random() < 0.5:
                    blocks.reverse()
                fast.touch(blocks)
                slow.touch(blocks)
                held.append(blocks)
            elif op < 0.6 and held:  # adopt hashes (some new, some known, some blocks hashed already)
                blocks = rng.choice(held)
                names = [bytes([rng.randrange(4)]) * 32 if rng.random() < 0.05 else rng.randbytes(32)
                         for _ in blocks]
                fast.cache_blocks(blocks, names)
                slow.cache_blocks(blocks, names)
            elif op < 0.9 and held:  # free, tail first as a request's end does, or shuffled
                blocks = held.pop(rng.randrange(len(held)))
                if rng.random() < 0.3:
                    rng.shuffle(blocks)
                fast.free(list(reversed(blocks)))
                slow.free(list(reversed(blocks)))
            elif held:  # errors: a block freed twice in one list (and past its references)
                blocks = list(rng.choice(held)) * 2 + [NULL_BLOCK]
                errors = []
                for pool in (fast, slow):
                    with pytest.raises(MeshserveError) as err:
                        pool.free(list(blocks))
                    errors.append(str(err.value))
                assert errors[0] == errors[1]
                return  # the references of the held lists are now partly gone
            assert state(fast) == state(slow)
            fast.check_invariants()


def test_reservation_for_an_import_equals_the_per_position_tables():
    rng = random.Random(3)
    for _ in range(200):
        window = rng.choice([None, 64])
        kv = KVCacheManager(600, 16, retentions=(RetentionPolicy(window),) * rng.choice([1, 2]))
        num_tokens = rng.randrange(1, 2000)
        num_table = -(-num_tokens // 16)
        positions = []
        for _g in range(kv.num_groups):
            keep = sorted(rng.sample(range(num_table), rng.randrange(0, num_table + 1))) if window else \
                list(range(num_table))
            positions.append(keep)
        got = kv.allocate_for_import("r", num_tokens, positions)
        if got is None:
            assert sum(map(len, positions)) > kv.num_free_blocks
            continue
        flat = iter([b for g in got for b in g])
        for table, keep, blocks in zip(kv.block_tables("r"), positions, got):
            expected = [NULL_BLOCK] * num_table
            for p in keep:
                expected[p] = next(flat)
            assert table == expected and blocks == [b for b in expected if b != NULL_BLOCK]
        kv.check_invariants()


@pytest.mark.parametrize("positions", [[[0, 0]], [[1, 0]], [[-1, 2]], [[0, 9]], [[0, 1, 1]]])
def test_reservation_refuses_positions_naming_the_field(positions):
    kv = KVCacheManager(64, 16)
    with pytest.raises(ConfigError, match="block_positions"):
        kv.allocate_for_import("r", 100, positions)  # 7 table entries
    assert "r" not in kv and kv.num_free_blocks == 63


def test_import_commit_adopts_hashes_as_the_per_block_pool_does():
    """A fresh import (bulk), one whose prefix is cached here already and one with released
    (NULL) entries: the pool ends as the per-block adoption leaves it."""
    tokens = list(range(40 * 16 + 5))
    for window, cached_first in ((None, False), (None, True), (64, False)):
        pools = []
        for cls in (BlockPool, PerBlockPool):
            kv = KVCacheManager(200, 16, retentions=(RetentionPolicy(window),))
            kv.pool = kv._tables.pool = cls(200)
            if cached_first:  # the same prefix computed here before: its hashes are taken
                kv.allocate_slots("old", len(tokens), tokens)
                kv.free("old")
            num_table = -(-len(tokens) // 16)
            keep = [p for p in range(num_table) if window is None or p >= num_table - 6]
            kv.allocate_for_import("r", len(tokens), [keep])
            kv.register_hashes("r", [hash_blocks(tokens, 16)])
            kv.check_invariants()
            pools.append(state(kv.pool))
        assert pools[0] == pools[1]


def test_handover_blocks_lists_held_blocks_and_positions():
    sent = HandoverBlocks("r", 100, ((0, 0, 5, 6, 0, 9, 10), (1, 2, 3, 0, 0, 0, 4)), ((), ()))
    assert sent.block_positions == ((2, 3, 5, 6), (0, 1, 2, 6))
    assert sent.blocks == [5, 6, 9, 10, 1, 2, 3, 4]
    wired = HandoverBlocks.from_wire(sent.to_wire())
    assert wired == sent and wired.block_positions == sent.block_positions


def test_header_with_a_hash_that_is_not_bytes_is_refused():
    import msgpack

    from meshserve.kvtransfer.wire import KVHeader, KVLayout, KVTransferError

    layout = KVLayout("m", 16, 1, (("float32", (2, 16, 1, 8)),))
    header = KVHeader("r", layout, 40, ((0, 1, 2),), ((b"a" * 32, b"b" * 32),), (), ((1.0, 1.0),),
                      ((0, 0, 3),), 3 * 1024, 0)
    assert KVHeader.unpack(header.pack()).block_hashes == ((b"a" * 32, b"b" * 32),)
    obj = msgpack.unpackb(header.pack(), raw=False)
    obj["block_hashes"] = [[b"a" * 32, "b" * 32]]
    with pytest.raises(KVTransferError, match="bad_header"):
        KVHeader.unpack(msgpack.packb(obj, use_bin_type=True))
