"""Per-request block state kept by KVCacheManager, and its counters (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.kvstore.block_hash import BlockHash


@dataclass
class KVCacheStats:
    """Monotonic counters (tokens unless named blocks), over every layer group."""

    prefix_query_tokens: int = 0  # prompt tokens of admitted requests (with prefix caching on)
    prefix_hit_tokens: int = 0  # of which were already cached (a hit has one length in every group)
    cow_copies: int = 0  # blocks copied on write after a fork
    window_released_blocks: int = 0  # blocks returned because they left the window

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


NEVER = 1 << 62


class RequestBlocks:
    """One request's blocks in every KV layer group. Every group's table has one entry per
    logical block (ceil(num_tokens / tokens_per_block)), so the groups share num_tokens, the
    number of registered hashes and the fast-path limits; what differs per group (tables, hash
    chains, salts, window release) is a tuple or list with one entry per group."""

    __slots__ = (
        "tables",
        "num_tokens",
        "hashes",
        "num_registered",
        "extra_keys",
        "extras",
        "chains",
        "first_held",
        "fast_capacity",
        "release_at",
        "hash_at",
    )

    def __init__(
        self,
        tables: tuple[list[int], ...],
        num_tokens: int,
        hashes: tuple[list[BlockHash], ...],
        extra_keys: tuple,
        extras: tuple[bytes, ...],
        first_held: list[int],
    ) -> None:
        self.tables = tables  # per group: physical block per logical block (NULL_BLOCK once released)
        self.num_tokens = num_tokens  # slots allocated (computed or being computed)
        self.hashes = hashes  # per group: chained hashes of full blocks, known so far (may run ahead)
        self.num_registered = 0  # blocks [0, this) of every group have had their hash offered to the pool
        self.extra_keys = extra_keys
        self.extras = extras  # per group: encoded extra keys + the group's salt (hash input)
        # Per group (table, hashes, extra), for the hashing loop (these lists change in place only).
        self.chains = tuple(zip(tables, hashes, extras))
        self.first_held = first_held  # per group: non-sink blocks below this index were released
        # Limits of the fast path, the tightest over the groups, kept by BlockTables.refresh:
        self.fast_capacity = 0  # grow to this many tokens without touching the pool
        self.release_at = NEVER  # at this num_tokens a block of some group leaves its window
        self.hash_at = NEVER  # at this many tokens the next full block is due for hashing
