"""Named MLA batch scenarios, concrete cases (optionally one DCP rank's shard), and a float64 oracle.

The cache is filled with noise and the block tables are shuffled, so a paging bug or a read past
a sequence's end shows up as a wrong number. The oracle expands the latent per head in float64
straight from kv_b_proj's weight, one sequence at a time, with explicit causal positions; it
shares no code with any backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshserve.attention.backend import FP8_DTYPES, AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.cache import LatentCache, write_latent_kv_torch
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.spec import AttentionSpec, KVCacheDtype, MLADims

DIMS = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
ODD_DIMS = MLADims(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=20)
FP8_SCALE = 0.03


@dataclass(frozen=True)
class MLAScenario:
    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int = 4
    dims: MLADims = DIMS
    block_size: int = 16
    max_model_len: int = 512
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    extra: dict = field(default_factory=dict)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    def spec(self) -> AttentionSpec:
        scale = 0.7 * self.dims.qk_head_dim**-0.5  # not the default, so a backend ignoring it fails
        return mla_spec(self.num_heads, self.dims, scale=scale, kv_cache_dtype=self.kv_cache_dtype)

    def problem(self, dtype: str = "float32", device: str = "cpu", dcp_size: int = 1) -> AttentionProblem:
        cc = torch.cuda.get_device_capability() if device == "cuda" else None
        return AttentionProblem(spec=self.spec(), dtype=dtype, block_size=self.block_size,
                                max_model_len=self.max_model_len, device=device, compute_capability=cc,
                                needs_lse=True, dcp_size=dcp_size)  # fmt: skip


E4M3 = KVCacheDtype.FP8_E4M3
MLA_SCENARIOS = (
    MLAScenario("small_decode", (1, 1, 1), (4, 16, 33)),
    MLAScenario("long_decode", (1, 1), (300, 257)),
    MLAScenario("many_heads_decode", (1, 1), (40, 9), num_heads=20),
    MLAScenario("small_page_decode", (1, 1, 1), (3, 17, 30), block_size=4),
    MLAScenario("prefill", (13, 7), (0, 0)),
    MLAScenario("chunked_prefill", (9, 16, 1), (23, 40, 17)),
    MLAScenario("mixed", (7, 12, 1, 1), (0, 0, 20, 45)),
    MLAScenario("odd_dims", (6, 1, 1), (10, 21, 40), dims=ODD_DIMS),
    MLAScenario("fp8_e4m3", (6, 1, 1), (10, 40, 18), kv_cache_dtype=E4M3),
)
MLA_BY_NAME = {s.name: s for s in MLA_SCENARIOS}


@dataclass
class MLACase:
    scenario: MLAScenario
    spec: AttentionSpec
    query: torch.Tensor  # [T, H, nope + rope]
    latent: torch.Tensor  # [T, kv_lora_rank] the new tokens' latent
    k_pe: torch.Tensor  # [T, rope]
    cache: LatentCache  # earlier context written; the new tokens are not
    metadata: AttentionMetadata
    kv_b: torch.Tensor  # kv_b_proj.weight [H * (nope + v), kv_lora_rank]
    weights: MLAWeights
    rows64: list[torch.Tensor]  # per sequence, every token's [latent | k_pe] as the cache holds it


def make_mla_case(
    sc: MLAScenario, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
    dcp_size: int = 1, dcp_rank: int = 0,
) -> MLACase:  # fmt: skip
    """The scenario's tensors. The data depend on `seed` only; DCP arguments choose the shard stored."""
    gen = torch.Generator().manual_seed(seed)
    dims, heads = sc.dims, sc.num_heads
    r, p = dims.kv_lora_rank, dims.qk_rope_head_dim
    rows = [torch.randn(n, r + p, generator=gen).to(dtype).float() for n in sc.seq_lens]
    query = torch.cat([torch.randn(q, heads, dims.qk_head_dim, generator=gen) for q in sc.query_lens])
    kv_b = torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), r, generator=gen) / math.sqrt(r)
    kv_b = kv_b.to(dtype)

    # This rank's tokens in shuffled physical blocks with spares (another generator per rank).
    layout = torch.Generator().manual_seed(1000 * seed + 17 * dcp_size + dcp_rank)
    bs = sc.block_size
    local = [(n - dcp_rank + dcp_size - 1) // dcp_size for n in sc.seq_lens]
    needed = [-(-n // bs) for n in local]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=layout).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    cache = LatentCache.allocate(num_blocks, bs, dims, dtype=dtype, kv_cache_dtype=sc.kv_cache_dtype,
                                 device=device, scale=FP8_SCALE if sc.kv_cache_dtype.is_fp8 else 1.0)  # fmt: skip
    noise = torch.randn(cache.data.shape, generator=layout) * 100  # garbage outside the sequences
    cache.data.copy_((noise / cache.scale.cpu()).to(cache.data.dtype))
    context_meta = AttentionMetadata.build(
        query_lens=[max(c, 1) for c in sc.context_lens], seq_lens=[max(c, 1) for c in sc.context_lens],
        block_tables=tables, block_size=bs, dcp_size=dcp_size, dcp_rank=dcp_rank,
    )  # fmt: skip
    # Earlier context goes in with the reference writer; the new tokens are left to the test.
    ctx_rows = torch.cat([x[: max(c, 1)] for x, c in zip(rows, sc.context_lens)])
    keep = torch.cat([torch.arange(max(c, 1)) < c for c in sc.context_lens])
    slots = torch.where(keep, context_meta.slot_mapping, -1)
    write_latent_kv_torch(ctx_rows[:, :r].to(dtype).to(device), ctx_rows[:, r:].to(dtype).to(device), cache,
                          slots.to(device))  # fmt: skip
    metadata = AttentionMetadata.build(query_lens=sc.query_lens, seq_lens=sc.seq_lens, block_tables=tables,
                                       block_size=bs, device=device, dcp_size=dcp_size, dcp_rank=dcp_rank)
    new = torch.cat([x[c:] for x, c in zip(rows, sc.context_lens)])
    rows64 = [_as_stored(x, sc.kv_cache_dtype) for x in rows]
    kv_b = kv_b.to(device)
    return MLACase(
        sc, sc.spec(), query.to(dtype).to(device), new[:, :r].to(dtype).to(device), new[:, r:].to(dtype).to(device),
        cache, metadata, kv_b, MLAWeights.from_kv_b_proj(kv_b, heads, dims), rows64,
    )  # fmt: skip


def _as_stored(x: torch.Tensor, kv_dtype: KVCacheDtype) -> torch.Tensor:
    if kv_dtype.is_fp8:
        return (x.double() / FP8_SCALE).to(FP8_DTYPES[kv_dtype]).double() * FP8_SCALE
    return x.double()


def mla_oracle(case: MLACase) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 MLA with per-head expansion, as HF computes it. Returns out [T, H, v], lse [T, H]."""
    sc, dims, heads = case.scenario, case.scenario.dims, case.scenario.num_heads
    r, dn = dims.kv_lora_rank, dims.qk_nope_head_dim
    w = case.kv_b.double().cpu().view(heads, dn + dims.v_head_dim, r)
    q64 = case.query.double().cpu()
    scale = case.spec.softmax_scale
    outs, lses, start = [], [], 0
    for s, q_len in enumerate(sc.query_lens):
        rows = case.rows64[s]
        latent, k_pe = rows[:, :r], rows[:, r:]
        context = sc.context_lens[s]
        for j in range(q_len):
            qp = context + j
            visible = slice(0, qp + 1)  # causal: keys at positions 0..qp
            o_row, lse_row = [], []
            for h in range(heads):
                k = torch.cat([latent[visible] @ w[h, :dn].T, k_pe[visible]], dim=-1)
                v = latent[visible] @ w[h, dn:].T
                logits = (k @ q64[start + j, h]) * scale
                m = logits.max()
                weights = torch.exp(logits - m)
                o_row.append(weights @ v / weights.sum())
                lse_row.append(float(m + torch.log(weights.sum())))
            outs.append(torch.stack(o_row))
            lses.append(torch.tensor(lse_row, dtype=torch.float64))
        start += q_len
    return torch.stack(outs), torch.stack(lses)


def run_mla(backend, case: MLACase, *, write: bool = True):
    """Write the new tokens with the production writer, plan, forward with the LSE."""
    from meshserve.attention.mla.cache import write_latent_kv

    if write:
        write_latent_kv(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    plan = backend.plan(case.metadata)
    return backend.forward(case.query, case.cache, plan, case.weights, return_lse=True)
