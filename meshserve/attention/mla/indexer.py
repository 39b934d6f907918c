"""Sparse MLA's lightning indexer (DeepSeek-V3.2): its key cache, its scores, its top-k choice.

Every token writes one indexer key k_t [D] (D = index_head_dim) into the layer's index key cache,
beside its latent row (same block id and slot). A query token with index-head queries q [Hi, D]
and head weights w [Hi] scores each visible earlier token t as

    score(t) = sum_h w[h] * relu(q[h] . k_t * D ** -0.5)

and attends (sparse MLA) to the `topk` best-scored ones only; causal: t's position <= its own.
Ties go to the earlier position, so the choice is a function of the scores alone: a DCP group,
where each rank scores only the tokens it stores, reaches the same choice by merging the ranks'
own top-k lists (the global top-k is contained in their union; `merge_candidates`).

FP8 index keys (when the KV cache is FP8) are stored as float8_e4m3 with one float32 scale per
token (amax / 448), after the orthonormal Hadamard rotation DeepSeek applies to q and k so that
outliers spread over all D values; the rotation leaves every dot product, so every score, as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.cache import LatentCache
from meshserve.core.arith import cdiv
from meshserve.errors import check

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCORE_BUDGET = 1 << 26  # float32 per-head logits materialised at once (256 MiB): long prefills go in chunks


@dataclass(frozen=True)
class TopK:
    """Per query token, the chosen keys, best first.

    scores    [T, k] float32 (-inf in unused columns)
    positions [T, k] int64 global token positions (-1 in unused columns)
    """

    scores: torch.Tensor
    positions: torch.Tensor

    def local_rows(self, dcp_size: int = 1, dcp_rank: int = 0) -> torch.Tensor:
        """[T, k] int32 rows of this rank's cache for the chosen keys it stores (-1 elsewhere):
        the token at position p lives on rank p % dcp_size at local row p // dcp_size."""
        mine = (self.positions >= 0) & (self.positions % dcp_size == dcp_rank)
        return torch.where(mine, self.positions // dcp_size, -1).to(torch.int32)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Sylvester-Hadamard matrix (D a power of two), in float32."""
    d = x.shape[-1]
    check(d & (d - 1) == 0, "index_head_dim", d, "a power of two for an FP8 index key cache (Hadamard rotation)")
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x.float() @ (h / math.sqrt(d))


def write_index_keys(keys: torch.Tensor, cache: LatentCache, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' indexer keys [T, D] at `slot_mapping` [T] (-1: another DCP rank stores it)."""
    check(cache.index_keys is not None, "cache.index_keys", None, "an index key cache (a sparse MLA layer)")
    width = cache.index_keys.shape[2]
    check(tuple(keys.shape) == (slot_mapping.shape[0], width), "keys", tuple(keys.shape),
          f"[{slot_mapping.shape[0]}, {width}] (one index key per slot)")  # fmt: skip
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = cache.index_keys.view(-1, width)
    rows = keys[keep].float()
    if cache.index_scale is None:
        flat[slots] = rows.to(flat.dtype)
        return
    rows = hadamard(rows)
    scale = (rows.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    flat[slots] = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(flat.dtype)
    cache.index_scale.view(-1)[slots] = scale


def gather_index_keys(cache: LatentCache, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Every sequence's first `length` cached index keys: block_table [S, max_blocks] ->
    [S, length, D], in the storage dtype (FP8: dequantised to float32, still rotated). Rows past a
    sequence's end hold whatever its table points at; callers mask them by position."""
    bs, width = cache.block_size, cache.index_keys.shape[2]
    blocks = block_table[:, : cdiv(length, bs)].long()  # [S, nb]
    keys = cache.index_keys[blocks].reshape(blocks.shape[0], -1, width)[:, :length]
    if cache.index_scale is not None:
        keys = keys.float() * cache.index_scale[blocks].reshape(blocks.shape[0], -1)[:, :length, None]
    return keys


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, Hi, D], weights [T, Hi], each token's keys [T, N, D] -> scores [T, N] float32."""
    logits = torch.einsum("thd,tnd->thn", q.float(), keys.float()) * q.shape[-1] ** -0.5
    return torch.einsum("thn,th->tn", torch.relu(logits), weights.float())


def topk_ordered(scores: torch.Tensor, positions: torch.Tensor, k: int) -> TopK:
    """The k best of each row of scores [T, N] (-inf: not a candidate) with their positions [T, N];
    ties go to the smaller position. Rows with fewer candidates are padded (-inf, -1)."""
    t, n = scores.shape
    if n < k:
        scores = torch.cat([scores, scores.new_full((t, k - n), float("-inf"))], dim=1)
        positions = torch.cat([positions, positions.new_full((t, k - n), -1)], dim=1)
    big = torch.iinfo(torch.int64).max
    by_position = torch.sort(torch.where(positions >= 0, positions, big), dim=1, stable=True).indices
    scores, positions = scores.gather(1, by_position), positions.gather(1, by_position)
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    top_scores, top_positions = scores.gather(1, best), positions.gather(1, best)
    empty = torch.isneginf(top_scores)
    return TopK(top_scores, torch.where(empty, -1, top_positions))


def merge_candidates(parts: list[TopK], k: int) -> TopK:
    """The global top-k from each DCP rank's own top-k over the tokens it stores (exact)."""
    return topk_ordered(torch.cat([p.scores for p in parts], dim=1), torch.cat([p.positions for p in parts], dim=1), k)


def index_candidates(q: torch.Tensor, weights: torch.Tensor, cache: LatentCache, meta: AttentionMetadata,
                     k: int) -> TopK:  # fmt: skip
    """This rank's top-k per query token over the keys it stores, causal by global position.

    q [T, Hi, D] (rope applied), weights [T, Hi] (head weights, any constant factors folded in).
    On a DCP rank the result is a candidate list for `merge_candidates`, not the choice.
    The whole batch is scored at once (a few kernels per chunk of query tokens, no host sync):
    each token against its sequence's keys, padded to the longest; keys past a token's position
    (its sequence's end included) are masked.
    """
    tokens = meta.num_tokens
    check(q.shape[0] == tokens, "q", tuple(q.shape), f"[{tokens}, heads, dim] (one per new token)")
    if cache.index_scale is not None:
        q = hadamard(q)  # the keys were rotated before FP8 quantisation
    device = q.device
    scores = torch.full((tokens, k), float("-inf"), device=device)
    positions = torch.full((tokens, k), -1, dtype=torch.int64, device=device)
    n = max((meta.local_len(s) for s in meta.seq_lens_host), default=0)
    if tokens == 0 or n == 0:
        return TopK(scores, positions)
    keys = gather_index_keys(cache, meta.block_table, n)  # [S, n, D]
    query_lens = torch.tensor(meta.query_lens_host, device=device)
    token_seq = torch.repeat_interleave(torch.arange(len(meta.query_lens_host), device=device), query_lens,
                                        output_size=tokens)  # fmt: skip
    # a token's position: its sequence's first new position plus its index among the new tokens
    first = meta.seq_lens.long() - query_lens - meta.query_start_loc[:-1].long()
    q_pos = first[token_seq] + torch.arange(tokens, device=device)
    key_pos = torch.arange(n, device=device) * meta.dcp_size + meta.dcp_rank
    step = max(1, SCORE_BUDGET // (n * (q.shape[1] + q.shape[2])))  # per-chunk logits and gathered keys
    for c0 in range(0, tokens, step):
        c1 = min(c0 + step, tokens)
        part = index_scores(q[c0:c1], weights[c0:c1], keys[token_seq[c0:c1]])
        part = part.masked_fill(key_pos[None, :] > q_pos[c0:c1, None], float("-inf"))
        top = topk_ordered(part, key_pos.expand(c1 - c0, n), k)
        scores[c0:c1], positions[c0:c1] = top.scores, top.positions
    return TopK(scores, positions)
