"""TRITON MLA decode: absorbed weights, split-KV attention in the latent space, LSE merge.

Per layer: q_lat = W_UK^T q_nope (one batched matmul), the split-KV kernel over the latent cache
(kernels/mla_decode.py), the LSE merge of the splits (skipped with one split), then
o = W_UV o_lat. Every head reads the same cache rows, so the cache is read once per head block,
not once per head. `plan` fixes the splits and the partial buffers once per step; `forward`
reads no device value on the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.kernels.host_plans import choose_partition
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.backends.triton_common import (
    MLADecodeConfig,
    MLADecodeKernel,
    measured_decode_config,
    pow2,
    triton_reasons,
    with_notes,
)
from meshserve.attention.mla.cache import LatentCache
from meshserve.core.arith import cdiv, local_len
from meshserve.core.tensors import sm_count
from meshserve.errors import ConfigError, check


@dataclass(frozen=True)
class MLADecodePlan:
    """Per-step state of the decode sequences, shared by every layer.

    kv_lens [D] int32: cache rows this rank holds per sequence (all visible to its one query)
    partial_o [splits, D, H, kv_lora_rank] float32, partial_lse [splits, D, H] (None: one split)
    """

    metadata: AttentionMetadata
    kv_lens: torch.Tensor
    config: MLADecodeConfig
    partition: int
    num_splits: int
    partial_o: torch.Tensor | None
    partial_lse: torch.Tensor | None


class TritonMLADecodeBackend(MLABackend):
    name = "TRITON"
    capabilities = with_notes(
        "decode: absorbed W_UK, split-KV over the latent cache with all heads of a block sharing "
        "each row load, LSE merge, then W_UV; CUDA graphs: splits fixed for max_model_len, each "
        "sequence's partition from its own length in the kernel",
        cuda_graphs=True,
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        return triton_reasons(problem)

    def __init__(
        self,
        problem: AttentionProblem,
        *,
        config: MLADecodeConfig | None = None,
        partition: int | None = None,
        num_sms: int | None = None,
    ) -> None:
        """config: kernel and tile shapes (tuning; default `measured_decode_config`: the
        FlashMLA-structured kernel where it was measured, else the shared-rows one); partition:
        fixed keys per split (tests); num_sms: SMs to fill."""
        super().__init__(problem)
        if partition is not None:
            check(partition >= 1, "partition", partition, "an integer >= 1 or None")
        self.config = config or measured_decode_config(self.spec.num_heads, problem.dtype, problem.device,
                                                       self.spec.kv_cache_dtype.is_fp8, problem.compute_capability)
        self.partition = partition
        self.num_sms = num_sms

    def plan(self, metadata: AttentionMetadata) -> MLADecodePlan:
        check(
            metadata.num_prefills == 0,
            "metadata.num_prefills",
            metadata.num_prefills,
            "0: the MLA decode backend takes decode sequences only (MLAAttention splits the batch)",
        )
        cfg, spec, device = self.config, self.spec, metadata.seq_lens.device
        dcp, rank = metadata.dcp_size, metadata.dcp_rank
        kv_lens = local_len(metadata.seq_lens, dcp, rank).to(torch.int32)
        num_decodes = metadata.num_decodes
        max_keys = max((metadata.local_len(s) for s in metadata.seq_lens_host), default=1)
        block_n = cfg.block_n
        if self.partition is not None:
            partition = cdiv(self.partition, block_n) * block_n
            splits = cdiv(max(max_keys, 1), partition)
        else:
            head_blocks = cdiv(spec.num_heads, cfg.block_h) * cfg.value_split
            target = self._sm_count(device) * cfg.programs_per_sm
            partition, splits = choose_partition(max_keys, num_decodes, head_blocks, target, block_n, cfg.min_partition)
        partial_o = partial_lse = None
        if splits > 1:
            shape = (splits, num_decodes, spec.num_heads)
            partial_o = torch.empty(*shape, self.dims.kv_lora_rank, dtype=torch.float32, device=device)
            partial_lse = torch.empty(shape, dtype=torch.float32, device=device)
        return MLADecodePlan(metadata, kv_lens, cfg, partition, splits, partial_o, partial_lse)

    def plan_for_graph(self, metadata: AttentionMetadata) -> MLADecodePlan:
        """The plan for the longest lengths, its split count fixed, each sequence's partition
        derived in the kernel from its own length (partition 0), and the key counts read straight
        from the static seq_lens buffer, so that a replay sees the lengths written before it."""
        check(metadata.num_prefills == 0, "metadata.num_prefills", metadata.num_prefills,
              "0 (CUDA graphs capture decode steps only)")
        # Under DCP the local key counts are computed from seq_lens at plan time (a copy a graph
        # would not refresh); tp > 1, which DCP needs, runs eagerly anyway.
        check(metadata.dcp_size == 1, "metadata.dcp_size", metadata.dcp_size, "1 (TRITON MLA captures no DCP graphs)")
        check(metadata.seq_lens.dtype == torch.int32, "metadata.seq_lens.dtype", metadata.seq_lens.dtype,
              "torch.int32 (the kernel reads the graph's buffer directly)")  # fmt: skip
        plan = self.plan(metadata)
        return dataclasses.replace(plan, kv_lens=metadata.seq_lens, partition=0)

    def _sm_count(self, device: torch.device) -> int:
        return self.num_sms if self.num_sms is not None else sm_count(device)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(plan, MLADecodePlan):
            raise ConfigError("plan", type(plan).__name__, "the MLADecodePlan returned by this backend's plan")
        self._check_inputs(query, weights, plan.metadata.num_tokens)
        dn = self.dims.qk_nope_head_dim
        q_lat = weights.absorb(query[..., :dn])  # [D, H, R]
        o_lat, lse = self.attend_latent(q_lat, query[..., dn:], cache, plan, return_lse=return_lse)
        out = weights.up_project(o_lat, query.dtype)
        return (out, lse) if return_lse else out

    def attend_latent(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, plan: MLADecodePlan, *,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The kernel part: q_lat [D, H, R], q_pe [D, H, P] -> o_lat [D, H, R] in q_lat's dtype, LSE."""
        from meshserve.attention.kernels.mla_decode import mla_decode_kernel
        from meshserve.attention.merge import merge_attn_states_n_triton

        meta, cfg = plan.metadata, plan.config
        num_decodes, heads, r = q_lat.shape
        p = q_pe.shape[2]
        device = q_lat.device
        o_lat = torch.empty(num_decodes, heads, r, dtype=q_lat.dtype, device=device)
        lse = torch.empty(num_decodes, heads, dtype=torch.float32, device=device) if return_lse else None
        if num_decodes == 0:
            return o_lat, lse
        split = plan.num_splits > 1
        o_dst = plan.partial_o if split else o_lat.unsqueeze(0)
        l_dst = plan.partial_lse if split else (lse if return_lse else plan.kv_lens).unsqueeze(0)
        data = cache.data
        scale = cache.scale.to(device=device, dtype=torch.float32)
        args = (
            q_lat, q_pe, data, o_dst, l_dst, plan.kv_lens, meta.block_table, scale,
            self.spec.softmax_scale, plan.partition, heads,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
            data.stride(0), data.stride(1),
            o_dst.stride(0), o_dst.stride(1), o_dst.stride(2),
            l_dst.stride(0), l_dst.stride(1), l_dst.stride(-1),
            meta.block_table.stride(0),
        )  # fmt: skip
        tiles = dict(R=r, P=p, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_P=pow2(p, 16),
                     PAGE=cache.block_size, KV_FP8=cache.is_fp8, WRITE_LSE=split or return_lse,
                     DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
        head_blocks = cdiv(heads, cfg.block_h)
        if cfg.kernel is MLADecodeKernel.FLASHMLA:
            from meshserve.attention.kernels.mla_decode_fm import mla_decode_fm_kernel

            grid = (head_blocks * cfg.value_split, num_decodes, plan.num_splits)
            mla_decode_fm_kernel[grid](*args, BLOCK_V=pow2(cdiv(r, cfg.value_split), 16),
                                       VALUE_SPLIT=cfg.value_split, PREFETCH=cfg.prefetch, **tiles)  # fmt: skip
        else:
            grid = (head_blocks, num_decodes, plan.num_splits)
            mla_decode_kernel[grid](*args, BLOCK_R=pow2(r, 16), **tiles)
        if split:
            merge_attn_states_n_triton(plan.partial_o, plan.partial_lse, out=o_lat, out_lse=lse,
                                       return_lse=return_lse)  # fmt: skip
        return o_lat, lse
