"""What the scheduler asks of the KV store, per request id, in five verbs.

  lookup_prefix(rid, tokens) -> cached   tokens of the prompt whose K/V the prefix cache holds
                                         (whole blocks, always fewer than len(tokens)); the
                                         blocks are kept for the following `allocate`
  allocate(rid, tokens, computed, new) -> bool
                                         make room for tokens [0, computed + new); False (and no
                                         change) when the pool cannot
  computed(rid, tokens, computed)        K/V of tokens [0, computed) is now written: full
                                         blocks may enter the prefix cache
  free(rid)                              give every block back (cached ones stay reusable)
  block_ids(rid) -> list[int]            the request's block table
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KVBlocks(Protocol):
    def lookup_prefix(self, request_id: str, token_ids: Sequence[int]) -> int: ...

    def allocate(self, request_id: str, token_ids: Sequence[int], num_computed: int, num_new: int) -> bool: ...

    def computed(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None: ...

    def free(self, request_id: str) -> None: ...

    def block_ids(self, request_id: str) -> list[int]: ...

    @property
    def num_free_blocks(self) -> int: ...


def make_kv_blocks(num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> KVBlocks:
    """The KV store's block manager for one replica, seen through KVBlocks."""
    from meshserve.kvstore import KVCacheManager  # noqa: F401  (lands with the kvstore branch)

    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
