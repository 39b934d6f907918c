"""FLASHINFER: FlashInfer's paged prefill and decode wrappers (GPU only; FlashInfer 0.7.x, and 0.5.3).

Life cycle as FlashInfer intends it: `plan` once per step calls the wrappers' own plan (host
work: page lists, work partition), `forward` per layer calls `run`. The wrappers are owned by
the backend instance and re-planned every step, so a plan object is valid until the next
`plan` call. The cache layout [num_blocks, 2, block_size, Hkv, D] is FlashInfer's "NHD" paged
layout as is; K/V are written by meshserve's Triton write_kv (FP8 quantisation included).

Which FlashInfer kernel each phase runs (FA3 prefill on Hopper, FA2 elsewhere and for FP8 K/V)
is named by flashinfer_kernels.py, never left to FlashInfer's "auto". The calls used here have
the same meaning in 0.5.3 and 0.7.4 (0.7 adds keyword options we do not need; its decode `plan`
takes keywords only, which is how we call it).

Conventions bridged here:
- FlashInfer returns the LSE in base 2; we return natural log (lse2 * ln 2).
- FP8 scales: FlashInfer takes them as host floats; ours are device tensors (no host sync per
  layer), so the key scale is folded into the query and the value scale into the output.
- Sliding window W (query sees keys with qp - kp < W) is FlashInfer's window_left = W - 1.
- DCP-sharded caches: page lists over this rank's local tokens, and a custom mask by global
  position where FlashInfer's own masks (which compare local indices) would be wrong; see
  flashinfer_dcp.py.
- Ragged prefill (the default on sm_90 and later, where it was measured; `ragged_prefill`): in a
  step whose every prefill sequence starts at position 0 (no prefix-cache hit, no later chunk),
  the keys are exactly the step's own K/V, which forward receives contiguous beside the query;
  FlashInfer's ragged wrapper (qo_indptr = kv_indptr) reads them there instead of gathering
  pages: 1.15-1.20x the paged prefill on an H100 (docs/performance.md, "Prefill from the step's
  own K/V"). Other steps use the paged wrapper; `ragged_prefill_reasons` says why. Same FlashInfer
  module as the paged prefill (one module holds both runs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from meshserve.attention.backend import (
    AttentionBackend,
    AttentionProblem,
    BackendCapabilities,
    KVCache,
    LayerParams,
    step_kv_refusals,
)
from meshserve.attention.backends.flashinfer_dcp import dcp_mask_plan, empty_decode_rows
from meshserve.attention.backends.flashinfer_kernels import decode_kernel, prefill_kernel
from meshserve.attention.metadata import AttentionMetadata, pad_table
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.core.arith import cdiv, local_len
from meshserve.core.tensors import to_device
from meshserve.errors import ConfigError, check

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
HEAD_SIZES = (64, 128, 256)  # head sizes FlashInfer's kernels are built for


@dataclass(frozen=True)
class FlashInferPlan:
    """One step: the metadata and which wrappers were planned (prefill first, then decode);
    the wrappers are those of the metadata's KV group."""

    metadata: AttentionMetadata
    num_prefill_tokens: int
    has_prefill: bool
    has_decode: bool
    prefill: object = None
    decode: object = None
    empty_rows: torch.Tensor | None = None  # [n] int64 (DCP) rows that see no key of this shard
    ragged: bool = False  # `prefill` is the ragged wrapper: prefill rows attend over forward's key/value


# From this compute capability on, all-fresh prefill steps take the ragged wrapper by default: on
# an H100 it ran 1.15-1.20x the paged one (634 / 686 against 531 / 598 TFLOP/s at 4 x 4096 and
# 1 x 16384, bench/prefill_sweep.py, 2026-12-06). Older GPUs run FA2 for both and were not measured.
RAGGED_PREFILL_MIN_CAPABILITY = (9, 0)


def _page_lists(
    table: np.ndarray | Sequence[Sequence[int]], kv_lens: Sequence[int] | np.ndarray, page: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page lists (indptr [n+1], indices, last_page_len [n]), host int32, for the
    block-table rows `table` ([n, W] int32, or n lists) and each row's KV length: row i pages
    over its first ceil(kv_lens[i] / page) blocks. Array ops only (no loop over rows).
    FlashInfer reads indptr and last_page_len on the host and copies them up itself."""
    table = table if isinstance(table, np.ndarray) else pad_table(table)
    lens = np.asarray(kv_lens, np.int64)  # [n]
    n = len(lens)
    counts = cdiv(lens, page)  # [n] pages per row
    check(n == table.shape[0] and (n == 0 or int(counts.max()) <= table.shape[1]), "block_tables",
          tuple(table.shape), f"{n} rows of at least {int(counts.max(initial=0))} blocks (the KV lengths)")
    indptr = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    used = np.arange(table.shape[1])[None, :] < counts[:, None]  # [n, W]
    indices = table[used]  # row-major: each row's pages in order
    last = (lens - (counts - 1) * page).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(np.ascontiguousarray(indices, np.int32)), torch.from_numpy(last)


class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    fused_kv_write = True  # write_kv is kernels.write_kv
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float16", "bfloat16"}),
        kv_cache_dtypes=frozenset(KVCacheDtype),
        min_block_size=16,
        max_block_size=256,
        naive_layout=False,
        paged_layout=True,
        min_head_size=64,
        max_head_size=256,
        head_size_multiple=64,
        attention_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER, AttentionType.CROSS}),
        sliding_window=True,
        learned_sinks=False,
        sink_tokens=False,
        alibi=False,
        soft_cap=True,
        mla=False,
        returns_lse=True,
        dcp=True,
        devices=frozenset({"cuda"}),
        min_compute_capability=(8, 0),
        required_packages=("flashinfer",),
        cuda_graphs=True,
        notes="FlashInfer 0.7 (0.5.3 too) paged prefill/decode wrappers: FA3 prefill on sm90 (bf16/fp16 K/V, no "
        "DCP), FA2 prefill otherwise and for FP8 K/V, FA2 decode (tensor cores for GQA groups of 4+); ALiBi"
        " not offered (FlashInfer derives its own slopes), no learned sinks or sink tokens on these "
        "wrappers, no encoder_only (no cache); CUDA graphs replay decode wrappers in FlashInfer's graph "
        "mode (fixed page-list buffers, re-planned per step); DCP: local page lists, prefill rows (and "
        "windowed decode rows) masked by global position with a custom mask; from sm_90 (ragged_prefill): "
        "the ragged prefill wrapper over the step's own K/V when no prefill of the step has cached context",
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        spec, out = problem.spec, []
        if spec.head_size not in HEAD_SIZES:
            out.append(f"head size {spec.head_size} not built into FlashInfer (supports {list(HEAD_SIZES)})")
        if spec.v_size != spec.head_size:
            out.append(f"head_size_v={spec.v_size} != head_size={spec.head_size}")
        cc = problem.compute_capability
        if problem.device == "cuda" and spec.kv_cache_dtype.is_fp8 and cc is not None and cc < (8, 9):
            out.append(f"an FP8 KV cache needs compute capability >= 8.9 (have {cc[0]}.{cc[1]})")
        return out

    def __init__(
        self, problem: AttentionProblem, *, decode_tensor_cores: bool | None = None,
        ragged_prefill: bool | None = None,
    ) -> None:  # fmt: skip
        """decode_tensor_cores: FlashInfer's tensor-core decode; default on for GQA groups of 4+.
        ragged_prefill: steps whose prefills all start at position 0 run FlashInfer's ragged
        prefill over forward's key/value (module docstring); default on from sm_90 (measured
        there), off below (not measured)."""
        super().__init__(problem)
        if ragged_prefill is None:
            cc = problem.compute_capability
            ragged_prefill = cc is not None and cc >= RAGGED_PREFILL_MIN_CAPABILITY
        self.ragged_prefill = ragged_prefill
        self.decode_tensor_cores = (
            self.spec.num_queries_per_kv >= 4 if decode_tensor_cores is None else decode_tensor_cores
        )
        # FlashInfer's own kernel per phase, named (not "auto"): flashinfer_kernels.py says why.
        self.prefill_kernel, self.decode_kernel = prefill_kernel(problem), decode_kernel(problem)
        self._workspace: torch.Tensor | None = None
        self._by_group: dict[int, tuple[object, object]] = {}
        self._ragged_by_group: dict[int, object] = {}
        self._plan_event: torch.cuda.Event | None = None  # recorded after each plan's copies were enqueued

    def _wrappers(self, device: torch.device, group: int):
        """(prefill, decode) wrappers of one KV layer group: a wrapper holds the plan it was last
        given, and a hybrid model plans this instance once per group each step. The float
        workspace is scratch for one run at a time, so the groups share it."""
        import flashinfer

        if group not in self._by_group:
            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            workspace = self._workspace
            self._by_group[group] = (
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=self.prefill_kernel),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend=self.decode_kernel
                ),
            )
        return self._by_group[group]

    def _ragged_wrapper(self, device: torch.device, group: int):
        """The ragged prefill wrapper of one KV layer group (created on first use), sharing the workspace."""
        import flashinfer

        if group not in self._ragged_by_group:
            self._wrappers(device, group)  # the shared float workspace
            self._ragged_by_group[group] = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, "NHD", backend=self.prefill_kernel
            )
        return self._ragged_by_group[group]

    def ragged_prefill_reasons(self, metadata: AttentionMetadata | None = None) -> list[str]:
        """Why a step's prefill runs the paged wrapper, not the ragged one over forward's key/value
        (empty: the ragged one). metadata: the step (its sequences' cached context, its DCP)."""
        spec, out = self.spec, []
        if not self.ragged_prefill:
            out.append("not asked for (ragged_prefill=False; the default below sm_90, where it was not measured)")
        out += step_kv_refusals(spec, max(self.problem.dcp_size, metadata.dcp_size if metadata is not None else 1))
        if metadata is not None and spec.attn_type is not AttentionType.CROSS:
            num_p = metadata.num_prefills
            cached = [s for s in range(num_p) if metadata.seq_lens_host[s] != metadata.query_lens_host[s]]
            if cached:
                out.append(f"{len(cached)} of {num_p} prefill sequences have cached context (a prefix-cache hit "
                           "or a later chunk): their keys are not all in this step's K/V")  # fmt: skip
        return out

    def plan(self, metadata: AttentionMetadata) -> FlashInferPlan:
        spec = self.spec
        device = metadata.seq_lens.device
        prefill, decode = self._wrappers(device, metadata.kv_group)
        if spec.attn_type is AttentionType.CROSS:
            check(
                metadata.encoder_seq_lens_host is not None and metadata.encoder_block_table is not None,
                "metadata.encoder_seq_lens_host",
                metadata.encoder_seq_lens_host,
                "set (with encoder_block_table) for cross attention",
            )
            kv_lens, table = metadata.encoder_seq_lens_host, metadata.encoder_block_table.cpu().numpy()
        else:
            kv_lens = metadata.seq_lens_host
            table = metadata.block_tables_host
            if table is None:
                table = metadata.block_table.cpu().numpy()
        common = self._plan_args()
        page = metadata.block_size
        num_p = metadata.num_prefills
        dcp, rank = metadata.dcp_size, metadata.dcp_rank
        empty: tuple[int, ...] = ()
        masked: dict[str, object] = {}
        if dcp > 1:
            if spec.sliding_window is not None:
                num_p = metadata.num_seqs  # decode rows need the global-position window mask too
            mplan = dcp_mask_plan(metadata.query_lens_host[:num_p], kv_lens[:num_p], dcp=dcp, rank=rank,
                                  window=spec.sliding_window)
            empty = mplan.empty_rows
            masked = dict(custom_mask=to_device(mplan.custom_mask, device), window_left=-1)
            decode_lens = [max(local_len(s, dcp, rank), 1) for s in kv_lens[num_p:]]
            first_decode_tok = sum(metadata.query_lens_host[:num_p])
            empty += tuple(first_decode_tok + i for i in empty_decode_rows(kv_lens[num_p:], dcp=dcp, rank=rank))
            kv_lens = mplan.kv_lens + tuple(decode_lens)
        # FlashInfer plans from host page lists; the page ids go to the device by a stream-ordered copy.
        self._wait_for_last_plan()
        ragged = num_p > 0 and not self.ragged_prefill_reasons(metadata)
        if ragged:
            prefill = self._ragged_wrapper(device, metadata.kv_group)
            qo_indptr = _pinned(torch.tensor([0, *_cumsum(metadata.query_lens_host[:num_p])], dtype=torch.int32))
            # Keys of sequence i are rows qo_indptr[i]..qo_indptr[i+1] of forward's key/value.
            prefill.plan(qo_indptr, qo_indptr, spec.num_heads, spec.num_kv_heads, spec.head_size,
                         causal=spec.is_causal, **common)  # fmt: skip
        elif num_p:
            indptr, indices, last = _page_lists(table[:num_p], kv_lens[:num_p], page)
            qo_indptr = torch.tensor([0, *_cumsum(metadata.query_lens_host[:num_p])], dtype=torch.int32)
            # With a custom mask FlashInfer packs it on the device (segment_packbits) with offsets it
            # derives from these lists, so they must be device tensors there (it reads them back:
            # a device sync, in DCP prefill steps only); otherwise pinned host lists.
            host = (lambda t: to_device(t, device)) if masked else _pinned
            prefill.plan(
                host(qo_indptr), host(indptr), to_device(indices, device), host(last),
                spec.num_heads, spec.num_kv_heads, spec.head_size, page,
                causal=spec.is_causal and not masked, **(common | masked),
            )  # fmt: skip
        if metadata.num_seqs > num_p:
            indptr, indices, last = _page_lists(table[num_p:], kv_lens[num_p:], page)
            decode.plan(
                _pinned(indptr), to_device(indices, device), _pinned(last),
                spec.num_heads, spec.num_kv_heads, spec.head_size, page, **common,
            )  # fmt: skip
        self._planned(device)
        num_prefill_tokens = sum(metadata.query_lens_host[:num_p])
        return FlashInferPlan(metadata, num_prefill_tokens, num_p > 0, metadata.num_seqs > num_p, prefill, decode,
                              to_device(list(empty), device, torch.int64) if empty else None, ragged)

    def _plan_args(self) -> dict[str, object]:
        from meshserve.attention.backend import DTYPES, FP8_DTYPES

        spec = self.spec
        q_dtype = DTYPES[self.problem.dtype]
        return dict(
            pos_encoding_mode="NONE",
            window_left=spec.sliding_window - 1 if spec.sliding_window is not None else -1,
            logits_soft_cap=spec.logits_soft_cap or 0.0,
            sm_scale=spec.softmax_scale,
            q_data_type=q_dtype,
            kv_data_type=FP8_DTYPES[spec.kv_cache_dtype] if spec.kv_cache_dtype.is_fp8 else q_dtype,
        )

    def plan_for_graph(self, metadata: AttentionMetadata) -> FlashInferPlan:
        """A decode wrapper of its own in FlashInfer's CUDA-graph mode: page lists live in fixed
        device buffers sized for the batch and the longest table, and `prepare_replay` re-plans
        into them before each replay."""
        import flashinfer

        check(metadata.num_prefills == 0, "metadata.num_prefills", metadata.num_prefills,
              "0 (CUDA graphs capture decode steps only)")
        # Under DCP a row may hold no key of this shard; the eager path zeroes it after the run,
        # which a captured graph would not do (and tp > 1, which DCP needs, runs eagerly anyway).
        check(metadata.dcp_size == 1, "metadata.dcp_size", metadata.dcp_size, "1 (FLASHINFER captures no DCP graphs)")
        device, b = metadata.seq_lens.device, metadata.num_decodes
        self._wrappers(device, metadata.kv_group)  # the shared float workspace
        max_pages = metadata.block_table.shape[1]
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            backend=self.decode_kernel,
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(b * max_pages, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=device),
        )  # fmt: skip
        plan = FlashInferPlan(metadata, 0, False, True, None, wrapper)
        # A valid plan to capture with: every row a padding row (one key in the null block).
        self.prepare_replay(plan, np.ones(b, np.int32), np.zeros((b, 1), np.int32))
        return plan

    def prepare_replay(self, plan: object, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        spec = self.spec
        indptr, indices, last = _page_lists(block_tables, seq_lens, plan.metadata.block_size)
        device = plan.metadata.seq_lens.device
        self._wait_for_last_plan()
        # Page ids already on the device: FlashInfer's graph mode copies host ones synchronously.
        plan.decode.plan(_pinned(indptr), to_device(indices, device), _pinned(last), spec.num_heads,
                         spec.num_kv_heads, spec.head_size, plan.metadata.block_size, non_blocking=True,
                         **self._plan_args())
        self._planned(device)

    def _wait_for_last_plan(self) -> None:
        """A wrapper's plan writes its pinned host buffer, then copies it to the device without
        waiting; under overlap scheduling the previous step's copy may not have run yet, so the
        next plan waits for it (the copy comes before that step's kernels: a short wait)."""
        if self._plan_event is not None:
            self._plan_event.synchronize()

    def _planned(self, device: torch.device) -> None:
        if device.type == "cuda":
            if self._plan_event is None:
                self._plan_event = torch.cuda.Event()
            self._plan_event.record()

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
        plan: object | None = None,
    ) -> None:
        from meshserve.attention.kernels.write_kv import write_kv

        write_kv(self.spec, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache | None,
        plan: object,
        *,
        layer: LayerParams = LayerParams(),
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(plan, FlashInferPlan):
            raise ConfigError("plan", type(plan).__name__, "the FlashInferPlan from FlashInferBackend.plan")
        check(kv_cache is not None, "kv_cache", None, "a KVCache (FLASHINFER reads K/V from the cache)")
        spec = self.spec
        num_tokens = query.shape[0]
        want = (plan.metadata.num_tokens, spec.num_heads, spec.head_size)
        check(tuple(query.shape) == want, "query", tuple(query.shape), f"shape {list(want)}")
        query = query.contiguous()
        if kv_cache.is_fp8:
            # k_scale folded into q: (q * s_k) . k_stored = q . k_real, with no host read of s_k.
            query = (query.float() * kv_cache.k_scale.to(query.device, torch.float32)).to(query.dtype)
        out = torch.empty(num_tokens, spec.num_heads, spec.v_size, dtype=query.dtype, device=query.device)
        lse = None
        if return_lse:
            lse = torch.empty(num_tokens, spec.num_heads, dtype=torch.float32, device=query.device)
        cut = plan.num_prefill_tokens
        for wrapper, planned, rows in (
            (plan.prefill, plan.has_prefill, slice(0, cut)),
            (plan.decode, plan.has_decode, slice(cut, num_tokens)),
        ):
            if not planned:
                continue
            kv = (kv_cache.data,)
            if plan.ragged and wrapper is plan.prefill:
                kv = self._step_kv(key, value, cut, query.dtype)
            wrapper.run(query[rows], *kv, out=out[rows], lse=None if lse is None else lse[rows],
                        return_lse=return_lse)  # fmt: skip
        if kv_cache.is_fp8:
            out = (out.float() * kv_cache.v_scale.to(out.device, torch.float32)).to(out.dtype)
        if plan.empty_rows is not None:  # rows that see no key of this DCP shard: nothing, for the merge
            out.index_fill_(0, plan.empty_rows, 0.0)
            if lse is not None:
                lse.index_fill_(0, plan.empty_rows, float("-inf"))
        if not return_lse:
            return out
        return out, lse.mul_(math.log(2.0))  # base 2 -> natural log

    def _step_kv(self, key, value, cut: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill rows [0, cut) of forward's key/value, for the ragged wrapper."""
        spec = self.spec
        for name, x in (("key", key), ("value", value)):
            check(x is not None and x.shape[0] >= cut and tuple(x.shape[1:]) == (spec.num_kv_heads, spec.head_size)
                  and x.dtype == dtype, name, None if x is None else (tuple(x.shape), x.dtype),
                  f"the step's new {name}s [>= {cut}, {spec.num_kv_heads}, {spec.head_size}] in {dtype} (the plan "
                  "chose the ragged prefill, which reads them instead of the cache)")  # fmt: skip
        # FlashInfer reads rows and heads by stride; the head dimension must be unit-stride.
        return tuple(x[:cut] if x.stride(-1) == 1 else x[:cut].contiguous() for x in (key, value))


def _cumsum(xs: tuple[int, ...]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor FlashInfer both reads on the host and copies to the device without waiting."""
    return t.pin_memory() if torch.cuda.is_available() else t
