"""FLASHINFER MLA decode: FlashInfer's BatchMLAPagedAttentionWrapper over the latent cache (GPU).

FlashInfer attends in the latent space with absorbed weights, like TRITON's decode: we fold
W_UK into the query before `run` and apply W_UV after it. The wrapper takes the latent and the
rope parts of the cache as two tensors; ours are strided views of the one cache (FlashInfer
reads their strides), so nothing is copied. On sm90 it picks its FA3 (Hopper) kernel, else FA2.

What it does not do, declared below: FP8 latent caches (not wired: FlashInfer's MLA takes no
dequantisation scale), shapes other than DeepSeek's kv_lora_rank 512 + rope 64 (the sizes its
kernels are built and tested for), float32, CPU. It serves decode only here: its causal mode
assumes contiguous key positions, which DCP-sharded prefill does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionProblem, BackendCapabilities
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.errors import ConfigError, check

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
KV_LORA_RANK, ROPE_DIM = 512, 64


@dataclass(frozen=True)
class FlashInferMLAPlan:
    metadata: AttentionMetadata


class FlashInferMLADecodeBackend(MLABackend):
    name = "FLASHINFER"
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float16", "bfloat16"}),
        kv_cache_dtypes=frozenset({KVCacheDtype.AUTO}),
        min_block_size=1,
        max_block_size=256,
        naive_layout=False,
        paged_layout=True,
        min_head_size=1,
        max_head_size=1024,
        head_size_multiple=1,
        attention_types=frozenset({AttentionType.DECODER}),
        sliding_window=False,
        learned_sinks=False,
        sink_tokens=False,
        alibi=False,
        soft_cap=False,
        mla=True,
        returns_lse=True,
        dcp=True,
        devices=frozenset({"cuda"}),
        min_compute_capability=(8, 0),
        required_packages=("flashinfer",),
        notes="decode: FlashInfer 0.5.3 BatchMLAPagedAttentionWrapper (FA3 on sm90), absorbed weights; "
        "kv_lora_rank 512 + rope 64 only, no FP8 latent cache",
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        dims = problem.spec.mla
        if dims is not None and (dims.kv_lora_rank, dims.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            return [
                f"kv_lora_rank={dims.kv_lora_rank}, qk_rope_head_dim={dims.qk_rope_head_dim}: FlashInfer's MLA "
                f"kernels take {KV_LORA_RANK} + {ROPE_DIM} (DeepSeek-V2/V3)"
            ]
        return []

    def __init__(self, problem: AttentionProblem) -> None:
        super().__init__(problem)
        self._wrapper = None

    def _get_wrapper(self, device: torch.device):
        if self._wrapper is None:
            import flashinfer

            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        return self._wrapper

    def plan(self, metadata: AttentionMetadata) -> FlashInferMLAPlan:
        check(
            metadata.num_prefills == 0,
            "metadata.num_prefills",
            metadata.num_prefills,
            "0: the FLASHINFER MLA backend takes decode sequences only (MLAAttention splits the batch)",
        )
        device = metadata.seq_lens.device
        page = metadata.block_size
        kv_lens = [metadata.local_len(s) for s in metadata.seq_lens_host]
        counts = [-(-n // page) for n in kv_lens]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        pages = [metadata.block_table[i, :c] for i, c in enumerate(counts)]
        kv_indices = torch.cat(pages).to(torch.int32) if pages else torch.zeros(0, dtype=torch.int32, device=device)
        num = metadata.num_decodes
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[self.problem.dtype]
        self._get_wrapper(device).plan(
            torch.arange(num + 1, dtype=torch.int32),
            torch.tensor(indptr, dtype=torch.int32),
            kv_indices,
            torch.tensor(kv_lens, dtype=torch.int32),
            self.spec.num_heads,
            self.dims.kv_lora_rank,
            self.dims.qk_rope_head_dim,
            page,
            False,  # one decode query sees every cached row (on every DCP rank too)
            self.spec.softmax_scale,
            dtype,
            dtype,
        )
        return FlashInferMLAPlan(metadata)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(plan, FlashInferMLAPlan):
            raise ConfigError("plan", type(plan).__name__, "the FlashInferMLAPlan returned by this backend's plan")
        self._check_inputs(query, weights, plan.metadata.num_tokens)
        dn = self.dims.qk_nope_head_dim
        q_lat = weights.absorb(query[..., :dn]).contiguous()  # the output is allocated like q_lat
        o_lat, lse = self._get_wrapper(query.device).run(
            q_lat, query[..., dn:], cache.latent, cache.rope, return_lse=True, return_lse_base_on_e=True
        )
        out = weights.up_project(o_lat, query.dtype)
        return (out, lse) if return_lse else out
