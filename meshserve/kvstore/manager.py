"""Per-request block tables over a BlockPool: the scheduler's view of the KV cache (no torch).

One API for every model: a request holds one block table per KV layer group (kvstore/groups.py),
and every per-request call takes and returns one entry per group. A plain model is one group;
a hybrid one (sliding-window and full layers sharing a page shape) has several, drawing block
ids from one pool. Usage, semantics and design choices: docs/kvstore.md. In short:
- counts are in logical tokens: with DCP of size d a logical block covers block_size * d tokens;
- a table keeps one entry per logical block; blocks released by a sliding window become
  NULL_BLOCK (0), which attention never reads, so a position's table index never changes;
- allocate_slots is all or nothing across groups; it assumes earlier slots are computed by the
  time the new ones are (synchronous scheduling) and hashes blocks filled by the scheduled tokens;
- block_tables returns the manager's own lists: read them, never modify them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import islice
from operator import lt

from meshserve.core.arith import cdiv
from meshserve.errors import ConfigError, check
from meshserve.kvstore.block_hash import BlockHash, hash_blocks
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.prefix import PrefixHit, lookup
from meshserve.kvstore.request_blocks import KVCacheStats, RequestBlocks
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.kvstore.tables import BlockTables

RequestId = Hashable
__all__ = ["KVCacheManager", "KVCacheStats", "PrefixHit", "RequestId"]


class KVCacheManager:
    """Block tables of running requests, prefix reuse, window release, copy-on-write forks.

    num_blocks:  physical blocks, including the null block 0 (block b is the same memory in every
                 group: slot j of every group shares one cache tensor)
    block_size:  tokens per physical block on one rank
    retentions:  per KV layer group, what its layers keep (KVGroupLayout.retentions); one
                 full-attention group by default
    dcp_size:    decode-context-parallel ranks; a logical block covers block_size * dcp_size tokens
    enable_prefix_caching: hash full blocks and reuse them across requests
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        retentions: Sequence[RetentionPolicy] = (RetentionPolicy(),),
        dcp_size: int = 1,
        enable_prefix_caching: bool = True,
    ) -> None:
        check(block_size >= 1, "block_size", block_size, "an integer >= 1")
        check(dcp_size >= 1, "dcp_size", dcp_size, "an integer >= 1")
        check(len(retentions) >= 1, "retentions", len(retentions), "one RetentionPolicy per KV layer group (>= 1)")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.retentions = tuple(retentions)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables = BlockTables(self.pool, self.retentions, self.tokens_per_block, enable_prefix_caching)
        self.stats: KVCacheStats = self._tables.stats
        self._register = self._tables.register_full_blocks  # the fast paths' one call
        self._requests: dict[RequestId, RequestBlocks] = {}
        # Lookups visit full-attention groups first: their (prefix-closed) hit bounds the others'.
        self._lookup_order = sorted(range(len(self.retentions)), key=lambda g: not self.retentions[g].keeps_everything)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """KV layer groups: block tables per request."""
        return len(self.retentions)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-unreferenced blocks count as free)."""
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request can surely hold (× dcp_size: each rank keeps 1/dcp of every block):
        every group may keep every block of it (a prompt computed in one chunk needs them all
        before a window releases any)."""
        return self.pool.num_total_blocks // self.num_groups * self.tokens_per_block

    @property
    def free_capacity_tokens(self) -> int:
        return self.pool.num_free_blocks // self.num_groups * self.tokens_per_block

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- per-request reads ----------------------------------------------------------------
    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._requests

    def block_tables(self, request_id: RequestId) -> tuple[list[int], ...]:
        """Per group, physical block ids by logical block index (NULL_BLOCK where released).
        The manager's own lists: read-only."""
        return self._get(request_id).tables

    def num_tokens(self, request_id: RequestId) -> int:
        """Slots allocated to the request (tokens computed or being computed)."""
        return self._get(request_id).num_tokens

    def block_hashes(self, request_id: RequestId) -> tuple[list[BlockHash], ...]:
        """Per group, hashes of the request's full blocks whose hash was registered (in position
        order; every group has as many)."""
        req = self._get(request_id)
        return tuple(h[: req.num_registered] for h in req.hashes)

    def extra_keys(self, request_id: RequestId) -> tuple:
        return self._get(request_id).extra_keys

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    # ---- prefix lookup --------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], *, extra_keys: Sequence[object] = ()) -> PrefixHit:
        """The longest prefix of `token_ids` that every group has cached, which a new request can
        start from. Pure.

        Full attention needs every block of the prefix cached. With a sliding window only the
        sink blocks and the blocks the first query's window reaches must be cached; the others
        appear as NULL_BLOCK in the group's `block_ids`.
        """
        keys = tuple(extra_keys)
        if not self.enable_prefix_caching:
            empty = ((),) * self.num_groups
            return PrefixHit(0, empty, empty, keys)  # type: ignore[arg-type]
        t = self._tables
        return lookup(self.pool, self.retentions, t.extras(keys), self._lookup_order, self.tokens_per_block,
                      token_ids, keys)  # fmt: skip

    # ---- allocation -----------------------------------------------------------------------
    def can_allocate(self, request_id: RequestId, num_new_tokens: int, *, prefix: PrefixHit | None = None) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed. Pure."""
        return self.blocks_needed(request_id, num_new_tokens, prefix=prefix) <= self.pool.num_free_blocks

    def blocks_needed(self, request_id: RequestId, num_new_tokens: int, *, prefix: PrefixHit | None = None) -> int:
        """Free blocks `allocate_slots` would consume over all groups, net of what its window
        release returns (negative when it returns more). Pure."""
        check(num_new_tokens >= 0, "num_new_tokens", num_new_tokens, "an integer >= 0")
        req = self._requests.get(request_id)
        if req is None:
            self._check_prefix(prefix)
            return self._tables.admission_need(prefix, num_new_tokens)
        need, freeable = self._tables.growth_need(req, num_new_tokens)
        return need - freeable

    def allocate_slots(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int],
        *,
        prefix: PrefixHit | None = None,
        extra_keys: Sequence[object] = (),
    ) -> bool:
        """Give the request slots for `num_new_tokens` more tokens in every group; False (and no
        change) if the pool cannot. A new request starts from `prefix` (from lookup_prefix on the
        same token ids), or from nothing. token_ids: the request's tokens so far, including the
        ones being scheduled (used to hash blocks as they fill; may be shorter, e.g. speculative
        slots). extra_keys: for a new request without `prefix` (a prefix carries its own).
        """
        req = self._requests.get(request_id)
        # Fast path, every decode step and most chunks: no group releases a block and no last
        # block is shared with a fork; new blocks are appended. Limits come from refresh.
        if req is not None and prefix is None:
            n = req.num_tokens
            total = n + num_new_tokens
            if n < total and n < req.release_at:
                capacity = req.fast_capacity
                if total > capacity:
                    tpb = self.tokens_per_block
                    tables = req.tables
                    if capacity == len(tables[0]) * tpb:  # else a shared partial block needs a copy
                        missing = (total - capacity + tpb - 1) // tpb
                        pool = self.pool
                        if missing == 1 and pool.num_free_blocks >= len(tables):
                            for table in tables:
                                table.append(pool.allocate_one())
                        elif pool.can_allocate(missing * len(tables)):
                            for table in tables:
                                table.extend(pool.allocate(missing))
                        else:
                            return False
                        req.fast_capacity = capacity = capacity + missing * tpb
                if total <= capacity:
                    req.num_tokens = total
                    if total >= req.hash_at:
                        self._register(req, token_ids, total)
                    return True
        if req is None:
            return self._admit(request_id, num_new_tokens, token_ids, prefix, tuple(extra_keys))
        if prefix is not None:
            raise ConfigError("prefix", prefix.num_tokens, "None for a request that already holds blocks")
        check(num_new_tokens >= 0, "num_new_tokens", num_new_tokens, "an integer >= 0")
        t = self._tables
        need, freeable = t.growth_need(req, num_new_tokens)
        if need > self.pool.num_free_blocks + freeable:
            return False
        # Every group releases before any group grows: then every allocation fits.
        t.release_out_of_window(req)
        t.grow(req, req.num_tokens + num_new_tokens)
        if self.enable_prefix_caching:
            t.register_full_blocks(req, token_ids, req.num_tokens)
        t.refresh(req)
        return True

    def _check_prefix(self, prefix: PrefixHit | None) -> None:
        if prefix is not None and not (isinstance(prefix, PrefixHit) and len(prefix.block_ids) == len(self.retentions)):
            raise ConfigError("prefix", type(prefix).__name__,
                              f"the PrefixHit of this manager's lookup_prefix ({self.num_groups} groups)")

    def _admit(
        self, request_id: RequestId, num_new_tokens: int, token_ids: Sequence[int], prefix: PrefixHit | None,
        extra_keys: tuple,
    ) -> bool:  # fmt: skip
        check(num_new_tokens >= 0, "num_new_tokens", num_new_tokens, "an integer >= 0")
        self._check_prefix(prefix)
        if prefix is not None and extra_keys and extra_keys != prefix.extra_keys:
            raise ConfigError("extra_keys", extra_keys, f"the prefix hit's own extra keys {prefix.extra_keys}")
        if self._tables.admission_need(prefix, num_new_tokens) > self.pool.num_free_blocks:
            return False
        keys = prefix.extra_keys if prefix is not None else extra_keys
        self._requests[request_id] = self._tables.admit(prefix, num_new_tokens, token_ids, keys)
        return True

    # ---- release, fork, copies ------------------------------------------------------------
    def free(self, request_id: RequestId, *, keep_cache: bool = True) -> bool:
        """Return every block of the request (finish, abort, preempt); False if it held none.

        Hashed blocks stay cached for prefix reuse, tail blocks first in line for eviction.
        keep_cache=False forgets the hashes of blocks nobody else holds (their KV may never
        have been written, e.g. the step failed).
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._tables.free(req, keep_cache=keep_cache)
        return True

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        """The child shares every block of the parent in every group (n > 1 samples, beam search,
        a hand-over's pin); the first write to a shared partial block copies it (take_copies)."""
        parent = self._get(parent_id)
        check(child_id not in self._requests, "child_id", child_id, "an id that holds no blocks yet")
        self._requests[child_id] = self._tables.fork(parent)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs made since the last call, every group's. Copy them
        (every cache tensor, every rank) before the step writes any KV: dst now belongs to the
        writer. One flat list: block ids are unique across groups and slot j of every group is
        one tensor, so copying a pair in every tensor is exactly the owning group's copy."""
        return self._tables.take_copies()

    def reset_prefix_cache(self) -> None:
        """Forget every prefix hash (e.g. after weights change)."""
        self.pool.reset_prefix_cache()
        for req in self._requests.values():
            self._tables.forget_hashes(req)

    # ---- KV hand-over ---------------------------------------------------------------------
    def allocate_for_import(
        self,
        request_id: RequestId,
        num_tokens: int,
        block_positions: Sequence[Sequence[int]],
        *,
        extra_keys: Sequence[object] = (),
    ) -> tuple[list[int], ...] | None:
        """Fresh blocks for a request whose KV arrives from another replica; None if the pool
        cannot hold them all (nothing changes). block_positions: per group, the table indices
        that carry data (strictly increasing); other entries are NULL_BLOCK. Returns per group
        the new block ids, one per position. On a failed transfer call
        `free(request_id, keep_cache=False)`."""
        check(request_id not in self._requests, "request_id", request_id, "an id that holds no blocks yet")
        check(num_tokens >= 0, "num_tokens", num_tokens, "an integer >= 0")
        check(len(block_positions) == self.num_groups, "block_positions", len(block_positions),
              f"one list per KV layer group ({self.num_groups})")
        num_table = cdiv(num_tokens, self.tokens_per_block)
        positions = tuple(map(list, block_positions))
        for p in positions:
            # strictly increasing (compared pairwise in C) and its ends in range: every index is
            ok = all(map(lt, p, islice(p, 1, None))) and (not p or (0 <= p[0] and p[-1] < num_table))
            check(ok, "block_positions", p if len(p) < 16 else f"{len(p)} positions",
                  f"strictly increasing table indices in [0, {num_table})")
        made = self._tables.for_import(num_tokens, positions, tuple(extra_keys))
        if made is None:
            return None
        req, blocks = made
        self._requests[request_id] = req
        return blocks

    def hashes_of(self, token_ids: Sequence[int], *, extra_keys: Sequence[object] = ()) -> tuple[list[BlockHash], ...]:
        """Per group, the prefix hashes of the full blocks of `token_ids` with this manager's block
        size (for an import whose sender's blocks had another size: another dcp). Pure."""
        extras = self._tables.extras(tuple(extra_keys))
        return tuple(hash_blocks(token_ids, self.tokens_per_block, extra=e) for e in extras)

    def register_hashes(self, request_id: RequestId, block_hashes: Sequence[Sequence[BlockHash]]) -> None:
        """Adopt known hashes of the request's first full blocks, per group (an import succeeded)."""
        req = self._get(request_id)
        full = req.num_tokens // self.tokens_per_block
        check(len(block_hashes) == self.num_groups, "block_hashes", len(block_hashes),
              f"one list per KV layer group ({self.num_groups})")
        lengths = {len(h) for h in block_hashes}
        check(len(lengths) == 1 and max(lengths) <= full, "block_hashes", sorted(lengths),
              f"as many hashes in every group, at most {full} (full blocks)")
        if self.enable_prefix_caching and not req.num_registered:
            self._tables.adopt_hashes(req, block_hashes)

    # ---- checking -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (pool, tables, ref counts)."""
        self.pool.check_invariants()
        held: Counter[int] = Counter()
        tpb = self.tokens_per_block
        for rid, req in self._requests.items():
            if len(req.tables) != self.num_groups:
                raise AssertionError(f"request {rid!r}: {len(req.tables)} tables for {self.num_groups} groups")
            blocks = []
            for g, table in enumerate(req.tables):
                if len(table) != cdiv(req.num_tokens, tpb):
                    raise AssertionError(f"request {rid!r} group {g}: {len(table)} blocks for {req.num_tokens} tokens")
                blocks += [b for b in table if b != NULL_BLOCK]
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"request {rid!r} holds a block twice: {req.tables}")
            held.update(blocks)
        ref = self.pool.ref_counts
        for block in range(1, self.pool.num_blocks):
            if ref[block] != held[block]:
                raise AssertionError(f"block {block}: ref count {ref[block]} but {held[block]} table entries")

    def _get(self, request_id: RequestId) -> RequestBlocks:
        req = self._requests.get(request_id)
        if req is None:
            raise ConfigError("request_id", request_id, "an id that holds blocks in this KVCacheManager")
        return req
