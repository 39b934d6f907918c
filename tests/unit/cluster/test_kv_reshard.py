"""Re-sharding KV heads between pools of different tp: every decode rank must end up with exactly
the heads it would hold had it computed them itself, for split and replicated head layouts."""

import itertools

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.cluster.kv_reshard import copy_heads, head_range, pullers_of, sources_of, staging_caches

BLOCKS, BS, D = 5, 4, 3


def shard(full: torch.Tensor, num_kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    lo, hi = head_range(num_kv_heads, tp, rank)
    return full[:, :, :, lo:hi]


CASES = [(h, s, d) for h in (1, 2, 4, 8) for s, d in itertools.product((1, 2, 4, 8), repeat=2)
         if s != d and (h % s == 0 or s % h == 0) and (h % d == 0 or d % h == 0)]


@pytest.mark.parametrize("num_kv_heads,src_tp,dst_tp", CASES)
def test_every_decode_rank_gets_exactly_its_heads(num_kv_heads, src_tp, dst_tp):
    g = torch.Generator().manual_seed(num_kv_heads * 100 + src_tp * 10 + dst_tp)
    full = torch.randn(BLOCKS + 1, 2, BS, num_kv_heads, D, generator=g)  # the whole model's KV, block 0 = null
    src = [shard(full, num_kv_heads, src_tp, r) for r in range(src_tp)]
    sent = list(range(1, BLOCKS + 1))  # the sender's blocks, in table order
    for j in range(dst_tp):
        mine = shard(full, num_kv_heads, dst_tp, j)
        cache = KVCache(torch.zeros(BLOCKS + 4, *mine.shape[1:]))
        blocks = [7, 2, 5, 1, 4][:BLOCKS]  # scattered receiver blocks
        for piece in sources_of(j, num_kv_heads, src_tp, dst_tp):
            assert j in pullers_of(piece.src_rank, num_kv_heads, src_tp, dst_tp)
            (staging,) = staging_caches([cache], src[piece.src_rank].shape[3], BLOCKS)
            staging.data[1:] = src[piece.src_rank][sent]  # what the pull writes
            copy_heads([cache], [staging], blocks, piece)
        assert torch.equal(cache.data[blocks], mine[sent]), (j, sources_of(j, num_kv_heads, src_tp, dst_tp))
    for i in range(src_tp):  # a prefill rank offers only to decode ranks that take from it
        for j in pullers_of(i, num_kv_heads, src_tp, dst_tp):
            assert any(p.src_rank == i for p in sources_of(j, num_kv_heads, src_tp, dst_tp))


def test_replicated_heads_come_from_the_lowest_rank_holding_them():
    # 2 KV heads over 4 prefill ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
    assert [(p.src_rank, p.src_heads, p.dst_heads) for p in sources_of(0, 2, 4, 1)] == [
        (0, (0, 1), (0, 1)), (2, (0, 1), (1, 2))]
    assert pullers_of(1, 2, 4, 1) == [] and pullers_of(3, 2, 4, 1) == []


def test_latent_caches_are_pulled_whole():
    assert [(p.src_rank, p.src_heads) for p in sources_of(3, None, 2, 4)] == [(1, None)]
    assert pullers_of(0, None, 2, 4) == [0, 2]
