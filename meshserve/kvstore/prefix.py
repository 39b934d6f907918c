"""Prefix lookup: the longest prefix of a token sequence that every layer group has cached
(plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.kvstore.block_hash import BlockHash, hash_block
from meshserve.kvstore.block_pool import NULL_BLOCK, BlockPool
from meshserve.kvstore.retention import RetentionPolicy


@dataclass(frozen=True)
class PrefixHit:
    """Result of `lookup_prefix`: what of a token sequence is already cached, per layer group.

    num_tokens:   cached tokens, the same in every group (a multiple of tokens_per_block, at most
                  len(token_ids) - 1: the last token is always computed, to produce logits)
    block_ids:    per group, the table entries covering them (NULL_BLOCK where a sliding window
                  does not need the block, so it was not required to be cached)
    block_hashes: per group, chained hashes of the full blocks of token_ids computed during the
                  lookup (at least one per entry of block_ids); allocate_slots reuses them
    extra_keys:   the extra keys the hashes were computed with
    """

    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    block_hashes: tuple[tuple[BlockHash, ...], ...]
    extra_keys: tuple = ()


def lookup(
    pool: BlockPool,
    retentions: Sequence[RetentionPolicy],
    extras: Sequence[bytes],
    order: Sequence[int],
    tokens_per_block: int,
    token_ids: Sequence[int],
    extra_keys: tuple,
) -> PrefixHit:
    """The longest prefix every group has cached. extras: per group, the encoded extra keys with
    the group's salt; order: the groups, full-attention ones first.

    A full-attention group's hit is prefix-closed (every shorter length hits too); a windowed
    group's needs only the sink blocks and the first query's window, so a windowed hit cut
    shorter needs other blocks (its new window). Hence: look every group up with the shortest hit
    so far as the limit, full-attention groups first (their hit bounds the others), and repeat
    for the groups that hit longer until every group agrees. One group: one pass.
    """
    tpb = tokens_per_block
    limit = len(token_ids)  # a group's hit never exceeds limit - 1 tokens
    hashes: list[list[BlockHash]] = [[] for _ in retentions]  # per group, computed once, as needed
    hits: list[tuple[int, tuple[int, ...]]] = [(limit, ())] * len(retentions)  # (limit, ...): not looked up
    while True:
        for g in order:
            hit = hits[g]
            if hit[0] >= limit:
                hit = hits[g] = _group_hit(pool, retentions[g], tpb, token_ids, limit, extras[g], hashes[g])
            if hit[0] < limit - 1:
                limit = hit[0] + 1
        # Agreed, or a group hit longer than the shortest: the next pass looks it up again.
        for hit in hits:
            if hit[0] != limit - 1:
                break
        else:
            return PrefixHit(limit - 1, tuple([h[1] for h in hits]), tuple([tuple(h) for h in hashes]), extra_keys)


def _group_hit(
    pool: BlockPool,
    retention: RetentionPolicy,
    tpb: int,
    token_ids: Sequence[int],
    limit: int,
    extra: bytes,
    hashes: list[BlockHash],
) -> tuple[int, tuple[int, ...]]:
    """(tokens, table entries) of one group's longest hit within the first `limit` tokens;
    extends `hashes`, the group's chain of token_ids, as far as it reads."""
    max_blocks = max(0, limit - 1) // tpb  # the last token is always computed
    windowed = retention.sliding_window is not None
    find = pool.lookup
    found: list[int | None] = []
    for h in hashes[:max_blocks]:  # known from an earlier pass of another limit
        found.append(find(h))
        if found[-1] is None and not windowed:
            break  # full attention: the prefix ends at the first miss
    else:
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), max_blocks):
            parent = hash_block(parent, token_ids[i * tpb : (i + 1) * tpb], extra)
            hashes.append(parent)
            found.append(find(parent))
            if found[-1] is None and not windowed:
                break
    if not found:
        return 0, ()
    if not windowed:
        hit = len(found) - (found[-1] is None)
        return hit * tpb, tuple(found[:hit])  # type: ignore[arg-type]
    return _windowed_hit(retention, tpb, found)


def _windowed_hit(retention: RetentionPolicy, tpb: int, found: list[int | None]) -> tuple[int, tuple[int, ...]]:
    """Longest k such that the sink blocks and the window of a first query at k * tpb are cached."""
    sink = retention.num_sink_blocks(tpb)
    leading = next((i for i, b in enumerate(found) if b is None), len(found))  # cached from 0
    run_end = [0] * len(found)  # length of the cached run ending at i
    for i, b in enumerate(found):
        run_end[i] = 0 if b is None else (run_end[i - 1] + 1 if i else 1)
    for k in range(len(found), 0, -1):
        lo = retention.first_needed_block(k * tpb, tpb)
        if min(k, sink) <= leading and (lo >= k or run_end[k - 1] >= k - lo):
            return k * tpb, tuple(found[i] if (i < sink or i >= lo) else NULL_BLOCK for i in range(k))  # type: ignore[misc]
    return 0, ()
