"""TRITON sparse MLA: absorbed weights, each token's chosen rows gathered and attended in the latent space.

Per layer: q_lat = W_UK^T q_nope (one batched matmul), the sparse kernel (kernels/mla_sparse.py)
over the chosen rows of the paged latent cache, then o = W_UV o_lat. Prefill and decode tokens
go through the same kernel: each query token has its own index list and no causal mask.
"""

from __future__ import annotations

import dataclasses

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.backends.triton_common import decode_config, pow2, triton_reasons, with_notes
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.sparse import Output, SparseMLABackend, SparsePlan
from meshserve.core.arith import cdiv


class TritonSparseMLABackend(SparseMLABackend):
    name = "TRITON"
    capabilities = dataclasses.replace(with_notes(
        "prefill and decode: absorbed W_UK, each token's chosen latent rows gathered through the block "
        "table and attended by all heads of a block at once (online softmax), then W_UV"
    ), sparse_mla=True)

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        return triton_reasons(problem)

    def __init__(self, problem: AttentionProblem) -> None:
        super().__init__(problem)
        self.config = decode_config(self.spec.num_heads, problem.dtype, problem.device)

    def attend_rows(self, query: torch.Tensor, cache: LatentCache, plan: SparsePlan, weights: MLAWeights,
                    rows: torch.Tensor, *, return_lse: bool) -> Output:  # fmt: skip
        dn = self.dims.qk_nope_head_dim
        q_lat = weights.absorb(query[..., :dn])  # [T, H, R]
        o_lat, lse = self.attend_latent(q_lat, query[..., dn:], cache, plan, rows)
        out = weights.up_project(o_lat, query.dtype)
        return (out, lse) if return_lse else out

    def attend_latent(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, plan: SparsePlan,
                      rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The kernel part: q_lat [T, H, R], q_pe [T, H, P], rows [T, k] -> o_lat [T, H, R] (q_lat's
        dtype), LSE [T, H] float32."""
        from meshserve.attention.kernels.mla_sparse import mla_sparse_kernel

        tokens, heads, r = q_lat.shape
        p = q_pe.shape[2]
        o_lat = torch.empty(tokens, heads, r, dtype=q_lat.dtype, device=q_lat.device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=q_lat.device)
        if tokens == 0:
            return o_lat, lse
        cfg, data, table = self.config, cache.data, plan.metadata.block_table
        rows = rows.to(torch.int32).contiguous()
        scale = cache.scale.to(device=q_lat.device, dtype=torch.float32)
        mla_sparse_kernel[(cdiv(heads, cfg.block_h), tokens)](
            q_lat, q_pe, data, rows, plan.token_seq, table, o_lat, lse, scale,
            self.spec.softmax_scale, heads, rows.shape[1],
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
            data.stride(0), data.stride(1), rows.stride(0), table.stride(0),
            o_lat.stride(0), o_lat.stride(1), lse.stride(0), lse.stride(1),
            R=r, P=p, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_R=pow2(r, 16), BLOCK_P=pow2(p, 16),
            PAGE=cache.block_size, KV_FP8=cache.is_fp8, WRITE_LSE=True,
            DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return o_lat, lse
