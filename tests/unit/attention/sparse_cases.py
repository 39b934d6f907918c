"""Sparse MLA cases: the dense MLA scenarios with an index key cache, chosen rows, a float64 oracle.

The oracle attends, per query token, over exactly the rows it is given, expanding the latent
per head in float64 straight from kv_b_proj's weight; it shares no code with any backend.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.cache import LatentCache, write_latent_kv
from meshserve.attention.mla.sparse_layer import SparseMLAAttention
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.spec import IndexerDims
from tests.unit.attention.mla_cases import MLA_BY_NAME, MLAScenario, make_mla_case

INDEX = IndexerDims(num_heads=4, head_dim=16, topk=2048)


def sparse_problem(sc, *, index: IndexerDims = INDEX, dcp_size: int = 1, dtype: str = "float32",
                   device: str = "cpu") -> AttentionProblem:  # fmt: skip
    dense = sc.problem(dtype, device=device, dcp_size=dcp_size)
    dims = replace(sc.dims, indexer=index)
    spec = mla_spec(sc.num_heads, dims, scale=dense.spec.softmax_scale, kv_cache_dtype=sc.kv_cache_dtype)
    return replace(dense, spec=spec)


def sparse_case(sc: MLAScenario | str, *, seed: int = 0, dcp_size: int = 1, dcp_rank: int = 0,
                dtype: torch.dtype = torch.float32, device: str = "cpu", index: IndexerDims = INDEX):  # fmt: skip
    """The dense case, the new tokens' latent written, with an (empty) index key cache attached."""
    sc = MLA_BY_NAME[sc] if isinstance(sc, str) else sc
    case = make_mla_case(sc, seed=seed, dcp_size=dcp_size, dcp_rank=dcp_rank, dtype=dtype, device=device)
    write_latent_kv(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    dims = replace(case.scenario.dims, indexer=index)
    cache = LatentCache.over(case.cache.data, dims, kv_cache_dtype=case.scenario.kv_cache_dtype,
                             scale=case.cache.scale, dtype=dtype)  # fmt: skip
    return case, cache


def token_positions(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(sequence, position) of every query token."""
    out = []
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        out += [(s, seq_len - q_len + j) for j in range(q_len)]
    return out


def chosen_rows(meta: AttentionMetadata, k: int | None, seed: int = 0) -> torch.Tensor:  # on the CPU
    """[T, width] every visible row (k None) or k random visible rows per token, -1 padded (dcp=1)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(meta.seq_lens_host)
    rows = torch.full((meta.num_tokens, width), -1, dtype=torch.int32)
    for t, (_, pos) in enumerate(token_positions(meta)):
        visible = torch.randperm(pos + 1, generator=gen)[:k] if k is not None else torch.arange(pos + 1)
        rows[t, : len(visible)] = visible.to(torch.int32)
    return rows


def sparse_oracle(case, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MLA of each token over its rows only: per-head expansion, straight from kv_b_proj."""
    sc, dims = case.scenario, case.scenario.dims
    r, dn, heads = dims.kv_lora_rank, dims.qk_nope_head_dim, sc.num_heads
    w = case.kv_b.double().cpu().view(heads, dn + dims.v_head_dim, r)
    rows = rows.cpu()
    outs, lses = [], []
    for t, (s, _) in enumerate(token_positions(case.metadata)):
        picked = case.rows64[s][rows[t][rows[t] >= 0].long()]
        o_row, lse_row = [], []
        for h in range(heads):
            k = torch.cat([picked[:, :r] @ w[h, :dn].T, picked[:, r:]], dim=-1)
            logits = (k @ case.query[t, h].double().cpu()) * case.spec.softmax_scale
            lse = torch.logsumexp(logits, 0)
            o_row.append(torch.exp(logits - lse) @ (picked[:, :r] @ w[h, dn:].T))
            lse_row.append(lse)
        outs.append(torch.stack(o_row))
        lses.append(torch.stack(lse_row))
    return torch.stack(outs), torch.stack(lses)


def run_sparse(backend: str, case, cache, rows, *, dcp_size: int = 1, index: IndexerDims = INDEX):
    dtype = str(case.query.dtype).removeprefix("torch.")
    problem = sparse_problem(case.scenario, index=index, dcp_size=dcp_size, dtype=dtype,
                             device=case.query.device.type)  # fmt: skip
    attn = SparseMLAAttention(problem, backend=backend)
    plan = attn.plan(case.metadata)
    return attn.forward(case.query, cache, plan, case.weights, rows=rows.to(case.query.device), return_lse=True)


def full_metadata(case) -> AttentionMetadata:
    """Metadata writing every token of every sequence (context and new) on this case's rank."""
    meta = case.metadata
    bs = case.scenario.block_size
    tables = [meta.block_table[s, : -(-meta.local_len(n) // bs)].tolist() for s, n in enumerate(meta.seq_lens_host)]
    return AttentionMetadata.build(query_lens=meta.seq_lens_host, seq_lens=meta.seq_lens_host, block_tables=tables,
                                   block_size=bs, dcp_size=meta.dcp_size, dcp_rank=meta.dcp_rank)  # fmt: skip
