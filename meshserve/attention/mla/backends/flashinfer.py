"""FLASHINFER MLA decode: FlashInfer's BatchMLAPagedAttentionWrapper over the latent cache (GPU).

FlashInfer attends in the latent space with absorbed weights, like TRITON's decode: we fold
W_UK into the query before `run` and apply W_UV after it. The wrapper takes the latent and the
rope parts of the cache as two tensors; ours are strided views of the one cache (FlashInfer
reads their strides), so nothing is copied. We name its kernel: FA3 (Hopper) on sm90, else FA2
(flashinfer_kernels.py says why not "auto").

FlashInfer 0.7 and 0.5.3 both work. 0.7 deprecated the flat plan arguments and the separate
q_nope/q_pe run arguments: with 0.7 we pass `metadata=MLAPlanMetadata.csr(...)`, declare the run
contract at plan time (split query and cache, natural-log LSE) and run with `query=(q_lat, q_pe)`,
`kv_cache=(latent, rope)`; with 0.5.3 the positional form it has.

FP8 (e4m3) latent caches (FlashInfer >= 0.7, sm90, bf16): the layer's one scale s is folded in,
as the standard backend does: scores use (q * s) . c_stored and the output is s * (P c_stored),
so FlashInfer's per-tensor scales stay 1.0 (host floats, no device read per layer).

What it does not do, declared below: e5m2 latent caches, FP8 before FlashInfer 0.7 or off
Hopper, shapes other than DeepSeek's kv_lora_rank 512 + rope 64 (the sizes its kernels are
built and tested for), float32, CPU. It serves decode only here: its causal mode
assumes contiguous key positions, which DCP-sharded prefill does not have.

CUDA graphs: each bucket gets a wrapper of its own in FlashInfer's graph mode (index lists in
fixed device buffers), planned before every replay from the step's host lengths and tables;
the float workspace is shared (one stream runs every wrapper). No DCP graphs (tp > 1 is eager).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshserve.attention.backend import DTYPES, FP8_DTYPES, AttentionProblem, BackendCapabilities
from meshserve.attention.backends.flashinfer_kernels import flashinfer_version, is_hopper, mla_decode_kernel
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.core.arith import cdiv
from meshserve.core.tensors import to_device
from meshserve.errors import ConfigError, check

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
KV_LORA_RANK, ROPE_DIM = 512, 64


@dataclass(frozen=True)
class FlashInferMLAPlan:
    """metadata: the decode part of the step; wrapper: the BatchMLAPagedAttentionWrapper planned
    for it (the backend's eager one, or a CUDA-graph bucket's own)."""

    metadata: AttentionMetadata
    wrapper: object


class FlashInferMLADecodeBackend(MLABackend):
    name = "FLASHINFER"
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float16", "bfloat16"}),
        kv_cache_dtypes=frozenset({KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3}),
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
        cuda_graphs=True,
        notes="decode: FlashInfer 0.7 (0.5.3 too) BatchMLAPagedAttentionWrapper, FA3 on sm90, FA2 elsewhere, "
        "absorbed weights; kv_lora_rank 512 + rope 64 only; FP8 (e4m3) latent cache with FlashInfer >= 0.7 on "
        "sm90 and bf16; CUDA graphs: a wrapper per bucket in "
        "FlashInfer's graph mode (fixed index buffers), re-planned before each replay",
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        dims, out = problem.spec.mla, []
        if dims is not None and (dims.kv_lora_rank, dims.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            out.append(
                f"kv_lora_rank={dims.kv_lora_rank}, qk_rope_head_dim={dims.qk_rope_head_dim}: FlashInfer's MLA "
                f"kernels take {KV_LORA_RANK} + {ROPE_DIM} (DeepSeek-V2/V3)"
            )
        if problem.spec.kv_cache_dtype.is_fp8:
            installed = flashinfer_version()
            if installed is not None and installed < (0, 7):
                out.append(f"an FP8 latent cache needs FlashInfer >= 0.7 (installed {installed[0]}.{installed[1]})")
            if problem.device == "cuda" and problem.compute_capability is not None and not is_hopper(problem):
                cc = problem.compute_capability
                out.append(f"FlashInfer's FP8 MLA kernels run on sm90 only (have {cc[0]}.{cc[1]})")
            if problem.dtype != "bfloat16":
                out.append(f"FlashInfer's FP8 MLA kernels take a bfloat16 query (dtype is '{problem.dtype}')")
        return out

    def __init__(self, problem: AttentionProblem) -> None:
        super().__init__(problem)
        self._wrapper = None
        self._workspace: torch.Tensor | None = None  # one float workspace: every wrapper runs on one stream
        self._plan_event: torch.cuda.Event | None = None
        self.kernel = mla_decode_kernel(problem)
        self._new_api = (flashinfer_version() or (0, 0)) >= (0, 7)

    def _float_workspace(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _get_wrapper(self, device: torch.device):
        if self._wrapper is None:
            import flashinfer

            self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._float_workspace(device),
                                                                         backend=self.kernel)
        return self._wrapper

    def _plan_wrapper(self, wrapper, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                      kv_lens: torch.Tensor, page: int) -> None:  # fmt: skip
        """One FlashInfer plan: host int32 indptrs and lengths, page ids (device, or host on CPU)."""
        dtype = DTYPES[self.problem.dtype]
        kv_dtype = FP8_DTYPES[self.spec.kv_cache_dtype] if self.spec.kv_cache_dtype.is_fp8 else dtype
        # The wrapper copies its host lists to the device from one pinned buffer without waiting;
        # under overlap scheduling the previous step's copy may still be queued: wait for it.
        if self._plan_event is not None:
            self._plan_event.synchronize()
        if self._new_api:
            import flashinfer

            wrapper.plan(
                metadata=flashinfer.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_lens),
                num_heads=self.spec.num_heads, head_dim_ckv=self.dims.kv_lora_rank,
                head_dim_kpe=self.dims.qk_rope_head_dim, page_size=page,
                causal=False,  # one decode query sees every cached row (on every DCP rank too)
                sm_scale=self.spec.softmax_scale, q_data_type=dtype, kv_data_type=kv_dtype,
                query_layout="split", kv_cache_layout="split", lse_mode="basee",
                scale_mode="kv-per-tensor" if kv_dtype != dtype else "default",
            )  # fmt: skip
        else:
            wrapper.plan(
                qo_indptr, kv_indptr, kv_indices, kv_lens, self.spec.num_heads, self.dims.kv_lora_rank,
                self.dims.qk_rope_head_dim, page,
                False,  # one decode query sees every cached row (on every DCP rank too)
                self.spec.softmax_scale, dtype, kv_dtype,
            )  # fmt: skip
        if kv_indices.is_cuda:
            if self._plan_event is None:
                self._plan_event = torch.cuda.Event()
            self._plan_event.record()

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
        counts = [cdiv(n, page) for n in kv_lens]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        pages = [metadata.block_table[i, :c] for i, c in enumerate(counts)]
        kv_indices = torch.cat(pages).to(torch.int32) if pages else torch.zeros(0, dtype=torch.int32, device=device)
        wrapper = self._get_wrapper(device)
        qo_indptr = torch.arange(metadata.num_decodes + 1, dtype=torch.int32)
        self._plan_wrapper(wrapper, qo_indptr, torch.tensor(indptr, dtype=torch.int32), kv_indices,
                           torch.tensor(kv_lens, dtype=torch.int32), page)
        return FlashInferMLAPlan(metadata, wrapper)

    def plan_for_graph(self, metadata: AttentionMetadata) -> FlashInferMLAPlan:
        """A wrapper of its own in FlashInfer's CUDA-graph mode: its index lists live in fixed
        device buffers sized for the bucket and the longest table, and `prepare_replay` re-plans
        into them before each replay (FlashInfer's work schedule is re-made there too)."""
        import flashinfer

        check(metadata.num_prefills == 0, "metadata.num_prefills", metadata.num_prefills,
              "0 (CUDA graphs capture decode steps only)")
        check(metadata.dcp_size == 1, "metadata.dcp_size", metadata.dcp_size,
              "1 (FLASHINFER MLA captures no DCP graphs)")  # fmt: skip
        device, b = metadata.seq_lens.device, metadata.num_decodes
        max_pages = metadata.block_table.shape[1]
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self._float_workspace(device), use_cuda_graph=True,
            qo_indptr=torch.arange(b + 1, dtype=torch.int32, device=device),
            kv_indptr=torch.zeros(b + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(b * max_pages, dtype=torch.int32, device=device),
            kv_len_arr=torch.ones(b, dtype=torch.int32, device=device), backend=self.kernel,
        )  # fmt: skip
        plan = FlashInferMLAPlan(metadata, wrapper)
        # A valid plan to capture with: every row a padding row (one key in the null block).
        self.prepare_replay(plan, np.ones(b, np.int32), np.zeros((b, 1), np.int32))
        return plan

    def prepare_replay(self, plan: object, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        if not isinstance(plan, FlashInferMLAPlan):
            raise ConfigError("plan", type(plan).__name__, "the FlashInferMLAPlan returned by plan_for_graph")
        page = plan.metadata.block_size
        lens = np.asarray(seq_lens, np.int64)  # [b]; no DCP in graphs: every key is local
        counts = cdiv(lens, page)
        check(int(counts.max(initial=0)) <= block_tables.shape[1], "block_tables", tuple(block_tables.shape),
              f"{len(lens)} rows of at least {int(counts.max(initial=0))} blocks (the KV lengths)")
        indptr = np.zeros(len(lens) + 1, np.int32)
        np.cumsum(counts, out=indptr[1:])
        used = np.arange(block_tables.shape[1])[None, :] < counts[:, None]  # [b, W]
        indices = np.ascontiguousarray(block_tables[used], np.int32)  # each row's pages in order
        device = plan.metadata.seq_lens.device
        # Page ids go up by a stream-ordered copy (from host memory FlashInfer would copy synchronously).
        self._plan_wrapper(plan.wrapper, _pinned(torch.arange(len(lens) + 1, dtype=torch.int32)),
                           _pinned(torch.from_numpy(indptr)), to_device(torch.from_numpy(indices), device),
                           _pinned(torch.from_numpy(lens.astype(np.int32))), page)  # fmt: skip

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
        q_pe = query[..., dn:]
        fp8 = cache.is_fp8
        if fp8:  # the cache scale s folded into the query: (q * s) . c_stored = q . c_real
            s = cache.scale.to(query.device, torch.float32)
            q_lat, q_pe = (q_lat.float() * s).to(query.dtype), (q_pe.float() * s).to(query.dtype)
        if self._new_api:
            scales = dict(ckv_scale=1.0, kpe_scale=1.0) if fp8 else {}
            o_lat, lse = plan.wrapper.run(query=(q_lat, q_pe), kv_cache=(cache.latent, cache.rope), return_lse=True,
                                          return_lse_base_on_e=True, **scales)  # fmt: skip
        else:
            o_lat, lse = plan.wrapper.run(
                q_lat, q_pe, cache.latent, cache.rope, return_lse=True, return_lse_base_on_e=True
            )
        if fp8:  # ... and into the output: P (c_stored * s) = s * (P c_stored)
            o_lat = (o_lat.float() * cache.scale.to(o_lat.device, torch.float32)).to(o_lat.dtype)
        out = weights.up_project(o_lat, query.dtype)
        return (out, lse) if return_lse else out


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor FlashInfer both reads on the host and copies to the device without waiting."""
    return t.pin_memory() if torch.cuda.is_available() else t
