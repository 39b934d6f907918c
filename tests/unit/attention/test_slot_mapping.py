"""Where each new token's K/V goes: AttentionMetadata's slot mapping, with and without DCP,
against the layout written out position by position."""

import pytest
import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.core.arith import local_len
from meshserve.errors import ConfigError


def _build(tables, ctx, q, bs, dcp=1, rank=0):
    return AttentionMetadata.build(
        query_lens=q, seq_lens=[c + n for c, n in zip(ctx, q)], block_tables=tables, block_size=bs,
        dcp_size=dcp, dcp_rank=rank,
    )


def test_slot_mapping_without_dcp_is_block_times_size_plus_offset():
    tables = [[3, 7, 1], [5], [2, 9]]
    ctx, q = [5, 0, 6], [4, 3, 1]
    want = [tables[s][p // 4] * 4 + p % 4 for s in range(3) for p in range(ctx[s], ctx[s] + q[s])]
    assert _build(tables, ctx, q, 4).slot_mapping.tolist() == want


def test_slot_mapping_with_dcp_puts_each_token_on_one_rank_at_its_local_position():
    bs, dcp = 4, 2
    tables = [[3, 6, 1], [8, 2]]
    ctx, q = [5, 0], [13, 11]
    per_rank = [_build(tables, ctx, q, bs, dcp, r).slot_mapping for r in range(dcp)]
    t = 0
    for s in range(2):
        for pos in range(ctx[s], ctx[s] + q[s]):
            owners = [r for r in range(dcp) if per_rank[r][t] >= 0]
            assert owners == [pos % dcp]
            local = pos // dcp
            assert per_rank[owners[0]][t] == tables[s][local // bs] * bs + local % bs
            t += 1
    assert local_len(18, 2, 0) == 9 and local_len(18, 2, 1) == 9 and local_len(5, 2, 1) == 2
    lens = torch.tensor([18, 5, 0])
    assert local_len(lens, 2, 1).tolist() == [9, 2, 0]  # the same formula on tensors


def test_slot_mapping_refuses_short_tables():
    with pytest.raises(ConfigError, match="block_tables"):
        _build([[1]], [2], [3], 2)
