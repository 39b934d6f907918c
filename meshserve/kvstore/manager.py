"""Per-request block tables over a BlockPool: the scheduler's view of the KV cache (no torch).

Usage, semantics and design choices: docs/kvstore.md. In short:
- counts are in logical tokens: with DCP of size d a logical block covers block_size * d tokens;
- a table keeps one entry per logical block; blocks released by a sliding window become
  NULL_BLOCK (0), which attention never reads, so a position's table index never changes;
- allocate_slots is all or nothing; it assumes earlier slots are computed by the time the new
  ones are (synchronous scheduling) and hashes blocks filled by the scheduled tokens;
- block_table returns the manager's own list: read it, never modify it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from meshserve.errors import ConfigError, MeshserveError, check
from meshserve.kvstore.block_hash import BlockHash, encode_extra_keys, hash_block
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.prefix import PrefixHit, find_cached_prefix
from meshserve.kvstore.request_blocks import NEVER, KVCacheStats, RequestBlocks
from meshserve.kvstore.retention import RetentionPolicy

RequestId = Hashable


class KVCacheManager:
    """Block tables of running requests, prefix reuse, window release, copy-on-write forks.

    num_blocks:  physical blocks per layer cache, including the null block 0
    block_size:  tokens per physical block on one rank
    dcp_size:    decode-context-parallel ranks; a logical block covers block_size * dcp_size tokens
    retention:   which positions must stay cached (RetentionPolicy.from_specs(layer_specs))
    enable_prefix_caching: hash full blocks and reuse them across requests
    pool, hash_salt: a BlockPool shared with the other layer groups of a hybrid model, and bytes
                 that keep this group's prefix hashes apart from theirs (kvstore/hybrid.py)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dcp_size: int = 1,
        retention: RetentionPolicy | None = None,
        enable_prefix_caching: bool = True,
        pool: BlockPool | None = None,
        hash_salt: bytes = b"",
    ) -> None:
        check(block_size >= 1, "block_size", block_size, "an integer >= 1")
        check(dcp_size >= 1, "dcp_size", dcp_size, "an integer >= 1")
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self._salt = hash_salt
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.tokens_per_block = block_size * dcp_size
        self.retention = retention if retention is not None else RetentionPolicy()
        self.retentions = (self.retention,)  # per layer group, as HybridKVCacheManager
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = KVCacheStats()
        self._requests: dict[RequestId, RequestBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self._window = self.retention.sliding_window
        self._sink_blocks = self.retention.num_sink_blocks(self.tokens_per_block)

    # ---- capacity -------------------------------------------------------------------------
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
        """Tokens the whole cache holds (× dcp_size: each rank keeps 1/dcp of every block)."""
        return self.pool.num_total_blocks * self.tokens_per_block

    @property
    def free_capacity_tokens(self) -> int:
        return self.pool.num_free_blocks * self.tokens_per_block

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    num_groups = 1  # one block table per request (HybridKVCacheManager: one per layer group)

    # ---- per-request reads ----------------------------------------------------------------
    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: RequestId) -> list[int]:
        """Physical block ids by logical block index (NULL_BLOCK where released). Read-only."""
        return self._get(request_id).table

    def block_tables(self, request_id: RequestId) -> tuple[list[int], ...]:
        """One table per layer group (here one). Read-only."""
        return (self._get(request_id).table,)

    def num_tokens(self, request_id: RequestId) -> int:
        """Slots allocated to the request (tokens computed or being computed)."""
        return self._get(request_id).num_tokens

    def block_hashes(self, request_id: RequestId) -> list[BlockHash]:
        """Hashes of the request's full blocks whose hash was registered (in position order)."""
        req = self._get(request_id)
        return req.hashes[: req.num_registered]

    def extra_keys(self, request_id: RequestId) -> tuple:
        return self._get(request_id).extra_keys

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    # ---- prefix lookup --------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], *, extra_keys: Sequence[object] = ()) -> PrefixHit:
        """The longest cached prefix of `token_ids` that a new request can start from. Pure.

        Full attention needs every block of the prefix cached. With a sliding window only the
        sink blocks and the blocks the first query's window reaches must be cached; the others
        appear as NULL_BLOCK in `block_ids`.
        """
        if not self.enable_prefix_caching:
            return PrefixHit(0, (), (), tuple(extra_keys))
        return find_cached_prefix(
            self.pool, self.retention, self.tokens_per_block, token_ids, tuple(extra_keys), self._salt
        )

    # ---- allocation -----------------------------------------------------------------------
    def can_allocate(self, request_id: RequestId, num_new_tokens: int, *, prefix: PrefixHit | None = None) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed. Pure."""
        return self.blocks_needed(request_id, num_new_tokens, prefix=prefix) <= self.pool.num_free_blocks

    def blocks_needed(self, request_id: RequestId, num_new_tokens: int, *, prefix: PrefixHit | None = None) -> int:
        """Free blocks `allocate_slots` would consume, net of what its window release returns
        (negative when it returns more). Pure."""
        check(num_new_tokens >= 0, "num_new_tokens", num_new_tokens, "an integer >= 0")
        req = self._requests.get(request_id)
        if req is None:
            return self._admission_need(num_new_tokens, prefix)
        need, freeable = self._growth_need(req, num_new_tokens)
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
        """Give the request slots for `num_new_tokens` more tokens; False (and no change) if the
        pool cannot. A new request starts from `prefix` (from lookup_prefix on the same token
        ids), or from nothing. token_ids: the request's tokens so far, including the ones being
        scheduled (used to hash blocks as they fill; may be shorter, e.g. speculative slots).
        extra_keys: for a new request without `prefix` (a prefix carries its own).
        """
        req = self._requests.get(request_id)
        # Fast path, every decode step and most chunks: no block leaves the window and the last
        # block is not shared with a fork; new blocks are appended. Limits come from _refresh.
        if req is not None and prefix is None:
            n = req.num_tokens
            total = n + num_new_tokens
            if n < total and n < req.release_at:
                capacity = req.fast_capacity
                if total > capacity:
                    tpb = self.tokens_per_block
                    table = req.table
                    if capacity == len(table) * tpb:  # else the shared partial block needs a copy
                        missing = (total - capacity + tpb - 1) // tpb
                        pool = self.pool
                        if missing == 1 and pool.num_free_blocks:
                            table.append(pool.allocate_one())
                        elif pool.can_allocate(missing):
                            table.extend(pool.allocate(missing))
                        else:
                            return False
                        req.fast_capacity = capacity = capacity + missing * tpb
                if total <= capacity:
                    req.num_tokens = total
                    if total >= req.hash_at:
                        self._register_full_blocks(req, token_ids, total)
                    return True
        if req is None:
            return self._admit(request_id, num_new_tokens, token_ids, prefix, tuple(extra_keys))
        if prefix is not None:
            raise ConfigError("prefix", prefix.num_tokens, "None for a request that already holds blocks")
        if num_new_tokens < 0:
            raise ConfigError("num_new_tokens", num_new_tokens, "an integer >= 0")
        need, freeable = self._growth_need(req, num_new_tokens)
        if need > self.pool.num_free_blocks + freeable:
            return False
        self._release_out_of_window(req)
        self._grow(req, req.num_tokens + num_new_tokens)
        if self.enable_prefix_caching:
            self._register_full_blocks(req, token_ids, req.num_tokens)
        self._refresh(req)
        return True

    def append_slots(
        self, request_ids: Sequence[RequestId], token_ids: Sequence[Sequence[int]], num_new_tokens: int = 1
    ) -> int:
        """`allocate_slots(id, num_new_tokens, tokens)` for running requests in order, stopping at
        the first that cannot get its slots (it is left unchanged). Returns how many succeeded:
        the scheduler preempts and calls again from there. The batch form of a decode step: one
        call instead of one per request."""
        requests = self._requests
        done = 0
        for rid, tokens in zip(request_ids, token_ids):
            req = requests.get(rid)
            if req is not None and num_new_tokens > 0:
                n = req.num_tokens
                total = n + num_new_tokens
                if total <= req.fast_capacity and n < req.release_at:
                    req.num_tokens = total
                    if total >= req.hash_at:
                        self._register_full_blocks(req, tokens, total)
                    done += 1
                    continue
            if not self.allocate_slots(rid, num_new_tokens, tokens):
                return done
            done += 1
        return done

    def _refresh(self, req: RequestBlocks) -> None:
        """Recompute the fast-path limits of a request after anything about it changed."""
        tpb = self.tokens_per_block
        n, table = req.num_tokens, req.table
        if n % tpb and self.pool.ref_counts[table[n // tpb]] > 1:
            req.fast_capacity = n  # the partial last block is shared: its next write copies it
        else:
            req.fast_capacity = len(table) * tpb
        if self._window is not None:
            req.release_at = (req.first_held + 1) * tpb + self._window - 1
        req.hash_at = (req.num_registered + 1) * tpb if self.enable_prefix_caching else NEVER

    def _admission_need(self, num_new_tokens: int, prefix: PrefixHit | None) -> int:
        """Blocks a new request takes from the free count (new ones plus revived cached hits)."""
        tpb = self.tokens_per_block
        if prefix is None:
            return -(-num_new_tokens // tpb)
        self._check_fresh(prefix)
        ref = self.pool.ref_counts
        revived = sum(1 for b in prefix.block_ids if b != NULL_BLOCK and ref[b] == 0)
        return -(-(prefix.num_tokens + num_new_tokens) // tpb) - len(prefix.block_ids) + revived

    def _check_fresh(self, prefix: PrefixHit) -> None:
        for i, block in enumerate(prefix.block_ids):
            if block != NULL_BLOCK and self.pool.block_hash(block) != prefix.block_hashes[i]:
                raise MeshserveError(
                    f"stale PrefixHit: block {block} (index {i}) was evicted since lookup_prefix; "
                    "look up again right before allocating"
                )

    def _admit(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int],
        prefix: PrefixHit | None,
        extra_keys: tuple,
    ) -> bool:
        check(num_new_tokens >= 0, "num_new_tokens", num_new_tokens, "an integer >= 0")
        if prefix is not None and extra_keys and tuple(extra_keys) != prefix.extra_keys:
            raise ConfigError("extra_keys", extra_keys, f"the prefix hit's own extra keys {prefix.extra_keys}")
        keys = prefix.extra_keys if prefix is not None else extra_keys
        extra = encode_extra_keys(keys) + self._salt
        if self._admission_need(num_new_tokens, prefix) > self.pool.num_free_blocks:
            return False
        tpb = self.tokens_per_block
        if prefix is None:
            table: list[int] = []
            hashes: list[BlockHash] = []
            num_cached = 0
        else:
            table = list(prefix.block_ids)
            hashes = list(prefix.block_hashes)
            num_cached = prefix.num_tokens
            self.pool.touch(b for b in table if b != NULL_BLOCK)
        first_held = max(self._sink_blocks, self.retention.first_needed_block(num_cached, tpb))
        req = RequestBlocks(table, num_cached, hashes, keys, extra, first_held)
        req.num_registered = len(table)  # hit blocks are hashed already
        self._grow(req, num_cached + num_new_tokens)
        self._requests[request_id] = req
        if self.enable_prefix_caching:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
            self._register_full_blocks(req, token_ids, req.num_tokens)
        self._refresh(req)
        return True

    def _growth_need(self, req: RequestBlocks, num_new_tokens: int) -> tuple[int, int]:
        """(blocks to take, blocks the window release would give back) for a running request."""
        tpb = self.tokens_per_block
        n = req.num_tokens
        table = req.table
        ref = self.pool.ref_counts
        need = -(-(n + num_new_tokens) // tpb) - len(table)
        if num_new_tokens and n % tpb and ref[table[n // tpb]] > 1:
            need += 1  # the shared partial block is copied before it is written
        freeable = 0
        if self._window is not None:
            lo, hi = self._release_range(req)
            freeable = sum(1 for b in table[lo:hi] if b != NULL_BLOCK and ref[b] == 1)
        return need, freeable

    def _release_range(self, req: RequestBlocks) -> tuple[int, int]:
        lo = max(req.first_held, self._sink_blocks)
        hi = self.retention.first_needed_block(req.num_tokens, self.tokens_per_block)
        return lo, max(lo, hi)

    def _release_out_of_window(self, req: RequestBlocks) -> None:
        if self._window is None:
            return
        lo, hi = self._release_range(req)
        table = req.table
        released = [b for b in table[lo:hi] if b != NULL_BLOCK]
        for i in range(lo, hi):
            table[i] = NULL_BLOCK
        req.first_held = hi
        if released:
            self.pool.free(released)
            self.stats.window_released_blocks += len(released)

    def _grow(self, req: RequestBlocks, total: int) -> None:
        """Copy a shared partial last block if it will be written, then append new blocks."""
        tpb = self.tokens_per_block
        n, table = req.num_tokens, req.table
        if total > n and n % tpb and self.pool.ref_counts[table[n // tpb]] > 1:
            old = table[n // tpb]
            (new,) = self.pool.allocate(1)
            self._copies.append((old, new))
            self.pool.free([old])
            table[n // tpb] = new
            self.stats.cow_copies += 1
        missing = -(-total // tpb) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        req.num_tokens = total

    def _register_full_blocks(self, req: RequestBlocks, token_ids: Sequence[int], upto: int) -> None:
        """Offer the hashes of blocks filled up to `upto` tokens (as far as token_ids go)."""
        tpb = self.tokens_per_block
        full = min(upto, len(token_ids)) // tpb
        hashes, table, cache_block = req.hashes, req.table, self.pool.cache_block
        for i in range(req.num_registered, full):
            if i == len(hashes):
                parent = hashes[i - 1] if i else None
                hashes.append(hash_block(parent, token_ids[i * tpb : (i + 1) * tpb], req.extra))
            if table[i] != NULL_BLOCK:
                cache_block(table[i], hashes[i])
        if full > req.num_registered:
            req.num_registered = full
            req.hash_at = (full + 1) * tpb

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
        held = [b for b in reversed(req.table) if b != NULL_BLOCK]
        if not keep_cache:
            for b in held:
                if self.pool.ref_counts[b] == 1:
                    self.pool.uncache(b)
        self.pool.free(held)
        return True

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        """The child shares every block of the parent (n > 1 samples, beam search); the first
        write to a shared partial block copies it (see take_copies)."""
        parent = self._get(parent_id)
        check(child_id not in self._requests, "child_id", child_id, "an id that holds no blocks yet")
        child = RequestBlocks(
            list(parent.table),
            parent.num_tokens,
            parent.hashes[: parent.num_registered],  # hashes past that were for the parent's tokens
            parent.extra_keys,
            parent.extra,
            parent.first_held,
        )
        child.num_registered = parent.num_registered
        self.pool.touch(b for b in child.table if b != NULL_BLOCK)
        self._requests[child_id] = child
        self._refresh(parent)
        self._refresh(child)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs made since the last call. Copy them (every layer,
        every rank) before the step writes any KV: dst now belongs to the writer."""
        out, self._copies = self._copies, []
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every prefix hash (e.g. after weights change)."""
        self.pool.reset_prefix_cache()
        for req in self._requests.values():
            req.hashes.clear()
            req.num_registered = 0
            self._refresh(req)

    # ---- KV hand-over ---------------------------------------------------------------------
    def allocate_for_import(
        self,
        request_id: RequestId,
        num_tokens: int,
        block_positions: Sequence[int],
        *,
        extra_keys: Sequence[object] = (),
    ) -> list[int] | None:
        """Fresh blocks for a request whose KV arrives from another replica; None if the pool
        cannot (nothing changes). block_positions: table indices that carry data (strictly
        increasing); other entries are NULL_BLOCK. Returns the new block ids, one per position.
        On a failed transfer call `free(request_id, keep_cache=False)`."""
        check(request_id not in self._requests, "request_id", request_id, "an id that holds no blocks yet")
        check(num_tokens >= 0, "num_tokens", num_tokens, "an integer >= 0")
        num_table = -(-num_tokens // self.tokens_per_block)
        positions = list(block_positions)
        check(
            all(0 <= p < num_table for p in positions) and all(a < b for a, b in zip(positions, positions[1:])),
            "block_positions",
            positions if len(positions) < 16 else f"{len(positions)} positions",
            f"strictly increasing table indices in [0, {num_table})",
        )
        if not self.pool.can_allocate(len(positions)):
            return None
        blocks = self.pool.allocate(len(positions))
        table = [NULL_BLOCK] * num_table
        for p, b in zip(positions, blocks):
            table[p] = b
        keys = tuple(extra_keys)
        req = RequestBlocks(table, num_tokens, [], keys, encode_extra_keys(keys) + self._salt, self._sink_blocks)
        self._requests[request_id] = req
        self._refresh(req)
        return blocks

    def register_hashes(self, request_id: RequestId, block_hashes: Sequence[BlockHash]) -> None:
        """Adopt known hashes of the request's first full blocks (after an import succeeded)."""
        req = self._get(request_id)
        full = req.num_tokens // self.tokens_per_block
        check(len(block_hashes) <= full, "block_hashes", len(block_hashes), f"at most {full} (full blocks)")
        if not self.enable_prefix_caching or req.num_registered:
            return
        req.hashes = list(block_hashes)
        for i, h in enumerate(req.hashes):
            if req.table[i] != NULL_BLOCK:
                self.pool.cache_block(req.table[i], h)
        req.num_registered = len(req.hashes)
        self._refresh(req)

    # ---- checking -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (pool, tables, ref counts)."""
        self.pool.check_invariants()
        held = self.held_blocks()
        ref = self.pool.ref_counts
        for block in range(1, self.pool.num_blocks):
            if ref[block] != held[block]:
                raise AssertionError(f"block {block}: ref count {ref[block]} but {held[block]} table entries")

    def held_blocks(self) -> Counter[int]:
        """Table entries naming each block; AssertionError if a table is malformed."""
        held: Counter[int] = Counter()
        for rid, req in self._requests.items():
            if len(req.table) != -(-req.num_tokens // self.tokens_per_block):
                raise AssertionError(f"request {rid!r}: {len(req.table)} blocks for {req.num_tokens} tokens")
            blocks = [b for b in req.table if b != NULL_BLOCK]
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"request {rid!r} holds a block twice: {req.table}")
            held.update(blocks)
        return held

    def _get(self, request_id: RequestId) -> RequestBlocks:
        req = self._requests.get(request_id)
        if req is None:
            raise ConfigError("request_id", request_id, "an id that holds blocks in this KVCacheManager")
        return req
