"""DCP for MLA at the attention level: the latent cache has one "head", so the ranks that would
replicate it each hold every dcp-th token instead. Each rank attends over its shard with global
positions; the LSE merge of the shards must equal attention over the whole cache."""

import pytest
import torch

from meshserve.attention.merge import merge_attn_states_n
from meshserve.attention.mla.layer import MLAAttention
from tests.unit.attention.mla_cases import MLA_BY_NAME, make_mla_case, mla_oracle
from tests.unit.attention.scenarios import assert_matches

CASES = [("mixed", 2), ("chunked_prefill", 3), ("long_decode", 2), ("small_page_decode", 3), ("fp8_e4m3", 2)]


def shard_output(name: str, dcp: int, rank: int, backend: str):
    sc = MLA_BY_NAME[name]
    case = make_mla_case(sc, seed=5, dcp_size=dcp, dcp_rank=rank)
    attn = MLAAttention(sc.problem(dcp_size=dcp), decode_backend=backend, prefill_backend=backend)
    plan = attn.plan(case.metadata)
    attn.write_kv(case.latent, case.k_pe, case.cache, plan)
    return attn.forward(case.query, case.cache, plan, case.weights, return_lse=True)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize(("name", "dcp"), CASES)
def test_latent_shards_merge_to_full_attention(name, dcp, backend):
    parts = [shard_output(name, dcp, rank, backend) for rank in range(dcp)]
    out, lse = merge_attn_states_n(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    ref_out, ref_lse = mla_oracle(make_mla_case(MLA_BY_NAME[name], seed=5))
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_a_rank_without_keys_returns_an_empty_part():
    """A one-token prompt on a dcp=2 group: rank 1 holds none of it (output 0, LSE -inf)."""
    from tests.unit.attention.mla_cases import MLAScenario

    sc = MLAScenario("one_token", (1, 3), (0, 0))
    case = make_mla_case(sc, dcp_size=2, dcp_rank=1)
    attn = MLAAttention(sc.problem(dcp_size=2), decode_backend="TRITON", prefill_backend="TRITON")
    plan = attn.plan(case.metadata)
    attn.write_kv(case.latent, case.k_pe, case.cache, plan)
    out, lse = attn.forward(case.query, case.cache, plan, case.weights, return_lse=True)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    assert torch.isneginf(lse[1]).all()  # position 0 of the second prompt lives on rank 0
    assert torch.isfinite(lse[2:]).all()
