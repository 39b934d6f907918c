"""Re-sharding a request's KV between any two (tp, dcp) layouts, against the unsharded KV.

For every pair of layouts (tp in {1, 2, 4}, every dcp dividing tp; split and replicated KV heads;
latent caches without a head axis), the sender's ranks hold their shards in shuffled blocks of
paged caches full of noise; each receiver rank pulls what `sources_of` names into staging caches
(in the sent order, as the wire delivers them) and `copy_tokens` moves them into its own
shuffled blocks. Every receiver rank must then hold exactly the tokens and heads it would have
computed itself: global position p with p % dcp == its DCP rank, at local slot p // dcp.
"""

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from meshserve.kvtransfer.reshard import (
    Layout,
    copy_tokens,
    pullers_of,
    receiver_positions,
    residues_meet,
    sources_of,
    staging_caches,
    token_moves,
)
from meshserve.parallel.transform import kv_head_offset, local_kv_heads

BS, D, NUM_TOKENS = 4, 3, 45
LAYOUTS = [(tp, dcp) for tp in (1, 2, 4) for dcp in (1, 2, 4) if tp % dcp == 0]


@dataclass
class Cache:  # what the re-shard functions read of a cache: its data tensor
    data: torch.Tensor


def layout(tp: int, dcp: int, num_kv_heads: int | None) -> Layout:
    if num_kv_heads is None:
        return Layout(tp, dcp, None)
    n = local_kv_heads(num_kv_heads, tp, dcp)
    return Layout(tp, dcp, tuple((o, o + n) for o in (kv_head_offset(num_kv_heads, tp, dcp, r) for r in range(tp))))


def valid(num_kv_heads: int, tp: int, dcp: int) -> bool:
    groups = tp // dcp
    return num_kv_heads % groups == 0 or groups % num_kv_heads == 0


def paged(lay: Layout, rank: int, positions, spare: int, width: int, fill, rng: random.Random):
    """A cache of rank `rank` (heads per lay.head_ranges, or latent rows of `width`) with shuffled
    blocks for the logical `positions` (and `spare` unused ones), filled by `fill(shape)`."""
    ids = list(range(1, len(positions) + spare + 1))
    rng.shuffle(ids)
    if lay.head_ranges is None:
        shape = (len(ids) + 1, BS, width)
    else:
        lo, hi = lay.head_ranges[rank]
        shape = (len(ids) + 1, 2, BS, hi - lo, D)
    return Cache(fill(shape)), dict(zip(positions, ids))


def shard_caches(full: torch.Tensor, lay: Layout, positions: list[int], rng: random.Random):
    """Per rank: a noisy cache holding its tokens/heads of `full` at the logical blocks `positions`,
    and {logical position: block id}. full: [N, 2, H, D] (or [N, W] latent)."""
    tpb = BS * lay.dcp
    out = []
    for r in range(lay.tp):
        cache, table = paged(lay, r, positions, 3, full.shape[-1], lambda shape: torch.randn(shape) * 100, rng)
        data = cache.data
        if lay.head_ranges is not None:
            lo, hi = lay.head_ranges[r]
        for p in range(lay.residue(r), NUM_TOKENS, lay.dcp):
            if p // tpb not in table:
                continue  # released (outside a window)
            local = p // lay.dcp
            blk, off = table[local // BS], local % BS
            if lay.head_ranges is None:
                data[blk, off] = full[p]
            else:
                data[blk, :, off] = full[p, :, lo:hi]
        out.append((cache, table))
    return out


def run_reshard(full, src: Layout, dst: Layout, sent_positions: list[int], seed: int):
    rng = random.Random(seed)
    senders = shard_caches(full, src, sent_positions, rng)
    dst_positions = receiver_positions(NUM_TOKENS, sent_positions, BS * src.dcp, BS * dst.dcp)
    receivers = []
    for j in range(dst.tp):
        cache, table = paged(dst, j, dst_positions, 4, full.shape[-1],
                             lambda shape: torch.full(shape, float("nan")), rng)
        for piece in sources_of(j, src, dst):
            assert j in pullers_of(piece.src_rank, src, dst)
            src_cache, src_table = senders[piece.src_rank]
            heads = None if piece.src_heads is None else src_cache.data.shape[3]
            (stage,) = staging_caches([cache], heads, len(sent_positions))
            sent = [src_table[p] for p in sent_positions]  # the sent order: table order
            stage.data[1:] = src_cache.data[sent]  # what the pull writes
            staged = {p: i + 1 for i, p in enumerate(sent_positions)}
            moves = token_moves(NUM_TOKENS, BS, src_dcp=src.dcp, src_res=src.residue(piece.src_rank),
                                src_blocks=staged, dst_dcp=dst.dcp, dst_res=dst.residue(j), dst_blocks=table)
            copy_tokens([cache], [stage], moves, piece)
        receivers.append((cache, table))
    return receivers


def check_receivers(full, src: Layout, dst: Layout, receivers, sent_positions):
    held = {p for p in range(NUM_TOKENS) if p // (BS * src.dcp) in set(sent_positions)}
    for j, (cache, table) in enumerate(receivers):
        for p in range(dst.residue(j), NUM_TOKENS, dst.dcp):
            if p not in held:
                continue
            local = p // dst.dcp
            got = cache.data[table[local // BS], local % BS] if dst.head_ranges is None else \
                cache.data[table[local // BS], :, local % BS]
            want = full[p] if dst.head_ranges is None else full[p, :, slice(*dst.head_ranges[j])]
            assert torch.equal(got, want), f"rank {j} position {p}"


PAIRS = [(h, s, d) for h in (1, 2, 4, 8) for s, d in itertools.permutations(LAYOUTS, 2)
         if valid(h, *s) and valid(h, *d)]


@pytest.mark.parametrize(("num_kv_heads", "src", "dst"), PAIRS)
def test_every_receiver_rank_gets_exactly_its_tokens_and_heads(num_kv_heads, src, dst):
    full = torch.randn(NUM_TOKENS, 2, num_kv_heads, D)
    s, d = layout(*src, num_kv_heads), layout(*dst, num_kv_heads)
    positions = list(range(-(-NUM_TOKENS // (BS * s.dcp))))
    check_receivers(full, s, d, run_reshard(full, s, d, positions, seed=num_kv_heads), positions)


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(LAYOUTS, 2)))
def test_latent_caches_are_redistributed_by_token(src, dst):
    full = torch.randn(NUM_TOKENS, 5)
    s, d = layout(*src, None), layout(*dst, None)
    positions = list(range(-(-NUM_TOKENS // (BS * s.dcp))))
    check_receivers(full, s, d, run_reshard(full, s, d, positions, seed=1), positions)


@pytest.mark.parametrize(("src", "dst"), [((2, 2), (4, 1)), ((1, 1), (4, 4)), ((4, 4), (2, 1)), ((2, 1), (4, 2))])
def test_blocks_a_window_released_are_skipped(src, dst):
    full = torch.randn(NUM_TOKENS, 2, 4, D)
    s, d = layout(*src, 4), layout(*dst, 4)
    last = -(-NUM_TOKENS // (BS * s.dcp))
    positions = list(range(last))[last // 2:]  # the first half released
    check_receivers(full, s, d, run_reshard(full, s, d, positions, seed=3), positions)


def test_residues_meet_and_receiver_positions_by_brute_force():
    for sd, dd in itertools.product((1, 2, 3, 4, 6), repeat=2):
        for sr, dr in itertools.product(range(sd), range(dd)):
            assert residues_meet(sr, sd, dr, dd) == any(p % sd == sr and p % dd == dr for p in range(sd * dd))
    for src_tpb, dst_tpb in itertools.product((4, 8, 16), repeat=2):
        sent = [1, 2, 5]
        tokens = {t for p in sent for t in range(p * src_tpb, min((p + 1) * src_tpb, NUM_TOKENS))}
        assert receiver_positions(NUM_TOKENS, sent, src_tpb, dst_tpb) == tuple(sorted({t // dst_tpb for t in tokens}))


def test_layout_refuses_a_dcp_that_does_not_divide_tp():
    from meshserve.errors import ConfigError

    with pytest.raises(ConfigError, match="dcp"):
        Layout(4, 3, None)
