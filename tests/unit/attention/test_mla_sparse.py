"""Sparse MLA (DeepSeek-V3.2) at the attention level: the lightning indexer's choice and the
attention over the chosen rows, TORCH and TRITON (CPU interpreter), against float64 oracles.

- every visible row chosen (k >= context): equals dense MLA (the dense TORCH reference, and the
  float64 dense oracle);
- a few random rows per token: equals a float64 oracle over the same rows;
- the indexer's top-k equals a float64 selection (best score first, ties to the earlier token);
- DCP: the ranks' candidate lists merge into the single-rank choice, and the ranks' attention
  over the rows they store merges by LSE into the single-rank output.
The scenarios (shuffled block tables, noise outside the sequences) are the dense MLA tests'.
"""


import pytest
import torch

from meshserve.attention.merge import merge_attn_states_n
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.indexer import hadamard, index_candidates, merge_candidates, write_index_keys
from meshserve.attention.mla.sparse_layer import SparseMLAAttention
from meshserve.attention.spec import IndexerDims
from meshserve.errors import ConfigError, NoBackendError
from tests.unit.attention.mla_cases import mla_oracle
from tests.unit.attention.scenarios import assert_matches
from tests.unit.attention.sparse_cases import (
    INDEX,
    chosen_rows,
    full_metadata,
    run_sparse,
    sparse_case,
    sparse_oracle,
    sparse_problem,
    token_positions,
)

NAMES = ["small_decode", "small_page_decode", "prefill", "chunked_prefill", "mixed", "odd_dims", "fp8_e4m3"]
@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("name", NAMES)
def test_every_row_chosen_equals_dense_mla(name, backend):
    case, cache = sparse_case(name, seed=2)
    out, lse = run_sparse(backend, case, cache, chosen_rows(case.metadata, None))
    dense_out, dense_lse = TorchMLABackend(case.scenario.problem()).forward(
        case.query, case.cache, case.metadata, case.weights, return_lse=True)  # fmt: skip
    if backend == "TORCH":  # the same float32 math over the same rows, in another order
        torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, dense_lse, rtol=1e-6, atol=1e-6)
    ref_out, ref_lse = mla_oracle(case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_few_rows_match_float64_oracle_over_the_same_rows(name, monkeypatch):
    monkeypatch.setattr("meshserve.attention.mla.backends.torch_sparse.EXPANDED_BUDGET", 1000)  # chunks of tokens
    case, cache = sparse_case(name, seed=3)
    rows = chosen_rows(case.metadata, 5, seed=1)
    ref_out, ref_lse = sparse_oracle(case, rows)
    torch_out, torch_lse = run_sparse("TORCH", case, cache, rows)
    assert_matches(torch_out, torch_lse, ref_out, ref_lse, torch.float32)
    triton_out, triton_lse = run_sparse("TRITON", case, cache, rows)
    assert_matches(triton_out, triton_lse, ref_out, ref_lse, torch.float32)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-5)  # TRITON equals TORCH


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_token_without_rows_gives_an_empty_part(backend):
    case, cache = sparse_case("mixed")
    rows = chosen_rows(case.metadata, 3)
    rows[0] = -1
    out, lse = run_sparse(backend, case, cache, rows)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    assert torch.isfinite(lse[1:]).all()


def index_inputs(case, seed: int = 7):
    """Index keys for every token of every sequence, and index queries / weights for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, INDEX.head_dim, generator=gen) for n in case.scenario.seq_lens]
    q = torch.randn(case.metadata.num_tokens, INDEX.num_heads, INDEX.head_dim, generator=gen)
    w = torch.randn(case.metadata.num_tokens, INDEX.num_heads, generator=gen)
    return keys, q, w


def store_keys(case, cache, keys) -> None:
    full = full_metadata(case)
    write_index_keys(torch.cat(keys), cache, full.slot_mapping)


def float64_choice(case, keys, q, w, k: int) -> list[list[int]]:
    """Per query token, the positions of its k best-scored visible tokens (ties: earlier first)."""
    out = []
    for t, (s, pos) in enumerate(token_positions(case.metadata)):
        logits = torch.relu(keys[s][: pos + 1].double() @ q[t].double().T * INDEX.head_dim**-0.5)  # [n, Hi]
        scores = (logits @ w[t].double()).tolist()
        out.append(sorted(range(pos + 1), key=lambda p: (-scores[p], p))[:k])
    return out


@pytest.mark.parametrize("budget", [None, 1], ids=["one_pass", "one_query_at_a_time"])
@pytest.mark.parametrize("k", [1, 6, 64])
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed", "small_page_decode"])
def test_indexer_top_k_matches_float64_selection(name, k, budget, monkeypatch):
    if budget is not None:  # long prefills score their queries in chunks
        monkeypatch.setattr("meshserve.attention.mla.indexer.SCORE_BUDGET", budget)
    case, cache = sparse_case(name)
    keys, q, w = index_inputs(case)
    store_keys(case, cache, keys)
    top = index_candidates(q, w, cache, case.metadata, k)
    want = float64_choice(case, keys, q, w, k)
    got = [[p for p in row if p >= 0] for row in top.positions.tolist()]
    assert got == want
    rows = top.local_rows()
    assert torch.equal(rows, torch.where(top.positions >= 0, top.positions, -1).to(torch.int32))


def test_fp8_index_keys_keep_the_scores():
    """FP8 keys are stored Hadamard-rotated with a per-token scale; queries are rotated alike, so
    scores stay those of the float keys up to FP8 rounding."""
    case, cache = sparse_case("fp8_e4m3")
    assert cache.index_keys.dtype == torch.float8_e4m3fn and cache.index_scale is not None
    keys, q, w = index_inputs(case)
    store_keys(case, cache, keys)
    x = torch.randn(5, INDEX.head_dim)
    torch.testing.assert_close(hadamard(x) @ hadamard(x).T, x @ x.T, rtol=1e-5, atol=1e-5)  # orthonormal
    top = index_candidates(q, w, cache, case.metadata, 64)
    for t, (s, pos) in enumerate(token_positions(case.metadata)):
        got = top.scores[t][top.positions[t] >= 0]
        logits = torch.relu(keys[s][: pos + 1] @ q[t].T * INDEX.head_dim**-0.5)
        want = (logits @ w[t]).sort(descending=True).values[: len(got)]
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.15)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize(("name", "dcp", "k"), [("mixed", 2, 6), ("chunked_prefill", 3, 9), ("fp8_e4m3", 2, 4)])
def test_dcp_ranks_merge_to_the_single_rank_choice_and_output(name, dcp, k, backend):
    one, one_cache = sparse_case(name, seed=4)
    keys, q, w = index_inputs(one)
    store_keys(one, one_cache, keys)
    top = index_candidates(q, w, one_cache, one.metadata, k)
    want_out, want_lse = run_sparse(backend, one, one_cache, top.local_rows())
    ranks = [sparse_case(name, seed=4, dcp_size=dcp, dcp_rank=r) for r in range(dcp)]
    for case, cache in ranks:
        store_keys(case, cache, keys)
    parts = [index_candidates(q, w, cache, case.metadata, k) for case, cache in ranks]
    merged = merge_candidates(parts, k)
    assert torch.equal(merged.positions, top.positions)  # the same global top-k
    outs = [run_sparse(backend, case, cache, merged.local_rows(dcp, r), dcp_size=dcp)
            for r, (case, cache) in enumerate(ranks)]  # fmt: skip
    out, lse = merge_attn_states_n(torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs]))
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_field():
    case, cache = sparse_case("mixed")
    attn = SparseMLAAttention(sparse_problem(case.scenario), backend="TORCH")
    plan = attn.plan(case.metadata)
    with pytest.raises(ConfigError, match="rows"):
        attn.forward(case.query, cache, plan, case.weights, rows=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ConfigError, match="keys"):
        write_index_keys(torch.zeros(2, 3), cache, case.metadata.slot_mapping)
    with pytest.raises(NoBackendError, match="spec.mla.indexer"):
        SparseMLAAttention(case.scenario.problem())  # a dense MLA layer
    with pytest.raises(ConfigError, match="index_topk"):
        IndexerDims(num_heads=4, head_dim=16, topk=0)
