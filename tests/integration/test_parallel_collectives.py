"""TP layers and the DCP merge over real gloo process groups, against single-rank math."""

import pytest
import torch

from meshserve.config import DcpComm, ParallelConfig
from meshserve.parallel import dcp as dcp_ops
from meshserve.parallel.groups import init_parallel, shutdown_parallel
from meshserve.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, vocab_range
from tests.integration.distributed import run_ranks
from tests.unit.attention.scenarios import Scenario, make_case, oracle
from tests.unit.attention.test_dcp_reference import shard_run


def check_tp_layers(ctx) -> None:
    """Each layer filled with this rank's slice (cut here, independently of the loader)."""
    gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
    hidden, inter, vocab = 16, 24, 41  # 41 rows do not split evenly: the last shard is shorter
    x = torch.randn(5, hidden, generator=gen)
    h = torch.randn(5, inter, generator=gen)
    w_down, b_down = torch.randn(hidden, inter, generator=gen), torch.randn(hidden, generator=gen)
    emb = torch.randn(vocab, hidden, generator=gen)
    ids = torch.randint(0, vocab, (9,), generator=gen)
    per_in = inter // ctx.tp
    cols = slice(ctx.rank * per_in, (ctx.rank + 1) * per_in)

    down = RowParallelLinear(per_in, hidden, bias=True, ctx=ctx)
    down.weight.data.copy_(w_down[:, cols])
    down.bias.data.copy_(b_down)
    torch.testing.assert_close(down(h[:, cols]), h @ w_down.T + b_down, rtol=1e-5, atol=1e-5)

    start, stop = vocab_range(vocab, ctx)
    embed, head = VocabParallelEmbedding(vocab, hidden, ctx=ctx), ParallelLMHead(vocab, hidden, ctx=ctx)
    embed.weight.data.copy_(emb[start:stop])
    head.weight.data.copy_(emb[start:stop])
    torch.testing.assert_close(embed(ids), emb[ids])
    torch.testing.assert_close(head(x), x @ emb.T, rtol=1e-5, atol=1e-5)


# Uneven shards and a one-token sequence (every rank but 0 holds no key of it).
DCP_SCENARIO = Scenario("dcp_uneven", (1, 6, 1, 1), (0, 5, 13, 40), spec=dict(num_heads=8, num_kv_heads=2))


def check_dcp_merge(ctx) -> None:
    case = make_case(DCP_SCENARIO)
    ref_out, ref_lse = oracle(case)
    local = case.spec.num_heads // ctx.dcp
    mine = slice(ctx.dcp_rank * local, (ctx.dcp_rank + 1) * local)
    gathered = dcp_ops.gather_queries(case.query[:, mine], ctx)
    torch.testing.assert_close(gathered, case.query, rtol=0, atol=0)
    o, lse = shard_run(case, ctx.dcp, ctx.dcp_rank, torch.Generator().manual_seed(ctx.rank))
    for comm in DcpComm:
        merged = dcp_ops.merge_outputs(o, lse, ctx, comm)
        assert merged.shape == (o.shape[0], local, o.shape[2]), merged.shape
        err = (merged.double() - ref_out[:, mine]).abs().max().item()
        assert err < 1e-5, f"{comm}: DCP merge error {err}"


def worker(rank: int, world: int, init_method: str, dcp: int) -> None:
    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=world, dcp=dcp), rank=rank, init_method=init_method)
    try:
        assert (ctx.rank, ctx.tp, ctx.dcp, ctx.dcp_rank) == (rank, world, dcp, rank % dcp)
        check_tp_layers(ctx)
        if dcp > 1:
            check_dcp_merge(ctx)
    finally:
        shutdown_parallel(ctx)


@pytest.mark.parametrize(("tp", "dcp"), [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_tp_layers_and_dcp_merge(tp, dcp):
    run_ranks(worker, tp, dcp)


def test_kv_heads_each_rank_stores():
    """The heads the loader slices for each rank (transform.local_kv_heads / kv_head_offset)."""
    from meshserve.parallel.transform import kv_head_offset, local_kv_heads

    def heads(num_kv, tp, dcp, rank):
        first = kv_head_offset(num_kv, tp, dcp, rank)
        return list(range(first, first + local_kv_heads(num_kv, tp, dcp)))

    # 8 q heads, 2 kv heads, tp=4: each rank's 2 q heads use one kv head (replicated x2).
    assert [heads(2, 4, 1, r) for r in range(4)] == [[0], [0], [1], [1]]
    # With dcp=2 the replicas of a kv head become token shards of it.
    assert [heads(2, 4, 2, r) for r in range(4)] == [[0], [0], [1], [1]]
    # tp=2, dcp=2: one group holds all q heads and both kv heads.
    assert heads(2, 2, 2, 1) == [0, 1]
    # 8 kv heads, tp=4: two kv heads per rank.
    assert heads(8, 4, 1, 3) == [6, 7]
