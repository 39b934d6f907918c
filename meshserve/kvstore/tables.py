"""How a request's block tables change: admission, growth, window release, copy-on-write,
hashing, forks and imports, for every layer group at once (plain Python, no torch).

`BlockTables` holds what is fixed per layer group (retention, hash salt) and the shared
BlockPool; it changes `RequestBlocks` records but keeps no record itself (KVCacheManager does,
with the request ids, the per-request checks and the fast path). Block ids are unique across
groups (one pool), so counting a need is summing over groups, and every table operation is done
for all groups before the record is handed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress

import numpy as np

from meshserve.core.arith import cdiv
from meshserve.errors import MeshserveError
from meshserve.kvstore.block_hash import BlockHash, encode_extra_keys, group_salt, hash_block
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.prefix import PrefixHit
from meshserve.kvstore.request_blocks import NEVER, KVCacheStats, RequestBlocks
from meshserve.kvstore.retention import RetentionPolicy


class BlockTables:
    def __init__(
        self, pool: BlockPool, retentions: Sequence[RetentionPolicy], tokens_per_block: int, enable_prefix_caching: bool
    ) -> None:
        self.pool = pool
        self.retentions = tuple(retentions)
        self.tpb = tokens_per_block
        self.caching = enable_prefix_caching
        self.salts = tuple(group_salt(g) for g in range(len(self.retentions)))
        self.sink_blocks = tuple(r.num_sink_blocks(tokens_per_block) for r in self.retentions)
        self.windowed = tuple(g for g, r in enumerate(self.retentions) if r.sliding_window is not None)
        self.copies: list[tuple[int, int]] = []
        self.stats = KVCacheStats()

    # ---- new records ----------------------------------------------------------------------
    def extras(self, extra_keys: tuple) -> tuple[bytes, ...]:
        """Per group, the hash input of a request's extra keys (its salt appended)."""
        if not extra_keys:
            return self.salts
        extra = encode_extra_keys(extra_keys)
        return tuple([extra + salt for salt in self.salts])

    def admission_need(self, prefix: PrefixHit | None, num_new_tokens: int) -> int:
        """Blocks a new request takes from the free count: new ones plus revived cached hits."""
        tpb = self.tpb
        if prefix is None:
            return len(self.retentions) * cdiv(num_new_tokens, tpb)
        self.check_fresh(prefix)
        ref = self.pool.ref_counts
        total = cdiv(prefix.num_tokens + num_new_tokens, tpb)
        need = 0
        for ids in prefix.block_ids:
            need += total - len(ids) + sum(1 for b in ids if b != NULL_BLOCK and ref[b] == 0)
        return need

    def check_fresh(self, prefix: PrefixHit) -> None:
        for ids, hashes in zip(prefix.block_ids, prefix.block_hashes):
            for i, block in enumerate(ids):
                if block != NULL_BLOCK and self.pool.block_hash(block) != hashes[i]:
                    raise MeshserveError(
                        f"stale PrefixHit: block {block} (index {i}) was evicted since lookup_prefix; "
                        "look up again right before allocating"
                    )

    def admit(
        self, prefix: PrefixHit | None, num_new_tokens: int, token_ids: Sequence[int], extra_keys: tuple
    ) -> RequestBlocks:
        """A new request's record (the caller checked admission_need against the free count)."""
        if prefix is None:
            tables: tuple[list[int], ...] = tuple([[] for _ in self.retentions])
            hashes: tuple[list[BlockHash], ...] = tuple([[] for _ in self.retentions])
            num_cached = 0
        else:
            tables = tuple(map(list, prefix.block_ids))
            hashes = tuple(map(list, prefix.block_hashes))
            num_cached = prefix.num_tokens
            # Every group's hit is referenced before any group allocates: no group's new blocks
            # can evict another group's hit.
            self.pool.touch([b for table in tables for b in table if b != NULL_BLOCK])
        first_held = list(self.sink_blocks)
        for g in self.windowed:
            first_held[g] = max(first_held[g], self.retentions[g].first_needed_block(num_cached, self.tpb))
        req = RequestBlocks(tables, num_cached, hashes, extra_keys, self.extras(extra_keys), first_held)
        req.num_registered = len(tables[0])  # hit blocks are hashed already
        self.grow(req, num_cached + num_new_tokens)
        if self.caching:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
            self.register_full_blocks(req, token_ids, req.num_tokens)
        self.refresh(req)
        return req

    def fork(self, parent: RequestBlocks) -> RequestBlocks:
        """A child sharing every block of the parent (references taken)."""
        n = parent.num_registered
        child = RequestBlocks(
            tuple(map(list, parent.tables)),
            parent.num_tokens,
            tuple([h[:n] for h in parent.hashes]),  # hashes past that were for the parent's tokens
            parent.extra_keys,
            parent.extras,
            list(parent.first_held),
        )
        child.num_registered = n
        self.pool.touch(list(filter(None, chain.from_iterable(child.tables))))  # NULL_BLOCK is 0
        self.refresh(parent)
        self.refresh(child)
        return child

    def for_import(self, num_tokens: int, block_positions: Sequence[Sequence[int]], extra_keys: tuple
                   ) -> tuple[RequestBlocks, tuple[list[int], ...]] | None:  # fmt: skip
        """Fresh blocks at the given table positions of each group (one allocation, so they are
        ascending runs) and the new blocks per group; None if the pool cannot hold them all.
        No Python per block: a group whose positions are its whole table takes a slice of the
        allocation, others a scatter through an array."""
        count = sum(len(p) for p in block_positions)
        if not self.pool.can_allocate(count):
            return None
        fresh = self.pool.allocate(count)
        num_table = cdiv(num_tokens, self.tpb)
        tables, blocks, at = [], [], 0
        for positions in block_positions:
            mine = fresh[at : at + len(positions)]
            at += len(positions)
            blocks.append(mine)
            if len(positions) == num_table:  # strictly increasing in [0, num_table): every index
                tables.append(list(mine))
            else:
                table = np.zeros(num_table, np.int64)  # NULL_BLOCK where the sender released blocks
                table[np.asarray(positions, np.int64)] = mine
                tables.append(table.tolist())
        req = RequestBlocks(tuple(tables), num_tokens, tuple([[] for _ in tables]), extra_keys,
                            self.extras(extra_keys), list(self.sink_blocks))  # fmt: skip
        self.refresh(req)
        return req, tuple(blocks)

    # ---- running records ------------------------------------------------------------------
    def growth_need(self, req: RequestBlocks, num_new_tokens: int) -> tuple[int, int]:
        """(blocks to take, blocks the window release would give back) for a running request."""
        tpb = self.tpb
        n, tables = req.num_tokens, req.tables
        ref = self.pool.ref_counts
        need = (cdiv(n + num_new_tokens, tpb) - len(tables[0])) * len(tables)
        if num_new_tokens and n % tpb:
            need += sum(1 for t in tables if ref[t[n // tpb]] > 1)  # shared partial blocks are copied
        freeable = 0
        for g in self.windowed:
            lo, hi = self.release_range(req, g)
            freeable += sum(1 for b in tables[g][lo:hi] if b != NULL_BLOCK and ref[b] == 1)
        return need, freeable

    def release_range(self, req: RequestBlocks, group: int) -> tuple[int, int]:
        lo = max(req.first_held[group], self.sink_blocks[group])
        hi = self.retentions[group].first_needed_block(req.num_tokens, self.tpb)
        return lo, max(lo, hi)

    def release_out_of_window(self, req: RequestBlocks) -> None:
        for g in self.windowed:
            lo, hi = self.release_range(req, g)
            table = req.tables[g]
            released = [b for b in table[lo:hi] if b != NULL_BLOCK]
            for i in range(lo, hi):
                table[i] = NULL_BLOCK
            req.first_held[g] = hi
            if released:
                self.pool.free(released)
                self.stats.window_released_blocks += len(released)

    def grow(self, req: RequestBlocks, total: int) -> None:
        """Copy shared partial last blocks that will be written, then append new blocks."""
        tpb, pool = self.tpb, self.pool
        n, tables = req.num_tokens, req.tables
        if total > n and n % tpb:
            i = n // tpb
            for table in tables:
                old = table[i]
                if pool.ref_counts[old] > 1:
                    new = pool.allocate_one()
                    self.copies.append((old, new))
                    pool.free([old])
                    table[i] = new
                    self.stats.cow_copies += 1
        missing = cdiv(total, tpb) - len(tables[0])
        if missing > 0:
            for table in tables:
                table.extend(pool.allocate(missing))
        req.num_tokens = total

    def register_full_blocks(self, req: RequestBlocks, token_ids: Sequence[int], upto: int) -> None:
        """Offer the hashes of blocks filled up to `upto` tokens (as far as token_ids go)."""
        tpb = self.tpb
        full = min(upto, len(token_ids)) // tpb
        start = req.num_registered
        if full <= start:
            return
        cache_block = self.pool.cache_block
        for table, hashes, extra in req.chains:
            known = len(hashes)
            parent = hashes[start - 1] if start else None
            for i in range(start, full):
                if i < known:
                    parent = hashes[i]
                else:
                    parent = hash_block(parent, token_ids[i * tpb : (i + 1) * tpb], extra)
                    hashes.append(parent)
                block = table[i]
                if block != NULL_BLOCK:
                    cache_block(block, parent)
        req.num_registered = full
        req.hash_at = (full + 1) * tpb

    def adopt_hashes(self, req: RequestBlocks, block_hashes: Sequence[Sequence[BlockHash]]) -> None:
        """Register known hashes of the first full blocks of every group (an import succeeded)."""
        for table, hashes, given in zip(req.tables, req.hashes, block_hashes):
            hashes[:] = given
            held = table[: len(hashes)]  # NULL_BLOCK (0) where released: those take no hash
            self.pool.cache_blocks(compress(held, held), compress(hashes, held))
        req.num_registered = len(req.hashes[0])
        self.refresh(req)

    def forget_hashes(self, req: RequestBlocks) -> None:
        """After the pool forgot every hash: the record's hashes are gone too."""
        for hashes in req.hashes:
            hashes.clear()
        req.num_registered = 0
        self.refresh(req)

    def refresh(self, req: RequestBlocks) -> None:
        """Recompute the fast-path limits of a record after anything about it changed."""
        tpb = self.tpb
        n, tables = req.num_tokens, req.tables
        capacity = len(tables[0]) * tpb
        if n % tpb:
            ref, last = self.pool.ref_counts, n // tpb
            for table in tables:
                if ref[table[last]] > 1:
                    capacity = n  # a shared partial last block: its next write copies it
                    break
        req.fast_capacity = capacity
        release_at = NEVER
        for g in self.windowed:
            release_at = min(release_at, (req.first_held[g] + 1) * tpb + self.retentions[g].sliding_window - 1)
        req.release_at = release_at
        req.hash_at = (req.num_registered + 1) * tpb if self.caching else NEVER

    def free(self, req: RequestBlocks, *, keep_cache: bool) -> None:
        """Drop the record's references: groups last to first, each table tail first (so tails
        are evicted before the heads that more requests share)."""
        held = list(filter(None, chain.from_iterable(map(reversed, reversed(req.tables)))))  # NULL_BLOCK is 0
        if not keep_cache:
            for b in held:
                if self.pool.ref_counts[b] == 1:
                    self.pool.uncache(b)
        self.pool.free(held)

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.copies = self.copies, []
        return out
