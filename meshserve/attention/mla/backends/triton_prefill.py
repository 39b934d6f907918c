"""TRITON MLA prefill: expand each prefill sequence's cached latent to per-head K/V, then flash.

Per layer: gather the sequences' cache rows (the new tokens are already written), two matmuls
give k_nope = c W_UK^T and v = c W_UV^T for every head, and the varlen flash kernel
(kernels/mla_prefill.py) attends with causal masks on global positions, so chunked prefill and
DCP-sharded caches need nothing special. The rope key stays one row per token for all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.kernels.host_plans import mla_prefill_tiles
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.backends.triton_common import (
    MLAPrefillConfig,
    pow2,
    prefill_config,
    triton_reasons,
    with_notes,
)
from meshserve.attention.mla.cache import LatentCache
from meshserve.errors import ConfigError


@dataclass(frozen=True)
class MLAPrefillPlan:
    """Per-step state of the prefill sequences.

    slots     [N] int64  cache rows of every sequence's local tokens, sequence after sequence
    kv_start  [S + 1] int32  offsets of each sequence's rows in that packing
    tile_seq, tile_q0  [num_tiles] int32  programs, longest first
    """

    metadata: AttentionMetadata
    slots: torch.Tensor
    kv_start: torch.Tensor
    tile_seq: torch.Tensor
    tile_q0: torch.Tensor
    config: MLAPrefillConfig


class TritonMLAPrefillBackend(MLABackend):
    name = "TRITON"
    capabilities = with_notes(
        "prefill: expands the cached latent to per-head K/V (two matmuls), varlen causal flash "
        "attention with the rope key shared by all heads"
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        return triton_reasons(problem)

    def __init__(self, problem: AttentionProblem, *, config: MLAPrefillConfig | None = None) -> None:
        super().__init__(problem)
        self.config = config or prefill_config(problem.dtype, problem.device)

    def plan(self, metadata: AttentionMetadata) -> MLAPrefillPlan:

        device = metadata.seq_lens.device
        local = [metadata.local_len(s) for s in metadata.seq_lens_host]
        starts = [0]
        for n in local:
            starts.append(starts[-1] + n)
        bs = metadata.block_size
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(local), device=device), torch.tensor(local, device=device), output_size=starts[-1]
        )
        kv_start = torch.tensor(starts, dtype=torch.int32, device=device)
        j = torch.arange(starts[-1], device=device) - kv_start[seq_of_row]
        slots = metadata.block_table[seq_of_row, j // bs].long() * bs + j % bs
        seqs, q0s = mla_prefill_tiles(metadata.query_lens_host, metadata.seq_lens_host, self.config.block_m)
        tile_seq = torch.tensor(seqs, dtype=torch.int32, device=device)
        tile_q0 = torch.tensor(q0s, dtype=torch.int32, device=device)
        return MLAPrefillPlan(metadata, slots, kv_start, tile_seq, tile_q0, self.config)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from meshserve.attention.kernels.mla_prefill import mla_prefill_kernel

        if not isinstance(plan, MLAPrefillPlan):
            raise ConfigError("plan", type(plan).__name__, "the MLAPrefillPlan returned by this backend's plan")
        meta, cfg, dims = plan.metadata, plan.config, self.dims
        self._check_inputs(query, weights, meta.num_tokens)
        tokens, heads = query.shape[:2]
        out = torch.empty(tokens, heads, dims.v_head_dim, dtype=query.dtype, device=query.device)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=query.device)
        if tokens == 0 or plan.slots.numel() == 0:  # no key on this (DCP) rank: an empty part of the merge
            out.zero_()
            lse.fill_(float("-inf"))
            return (out, lse) if return_lse else out
        rows = cache.data.view(-1, cache.data.shape[2])[plan.slots]  # [N, R + P]
        if cache.is_fp8:
            rows = rows.float() * cache.scale.float()
        rows = rows.to(query.dtype)
        k_nope, v = weights.expand(rows[:, : dims.kv_lora_rank])  # [N, H, DN], [N, H, DV]
        k_pe = rows[:, dims.kv_lora_rank :]
        query = query if query.stride(-1) == 1 else query.contiguous()
        dn, dr, dv = dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
        mla_prefill_kernel[(heads, plan.tile_seq.numel())](
            query, k_nope, k_pe, v, out, lse, plan.tile_seq, plan.tile_q0, meta.query_start_loc, plan.kv_start,
            meta.seq_lens, self.spec.softmax_scale, meta.dcp_size, meta.dcp_rank,
            query.stride(0), query.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            DN=dn, DR=dr, DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DN=pow2(dn, 16),
            BLOCK_DR=pow2(dr, 16), BLOCK_DV=pow2(dv, 16), RETURN_LSE=return_lse,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return (out, lse) if return_lse else out
