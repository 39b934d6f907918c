"""Per-request block state kept by KVCacheManager, and its counters (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.kvstore.block_hash import BlockHash


@dataclass
class KVCacheStats:
    """Monotonic counters (tokens unless named blocks)."""

    prefix_query_tokens: int = 0  # prompt tokens of admitted requests (with prefix caching on)
    prefix_hit_tokens: int = 0  # of which were already cached
    cow_copies: int = 0  # blocks copied on write after a fork
    window_released_blocks: int = 0  # blocks returned because they left the window

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


NEVER = 1 << 62


class RequestBlocks:
    __slots__ = (
        "table",
        "num_tokens",
        "hashes",
        "num_registered",
        "extra",
        "extra_keys",
        "first_held",
        "fast_capacity",
        "release_at",
        "hash_at",
    )

    def __init__(
        self,
        table: list[int],
        num_tokens: int,
        hashes: list[BlockHash],
        extra_keys: tuple,
        extra: bytes,
        first_held: int,
    ) -> None:
        self.table = table  # physical block per logical block (NULL_BLOCK once released)
        self.num_tokens = num_tokens  # slots allocated (computed or being computed)
        self.hashes = hashes  # chained hashes of full blocks, known so far (may run ahead)
        self.num_registered = 0  # blocks [0, this) have had their hash offered to the pool
        self.extra_keys = extra_keys
        self.extra = extra
        self.first_held = first_held  # non-sink blocks below this index were released
        # Limits of the fast path, kept by KVCacheManager._refresh (see allocate_slots):
        self.fast_capacity = 0  # grow to this many tokens without touching the pool
        self.release_at = NEVER  # at this num_tokens a block leaves the window
        self.hash_at = NEVER  # at this many tokens the next full block is due for hashing
