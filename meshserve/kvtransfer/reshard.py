"""KV hand-over between pools of different (tp, dcp) layouts: which ranks send what, and the
pure tensor moves that turn the sender's shards into the receiver's.

A layout says, per rank, which global KV heads it stores and which tokens: under DCP, rank r
holds global position p when p % dcp == r % dcp, at local slot p // dcp (block (p // dcp) //
block_size, offset (p // dcp) % block_size of its cache). Which heads a rank holds is decided in
parallel/transform.py; the caller passes them in (`Layout.head_ranges`), so this module knows
nothing of how they are chosen. A latent (MLA) cache has no head axis (`head_ranges` None).

Plan: decode rank j needs, for each of its heads, every token of its DCP residue. `sources_of`
cuts that into `Piece`s, each from the lowest prefill rank that holds those heads for one
prefill DCP residue whose tokens meet j's (two residues meet when they agree modulo the gcd of
the two dcp sizes). A prefill rank offers its whole shard once per decode rank that takes from
it (`pullers_of`). The decode rank pulls each source into a staging cache shaped like that
source's shard, then `copy_tokens` moves the tokens it needs (`token_moves`) into its blocks.
Logical blocks cover block_size * dcp tokens, so the receiver's block table positions follow
from the tokens the sender held (`receiver_positions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

import torch

from meshserve.errors import check
from meshserve.kvstore.cache_tensors import MLACache, block_tensors


@dataclass(frozen=True)
class Layout:
    """One pool's parallel layout. head_ranges: per rank, its global KV heads [lo, hi); None for
    caches without a head axis (latent / MLA)."""

    tp: int
    dcp: int
    head_ranges: tuple[tuple[int, int], ...] | None

    def __post_init__(self) -> None:
        check(self.tp >= 1 and self.dcp >= 1 and self.tp % self.dcp == 0, "dcp", self.dcp,
              f"a divisor of tp={self.tp}")
        if self.head_ranges is not None:
            check(len(self.head_ranges) == self.tp, "head_ranges", len(self.head_ranges), f"{self.tp} (one per rank)")

    def residue(self, rank: int) -> int:
        """The DCP rank of TP rank `rank`: it stores positions p with p % dcp == residue."""
        return rank % self.dcp


@dataclass(frozen=True)
class Piece:
    """Heads [src_lo, src_hi) of source rank `src_rank`'s shard go to [dst_lo, dst_hi) of ours
    (local head indices; None: the whole cache, no head axis), for the tokens both hold."""

    src_rank: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None


def residues_meet(src_res: int, src_dcp: int, dst_res: int, dst_dcp: int) -> bool:
    """Whether some position p has p % src_dcp == src_res and p % dst_dcp == dst_res."""
    return (src_res - dst_res) % gcd(src_dcp, dst_dcp) == 0


def sources_of(dst_rank: int, src: Layout, dst: Layout) -> list[Piece]:
    """Where decode rank `dst_rank` of `dst` gets its KV from ranks of `src`."""
    res = dst.residue(dst_rank)
    out: list[Piece] = []
    for src_res in range(src.dcp):
        if not residues_meet(src_res, src.dcp, res, dst.dcp):
            continue
        ranks = [r for r in range(src.tp) if src.residue(r) == src_res]
        if dst.head_ranges is None or src.head_ranges is None:
            out.append(Piece(ranks[0], None, None))
            continue
        lo, hi = dst.head_ranges[dst_rank]
        h = lo
        while h < hi:
            owner = min(r for r in ranks if src.head_ranges[r][0] <= h < src.head_ranges[r][1])
            a, b = src.head_ranges[owner]
            end = min(hi, b)
            out.append(Piece(owner, (h - a, end - a), (h - lo, end - lo)))
            h = end
    return out


def pullers_of(src_rank: int, src: Layout, dst: Layout) -> list[int]:
    """Decode ranks that take some of `src_rank`'s shard."""
    return [j for j in range(dst.tp) if any(p.src_rank == src_rank for p in sources_of(j, src, dst))]


def receiver_positions(num_tokens: int, sent_positions: Sequence[int], src_tpb: int, dst_tpb: int) -> tuple[int, ...]:
    """Table positions (logical blocks of `dst_tpb` tokens) that hold some token the sender held
    (its logical blocks of `src_tpb` tokens at `sent_positions`; a window may have released others)."""
    held: set[int] = set()
    for p in sent_positions:
        first, last = p * src_tpb, min((p + 1) * src_tpb, num_tokens) - 1
        held.update(range(first // dst_tpb, last // dst_tpb + 1))
    return tuple(sorted(held))


@dataclass(frozen=True)
class Moves:
    """Token rows to copy: source (block, offset) -> destination (block, offset), [n] int64 each."""

    src_block: torch.Tensor
    src_offset: torch.Tensor
    dst_block: torch.Tensor
    dst_offset: torch.Tensor


def token_moves(num_tokens: int, block_size: int, *, src_dcp: int, src_res: int, src_blocks: dict[int, int],
                dst_dcp: int, dst_res: int, dst_blocks: dict[int, int]) -> Moves:
    """Every position p < num_tokens held by both residues, where the source holds it (physical
    block from `src_blocks`: logical position -> block id) and where we keep it (`dst_blocks`).
    Positions in a logical block the source released (absent from src_blocks) are skipped."""
    step = src_dcp * dst_dcp // gcd(src_dcp, dst_dcp)
    first = next((p for p in range(step) if p % src_dcp == src_res and p % dst_dcp == dst_res), None)
    rows: list[tuple[int, int, int, int]] = []
    if first is not None:
        for p in range(first, num_tokens, step):
            s_local, d_local = p // src_dcp, p // dst_dcp
            s_blk = src_blocks.get(s_local // block_size)
            d_blk = dst_blocks.get(d_local // block_size)
            if s_blk is not None and d_blk is not None:
                rows.append((s_blk, s_local % block_size, d_blk, d_local % block_size))
    cols = torch.tensor(rows, dtype=torch.long).reshape(-1, 4).T
    return Moves(*cols)


def copy_tokens(caches: Sequence[object | None], staging: Sequence[object | None], moves: Moves, piece: Piece) -> None:
    """Copy `moves`' token rows (and `piece`'s heads) from the staging caches into ours, once per
    tensor (layers that share a tensor share its blocks). Caches hold `.data`:
    [blocks, 2, block_size, heads, head_size] (K/V), or [blocks, block_size, width] (latent)."""
    done: set[int] = set()
    for cache, stage in zip(caches, staging):
        if cache is None or id(cache.data) in done:
            continue
        done.add(id(cache.data))
        dev = cache.data.device
        sb, so, db, do = (t.to(dev) for t in (moves.src_block, moves.src_offset, moves.dst_block, moves.dst_offset))
        if piece.src_heads is None:  # latent: one row per token (sparse MLA: and its index key)
            for mine, staged in zip(block_tensors(cache), block_tensors(stage)):
                mine[db, do] = staged.to(dev)[sb, so]
        else:
            src = stage.data.to(dev)
            (slo, shi), (dlo, dhi) = piece.src_heads, piece.dst_heads
            # advanced indices on dims 0 and 2 go first: rows [n, 2, heads, head_size]
            cache.data[db, :, do, dlo:dhi] = src[sb, :, so, slo:shi]


def staging_caches(caches: Sequence[object | None], src_heads: int | None, num_blocks: int) -> list[object | None]:
    """Caches shaped like a source rank's shard (`src_heads` local KV heads; None: latent caches,
    same width), blocks 1..num_blocks (block 0 is the null block, as in every cache). Layers that
    share a tensor (a hybrid KV layout) share their staging tensor too, so the staging layout is
    the source's. Same cache type and scales as ours."""
    out: list[object | None] = []
    shared: dict[int, torch.Tensor] = {}
    for cache in caches:
        if cache is None:
            out.append(None)
            continue
        data = shared.get(id(cache.data))
        if data is None:
            shape = list(cache.data.shape)
            shape[0] = num_blocks + 1
            if src_heads is not None:
                shape[3] = src_heads  # [blocks, 2, block_size, heads, head_size]
            data = shared[id(cache.data)] = torch.empty(shape, dtype=cache.data.dtype, device=cache.data.device)
        extra = {}
        if isinstance(cache, MLACache):  # sparse MLA's index key cache (and FP8 scales), blocks like the latent
            extra = {name: torch.empty((num_blocks + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
                     for name in ("index_keys", "index_scale") if (t := getattr(cache, name)) is not None}
        out.append(dataclasses.replace(cache, data=data, **extra))
    return out
