"""Prefix lookup: the longest cached prefix of a token sequence (plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.kvstore.block_hash import BlockHash, encode_extra_keys, hash_block
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.retention import RetentionPolicy


@dataclass(frozen=True)
class PrefixHit:
    """Result of `lookup_prefix`: what of a token sequence is already cached.

    num_tokens:   cached tokens (a multiple of tokens_per_block, at most len(token_ids) - 1: the
                  last token is always computed, to produce logits)
    block_ids:    the table entries covering them (NULL_BLOCK where a sliding window does not
                  need the block, so it was not required to be cached)
    block_hashes: chained hashes of the full blocks of token_ids computed during the lookup
                  (at least one per entry of block_ids); allocate_slots reuses them
    extra_keys:   the extra keys the hashes were computed with
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    extra_keys: tuple = ()


def find_cached_prefix(
    pool: BlockPool,
    retention: RetentionPolicy,
    tokens_per_block: int,
    token_ids: Sequence[int],
    extra_keys: tuple,
    salt: bytes = b"",
) -> PrefixHit:
    """What KVCacheManager.lookup_prefix returns (with prefix caching on). salt: the layer
    group's hash salt (appended to the encoded extra keys)."""
    extra = encode_extra_keys(extra_keys) + salt
    tpb = tokens_per_block
    max_blocks = max(0, len(token_ids) - 1) // tpb  # the last token is always computed
    if max_blocks == 0:
        return PrefixHit(0, (), (), extra_keys)
    windowed = retention.sliding_window is not None
    hashes: list[BlockHash] = []
    found: list[int | None] = []
    parent = None
    for i in range(max_blocks):
        parent = hash_block(parent, token_ids[i * tpb : (i + 1) * tpb], extra)
        hashes.append(parent)
        found.append(pool.lookup(parent))
        if found[-1] is None and not windowed:
            break  # full attention: the prefix ends at the first miss
    if not windowed:
        hit = len(found) - (found[-1] is None)
        return PrefixHit(hit * tpb, tuple(found[:hit]), tuple(hashes), extra_keys)  # type: ignore[arg-type]
    return _windowed_hit(retention, tpb, found, hashes, extra_keys)


def _windowed_hit(
    retention: RetentionPolicy, tpb: int, found: list[int | None], hashes: list[BlockHash], keys: tuple
) -> PrefixHit:
    """Longest k such that the sink blocks and the window of a first query at k * tpb are cached."""
    sink = retention.num_sink_blocks(tpb)
    leading = next((i for i, b in enumerate(found) if b is None), len(found))  # cached from 0
    run_end = [0] * len(found)  # length of the cached run ending at i
    for i, b in enumerate(found):
        run_end[i] = 0 if b is None else (run_end[i - 1] + 1 if i else 1)
    for k in range(len(found), 0, -1):
        lo = retention.first_needed_block(k * tpb, tpb)
        if min(k, sink) <= leading and (lo >= k or run_end[k - 1] >= k - lo):
            table = tuple(found[i] if (i < sink or i >= lo) else NULL_BLOCK for i in range(k))
            return PrefixHit(k * tpb, table, tuple(hashes), keys)  # type: ignore[arg-type]
    return PrefixHit(0, (), tuple(hashes), keys)
