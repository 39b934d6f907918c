"""Block tables per layer group for hybrid models, over one shared BlockPool (plain Python).

`HybridKVCacheManager` has the scheduler's API of `KVCacheManager` and keeps one
KVCacheManager per layer group (kvstore/groups.py), all drawing block ids from one pool: block
b means the same memory in every group (slot j of each group shares a cache tensor), so no two
groups may hold it at once. What this class adds is agreement between the groups:

- allocation is all or nothing across groups: the sum of the groups' net needs (new blocks,
  minus what their window release returns) must fit the pool's free count, and the groups are
  then served in order of need, releasing groups first, so none can fail half-way;
- a prefix hit is one length for every group: full-attention hits are prefix-closed, windowed
  ones need only the sink blocks and the first query's window, so lookups repeat with the
  shortest hit as the limit until every group hits the same length;
- every group's hashes are salted with its index, so equal prefixes of two groups never map to
  one block;
- the blocks of all hits are pinned before any group allocates, so one group's allocation can
  never evict another group's hit.
Every per-request method (free, fork, take_copies, imports, check_invariants) applies to all
groups. The single-group path stays plain KVCacheManager (no cost for ordinary models).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.errors import ConfigError, check
from meshserve.kvstore.block_hash import BlockHash
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.manager import KVCacheManager, PrefixHit, RequestId
from meshserve.kvstore.request_blocks import KVCacheStats
from meshserve.kvstore.retention import RetentionPolicy


def group_salt(group: int) -> bytes:
    """Appended to a group's encoded extra keys. Group 0 has none (its hashes are those of a
    single-group manager); 0xc1 never starts a msgpack object, so a salted key string never
    equals another request's unsalted one."""
    return b"" if group == 0 else b"\xc1" + group.to_bytes(2, "little")


@dataclass(frozen=True)
class HybridPrefixHit:
    """A prefix hit of equal length in every group: `hits[g]` is group g's PrefixHit."""

    num_tokens: int
    hits: tuple[PrefixHit, ...]

    @property
    def extra_keys(self) -> tuple:
        return self.hits[0].extra_keys


class HybridKVCacheManager:
    """KVCacheManager's API over one manager per layer group sharing one BlockPool.

    retentions: per group, what its layers keep (KVGroupLayout.retentions).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        retentions: Sequence[RetentionPolicy],
        dcp_size: int = 1,
        enable_prefix_caching: bool = True,
    ) -> None:
        check(len(retentions) >= 2, "retentions", len(retentions), "two or more groups (else KVCacheManager)")
        self.pool = BlockPool(num_blocks)
        self.groups = [
            KVCacheManager(num_blocks, block_size, dcp_size=dcp_size, retention=r, pool=self.pool,
                           enable_prefix_caching=enable_prefix_caching, hash_salt=group_salt(g))
            for g, r in enumerate(retentions)
        ]  # fmt: skip
        self.retentions = tuple(retentions)
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.enable_prefix_caching = enable_prefix_caching
        # Lookups visit prefix-closed (full-attention) groups first: their hit bounds the others'.
        self._lookup_order = sorted(range(len(self.groups)), key=lambda g: not retentions[g].keeps_everything)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request can surely hold: every group may keep every block of it (a
        prompt computed in one chunk needs them all before a window releases any)."""
        return self.pool.num_total_blocks // len(self.groups) * self.tokens_per_block

    @property
    def free_capacity_tokens(self) -> int:
        return self.pool.num_free_blocks // len(self.groups) * self.tokens_per_block

    @property
    def num_requests(self) -> int:
        return self.groups[0].num_requests

    @property
    def stats(self) -> KVCacheStats:
        """Prefix counters of one group (every group hits the same length), block counters summed."""
        first = self.groups[0].stats
        return KVCacheStats(
            prefix_query_tokens=first.prefix_query_tokens,
            prefix_hit_tokens=first.prefix_hit_tokens,
            cow_copies=sum(g.stats.cow_copies for g in self.groups),
            window_released_blocks=sum(g.stats.window_released_blocks for g in self.groups),
        )

    # ---- per-request reads ----------------------------------------------------------------
    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self.groups[0]

    def block_tables(self, request_id: RequestId) -> tuple[list[int], ...]:
        """Per group, physical block ids by logical block index (NULL_BLOCK where released)."""
        return tuple(g.block_table(request_id) for g in self.groups)

    def num_tokens(self, request_id: RequestId) -> int:
        return self.groups[0].num_tokens(request_id)

    def group_block_hashes(self, request_id: RequestId) -> tuple[list[BlockHash], ...]:
        return tuple(g.block_hashes(request_id) for g in self.groups)

    def extra_keys(self, request_id: RequestId) -> tuple:
        return self.groups[0].extra_keys(request_id)

    def request_ids(self) -> list[RequestId]:
        return self.groups[0].request_ids()

    # ---- prefix lookup --------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], *, extra_keys: Sequence[object] = ()) -> HybridPrefixHit:
        """The longest prefix every group has cached (see the module doc). Pure."""
        limit = len(token_ids)  # a group's hit never exceeds limit - 1 tokens
        hits: list[PrefixHit | None] = [None] * len(self.groups)
        while True:
            for g in self._lookup_order:
                hit = hits[g]
                if hit is None or hit.num_tokens > limit - 1:
                    hit = hits[g] = self.groups[g].lookup_prefix(token_ids[:limit], extra_keys=extra_keys)
                limit = min(limit, hit.num_tokens + 1)
            shortest = limit - 1
            if all(h.num_tokens == shortest for h in hits):  # type: ignore[union-attr]
                return HybridPrefixHit(shortest, tuple(hits))  # type: ignore[arg-type]
            # A windowed hit cut shorter needs other blocks (its new window): look those up again.
            hits = [h if h is not None and h.num_tokens == shortest else None for h in hits]

    # ---- allocation -----------------------------------------------------------------------
    def _needs(self, request_id: RequestId, num_new_tokens: int, prefix: HybridPrefixHit | None) -> list[int]:
        if prefix is not None:
            check(isinstance(prefix, HybridPrefixHit) and len(prefix.hits) == len(self.groups), "prefix",
                  type(prefix).__name__, "the HybridPrefixHit of this manager's lookup_prefix")
            return [g.blocks_needed(request_id, num_new_tokens, prefix=h) for g, h in zip(self.groups, prefix.hits)]
        return [g.blocks_needed(request_id, num_new_tokens) for g in self.groups]

    def can_allocate(
        self, request_id: RequestId, num_new_tokens: int, *, prefix: HybridPrefixHit | None = None
    ) -> bool:
        return sum(self._needs(request_id, num_new_tokens, prefix)) <= self.pool.num_free_blocks

    def _advance_in_place(self, request_id: RequestId, num_new_tokens: int, token_ids: Sequence[int]) -> bool:
        """The common step of a running request: no group needs a block or releases one. Reads
        and advances the groups' request records directly (the fast path of
        KVCacheManager.append_slots, checked in every group before any is changed); False, and
        nothing changed, when some group needs its slow path."""
        records = [group._requests.get(request_id) for group in self.groups]
        for req in records:
            if req is None or req.num_tokens + num_new_tokens > req.fast_capacity or req.num_tokens >= req.release_at:
                return False
        for group, req in zip(self.groups, records):
            total = req.num_tokens + num_new_tokens
            req.num_tokens = total
            if total >= req.hash_at:
                group._register_full_blocks(req, token_ids, total)
        return True

    def allocate_slots(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int],
        *,
        prefix: HybridPrefixHit | None = None,
        extra_keys: Sequence[object] = (),
    ) -> bool:
        """KVCacheManager.allocate_slots for every group, all or nothing."""
        if prefix is None and num_new_tokens > 0 and self._advance_in_place(request_id, num_new_tokens, token_ids):
            return True
        running = request_id in self.groups[0]
        if running and prefix is not None:
            raise ConfigError("prefix", prefix.num_tokens, "None for a request that already holds blocks")
        if running and num_new_tokens >= 0:
            # A group takes at most ceil(k / tokens_per_block) new blocks plus one copy-on-write
            # copy; when every group's worst case fits at once, any order succeeds unchecked.
            worst = len(self.groups) * (num_new_tokens // self.tokens_per_block + 2)
            if worst <= self.pool.num_free_blocks:
                for g, group in enumerate(self.groups):
                    if not group.allocate_slots(request_id, num_new_tokens, token_ids):
                        raise AssertionError(f"group {g} refused {num_new_tokens} tokens within its worst case")
                return True
        needs = self._needs(request_id, num_new_tokens, prefix)
        if sum(needs) > self.pool.num_free_blocks:
            return False
        if running:
            # Releasing groups first: every prefix of the ascending needs fits, so none fails.
            for g in sorted(range(len(needs)), key=needs.__getitem__):
                if not self.groups[g].allocate_slots(request_id, num_new_tokens, token_ids):
                    raise AssertionError(f"group {g} refused {num_new_tokens} tokens after the joint check")
            return True
        pinned = [] if prefix is None else [b for h in prefix.hits for b in h.block_ids if b != NULL_BLOCK]
        self.pool.touch(pinned)  # no group's new blocks may evict another group's hit
        try:
            for g, group in enumerate(self.groups):
                hit = None if prefix is None else prefix.hits[g]
                if not group.allocate_slots(request_id, num_new_tokens, token_ids, prefix=hit, extra_keys=extra_keys):
                    raise AssertionError(f"group {g} refused admission after the joint check")
        except BaseException:
            for group in self.groups:
                group.free(request_id, keep_cache=True)
            raise
        finally:
            self.pool.free(pinned)
        return True

    def append_slots(
        self, request_ids: Sequence[RequestId], token_ids: Sequence[Sequence[int]], num_new_tokens: int = 1
    ) -> int:
        """KVCacheManager.append_slots over every group: stops at the first request that cannot
        get its slots in all groups (left unchanged) and returns how many succeeded."""
        done = 0
        for rid, tokens in zip(request_ids, token_ids):
            if not self.allocate_slots(rid, num_new_tokens, tokens):
                break
            done += 1
        return done

    # ---- release, fork, copies ------------------------------------------------------------
    def free(self, request_id: RequestId, *, keep_cache: bool = True) -> bool:
        found = False
        for group in reversed(self.groups):
            found = group.free(request_id, keep_cache=keep_cache) or found
        return found

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        check(parent_id in self.groups[0], "parent_id", parent_id, "an id that holds blocks")
        check(child_id not in self.groups[0], "child_id", child_id, "an id that holds no blocks yet")
        for group in self.groups:
            group.fork(parent_id, child_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs of every group. Block ids are unique across groups and slot j of
        every group is one tensor, so copying a pair in every cache tensor is the group's copy."""
        return [pair for group in self.groups for pair in group.take_copies()]

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()

    # ---- KV hand-over ---------------------------------------------------------------------
    def allocate_for_import(
        self,
        request_id: RequestId,
        num_tokens: int,
        block_positions: Sequence[Sequence[int]],
        *,
        extra_keys: Sequence[object] = (),
    ) -> list[int] | None:
        """Fresh blocks in every group (positions per group); the ids in group order, or None
        (nothing changes) if the pool cannot hold them all."""
        check(len(block_positions) == len(self.groups), "block_positions", len(block_positions),
              f"one list per layer group ({len(self.groups)})")
        check(request_id not in self.groups[0], "request_id", request_id, "an id that holds no blocks yet")
        if sum(len(p) for p in block_positions) > self.pool.num_free_blocks:
            return None
        blocks: list[int] = []
        try:
            for group, positions in zip(self.groups, block_positions):
                got = group.allocate_for_import(request_id, num_tokens, positions, extra_keys=extra_keys)
                if got is None:
                    raise AssertionError("a group refused an import after the joint check")
                blocks += got
        except BaseException:
            self.free(request_id, keep_cache=False)
            raise
        return blocks

    def register_group_hashes(self, request_id: RequestId, block_hashes: Sequence[Sequence[BlockHash]]) -> None:
        check(len(block_hashes) == len(self.groups), "block_hashes", len(block_hashes),
              f"one list per layer group ({len(self.groups)})")
        for group, hashes in zip(self.groups, block_hashes):
            group.register_hashes(request_id, hashes)

    # ---- checking -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The pool's invariants, every group's tables, and ref counts = entries over all groups."""
        self.pool.check_invariants()
        held: Counter[int] = Counter()
        ids = set(self.groups[0].request_ids())
        for g, group in enumerate(self.groups):
            if set(group.request_ids()) != ids:
                raise AssertionError(f"group {g} holds requests {set(group.request_ids()) ^ ids} the others do not")
            held.update(group.held_blocks())
        ref = self.pool.ref_counts
        for block in range(1, self.pool.num_blocks):
            if ref[block] != held[block]:
                raise AssertionError(f"block {block}: ref count {ref[block]} but {held[block]} table entries")
