"""TRITON: paged flash attention in Triton kernels (GPU; CPU under TRITON_INTERPRET=1 for tests).

Per step, `plan` builds the prefill tile list and the decode split sizes on the host (and the
decode workspace), once for every layer. Per layer, `forward` launches at most three kernels:
varlen prefill over the prefill sequences, split-KV decode over the decode sequences, and the
LSE merge of the decode splits (skipped when one split suffices). Nothing in `forward` reads a
device value on the host, so a decode step can be captured in a CUDA graph and replayed after
the metadata tensors (seq_lens, block_table, query_start_loc) are updated in place, as long as
the lengths stay within those the plan was made for.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from meshserve.attention.backend import (
    AttentionBackend,
    AttentionProblem,
    BackendCapabilities,
    KVCache,
    LayerParams,
    step_kv_refusals,
)
from meshserve.attention.kernels.config import (
    GLUON_FRESH_CONFIG,
    LONG_PREFILL_QUERIES,
    DecodeConfig,
    PrefillConfig,
    default_decode_config,
    default_prefill_config,
    fresh_prefill_config,
    long_prefill_config,
)
from meshserve.attention.kernels.host_plans import (
    choose_partition,
    descriptor_reasons,
    dot_precision,
    prefill_tiles,
    row_descriptor_reasons,
)
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.core.arith import cdiv
from meshserve.core.tensors import sm_count, to_device
from meshserve.errors import ConfigError, check


@dataclass(frozen=True)
class TritonPlan:
    """Per-step state shared by every layer.

    kv_lens      [S] int32  keys each sequence attends over (encoder lengths for cross attention)
    positions    [S] int32  seq_lens: query j of sequence s sits at positions[s] - query_len + j
    block_table  [S, max_blocks] int32 (the encoder table for cross attention)
    tile_seq, tile_q0  [num_tiles] int32  prefill programs reading K/V from the cache, longest first
    fresh_tile_seq, fresh_tile_q0  [num_fresh_tiles] int32  prefill programs of sequences with no
                 cached context, which read the step's own K/V (PrefillConfig.fresh_kv), longest first
    partial_o    [splits, num_decodes, H, Dv] float32, partial_lse [splits, num_decodes, H]
    """

    metadata: AttentionMetadata
    kv_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    prefill: PrefillConfig
    tile_seq: torch.Tensor
    tile_q0: torch.Tensor
    decode: DecodeConfig
    partition: int
    num_splits: int
    partial_o: torch.Tensor | None
    partial_lse: torch.Tensor | None
    fresh_tile_seq: torch.Tensor | None = None
    fresh_tile_q0: torch.Tensor | None = None
    fresh_prefill: PrefillConfig | None = None  # the fresh tiles' config
    # Host lengths of the prefill sequences (query lengths 0 but for the fresh ones, keys), for
    # paged_fresh_tiles.
    fresh_query_lens: tuple[int, ...] = ()
    prefill_kv_lens: tuple[int, ...] = ()
    causal: bool = True

    @functools.cached_property
    def paged_fresh_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile_seq, tile_q0) of the fresh sequences as ordinary paged tiles of `prefill`, for a
        forward whose key/value cannot stand in for the cache (fresh_input_reasons). Made on first
        use, once per step: the engine always passes its K/V and never needs them."""
        seqs, q0s = prefill_tiles(self.fresh_query_lens, self.prefill_kv_lens, self.prefill.block_m, self.causal)
        device = self.tile_seq.device
        return to_device(seqs, device, torch.int32), to_device(q0s, device, torch.int32)


class TritonBackend(AttentionBackend):
    name = "TRITON"
    fused_kv_write = True  # write_kv is kernels.write_kv
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        kv_cache_dtypes=frozenset(KVCacheDtype),
        min_block_size=16,
        max_block_size=256,
        naive_layout=True,
        paged_layout=True,
        min_head_size=1,
        max_head_size=256,
        head_size_multiple=1,
        attention_types=frozenset(AttentionType),
        sliding_window=True,
        learned_sinks=True,
        sink_tokens=True,
        alibi=True,
        soft_cap=True,
        mla=False,
        returns_lse=True,
        dcp=True,
        devices=frozenset({"cuda", "cpu"}),
        min_compute_capability=(8, 0),
        required_packages=("triton",),
        cuda_graphs=True,
        notes="paged flash attention: varlen prefill, split-KV decode with GQA-shared KV loads, LSE merge; "
        "the naive layout runs through the same kernels (one block per request); DCP shards are read "
        "in local slots with masks, window and ALiBi by global position; prefills with no cached context read "
        "the step's own K/V instead of the pages (sm_90+ by default: PrefillConfig.fresh_kv)",
    )

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        spec, out = problem.spec, []
        if problem.device == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                out.append("on CPU the Triton kernels run only in the interpreter (TRITON_INTERPRET=1)")
            if problem.dtype == "bfloat16":
                out.append("dtype 'bfloat16' on CPU: the Triton interpreter computes bf16 arithmetic wrongly")
        cc = problem.compute_capability
        if problem.device == "cuda" and spec.kv_cache_dtype.is_fp8 and cc is not None and cc < (8, 9):
            out.append(f"an FP8 KV cache needs compute capability >= 8.9 (have {cc[0]}.{cc[1]})")
        if spec.uses_kv_cache and spec.v_size != spec.head_size:
            out.append(
                f"head_size_v={spec.v_size} != head_size={spec.head_size}: the cache holds K and V "
                "with one head size"
            )
        return out

    def __init__(
        self,
        problem: AttentionProblem,
        *,
        decode_partition: int | None = None,
        num_sms: int | None = None,
        prefill_config: PrefillConfig | None = None,
        decode_config: DecodeConfig | None = None,
    ) -> None:
        """decode_partition: fixed keys per decode split (tests, tuning); default chosen per step.
        num_sms: multiprocessors the split heuristic fills; default read from the device (8 on CPU).
        prefill_config / decode_config: tile shapes (tuning); default from kernels/config.py."""
        super().__init__(problem)
        if decode_partition is not None:
            check(decode_partition >= 1, "decode_partition", decode_partition, "an integer >= 1 or None")
        self.decode_partition = decode_partition
        self.num_sms = num_sms
        args = (self.spec.head_size, problem.dtype, problem.device, self.spec.kv_cache_dtype.is_fp8)
        cc, page = problem.compute_capability, problem.block_size
        self.prefill_cfg = prefill_config or default_prefill_config(*args, page=page, compute_capability=cc)
        self.long_prefill_cfg = None if prefill_config else long_prefill_config(*args, cc, page=page)
        # Tiles of fresh sequences (fresh_cfg): a given config that asks for them, else the measured default:
        # on sm_90 the Gluon kernel where it serves the problem (it measured faster, docs/performance.md),
        # for bf16 (the dtype its GPU tests ran in; fp16 takes it when a config asks).
        self.default_fresh_cfg = None if prefill_config else fresh_prefill_config(*args, cc)
        self._gluon_refusals = self._gluon_problem_reasons()  # fixed by the problem: decided once, not per forward
        if self.default_fresh_cfg is not None and problem.dtype == "bfloat16" and not self._gluon_refusals:
            self.default_fresh_cfg = GLUON_FRESH_CONFIG
        self.decode_cfg = decode_config or default_decode_config(*args)

    # ----------------------------------------------------------------------------------- plan
    def plan(self, metadata: AttentionMetadata) -> TritonPlan:
        spec = self.spec
        device = metadata.seq_lens.device
        if spec.attn_type is AttentionType.CROSS:
            check(
                metadata.encoder_seq_lens_host is not None and metadata.encoder_block_table is not None,
                "metadata.encoder_seq_lens_host",
                metadata.encoder_seq_lens_host,
                "set (with encoder_block_table) for cross attention",
            )
            kv_host = metadata.encoder_seq_lens_host
            kv_lens = to_device(kv_host, device, torch.int32)
            block_table = metadata.encoder_block_table
        elif spec.attn_type is AttentionType.ENCODER_ONLY:
            kv_host = metadata.query_lens_host
            kv_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).to(torch.int32)
            block_table = metadata.block_table
        else:
            kv_host = metadata.seq_lens_host
            kv_lens = metadata.seq_lens
            block_table = metadata.block_table

        # ENCODER_ONLY has no cache: every sequence goes through the prefill kernel.
        num_prefills = metadata.num_seqs if not spec.uses_kv_cache else metadata.num_prefills
        num_decodes = metadata.num_seqs - num_prefills
        cfg = self.prefill_cfg
        if self.long_prefill_cfg and max(metadata.query_lens_host[:num_prefills], default=0) >= LONG_PREFILL_QUERIES:
            cfg = self.long_prefill_cfg
        query_lens = metadata.query_lens_host[:num_prefills]
        kv_prefill = tuple(kv_host[:num_prefills])
        # Fresh sequences (no cached context) read the step's K/V, in tiles of their own config.
        fcfg = self.fresh_cfg()
        fresh = [False] * num_prefills
        if fcfg is not None and not self.fresh_kv_reasons(fcfg, dcp_size=metadata.dcp_size):
            fresh = [q == s for q, s in zip(query_lens, metadata.seq_lens_host)]
        seqs, q0s = prefill_tiles(tuple(0 if f else q for q, f in zip(query_lens, fresh)), kv_prefill, cfg.block_m,
                                  spec.is_causal)  # fmt: skip
        # Stream-ordered copies: planning never waits for the device (overlap scheduling).
        tile_seq = to_device(seqs, device, torch.int32)
        tile_q0 = to_device(q0s, device, torch.int32)
        fresh_seq = fresh_q0 = None
        fresh_query_lens = tuple(q if f else 0 for q, f in zip(query_lens, fresh))
        if any(fresh):
            fseqs, fq0s = prefill_tiles(fresh_query_lens, kv_prefill, fcfg.block_m, spec.is_causal)
            fresh_seq, fresh_q0 = to_device(fseqs, device, torch.int32), to_device(fq0s, device, torch.int32)

        partition, splits, partial_o, partial_lse = 0, 0, None, None
        if num_decodes:
            max_keys = max(kv_host[num_prefills:])
            if spec.sliding_window is not None:
                max_keys = min(max_keys, spec.sliding_window)
            max_keys = cdiv(max_keys, metadata.dcp_size)  # keys one DCP rank holds
            if self.decode_partition is not None:
                partition = self.decode_partition
                splits = cdiv(max_keys, partition)
            else:
                partition, splits = _choose_partition(
                    max_keys, num_decodes, spec.num_kv_heads, self._sm_count(device), self.decode_cfg
                )
            if splits > 1:
                shape = (splits, num_decodes, spec.num_heads)
                partial_o = torch.empty(*shape, spec.v_size, dtype=torch.float32, device=device)
                partial_lse = torch.empty(shape, dtype=torch.float32, device=device)
        return TritonPlan(
            metadata, kv_lens, metadata.seq_lens, block_table, cfg, tile_seq, tile_q0,
            self.decode_cfg, partition, splits, partial_o, partial_lse, fresh_seq, fresh_q0,
            fcfg if fresh_seq is not None else None, fresh_query_lens, kv_prefill, spec.is_causal,
        )  # fmt: skip

    def plan_for_graph(self, metadata: AttentionMetadata) -> TritonPlan:
        """The plan for the longest lengths, with the split count fixed and each sequence's
        partition derived in the kernel from its own length (partition 0)."""
        check(metadata.num_prefills == 0, "metadata.num_prefills", metadata.num_prefills,
              "0 (CUDA graphs capture decode steps only)")
        plan = self.plan(metadata)
        return dataclasses.replace(plan, partition=0)

    def _sm_count(self, device: torch.device) -> int:
        return self.num_sms if self.num_sms is not None else sm_count(device)

    # ------------------------------------------------------------------------------- write_kv
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
        plan: object | None = None,
    ) -> None:
        from meshserve.attention.kernels.write_kv import write_kv

        write_kv(self.spec, key, value, kv_cache, slot_mapping)

    # -------------------------------------------------------------------------------- forward
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
        if not isinstance(plan, TritonPlan):
            raise ConfigError("plan", type(plan).__name__, "the TritonPlan returned by TritonBackend.plan")
        spec = self.spec
        meta = plan.metadata
        num_tokens = query.shape[0]
        check(
            tuple(query.shape) == (meta.num_tokens, spec.num_heads, spec.head_size),
            "query",
            tuple(query.shape),
            f"[{meta.num_tokens}, {spec.num_heads}, {spec.head_size}]",
        )
        query = _last_dim_contiguous(query)
        device = query.device
        out = torch.empty(num_tokens, spec.num_heads, spec.v_size, dtype=query.dtype, device=device)
        lse = out  # a placeholder pointer when no LSE is asked for; never written
        if return_lse:
            lse = torch.empty(num_tokens, spec.num_heads, dtype=torch.float32, device=device)
        if num_tokens == 0:
            return (out, lse) if return_lse else out

        if spec.uses_kv_cache:
            check(kv_cache is not None, "kv_cache", None, f"a KVCache for attention type '{spec.attn_type}'")
            data = kv_cache.data
            k_src, v_src = data[:, 0], data[:, 1]
            k_strides = (data.stride(0), data.stride(2), data.stride(3))
            v_strides = k_strides
            page = kv_cache.block_size
            fp8 = kv_cache.is_fp8
            # Scales are read only by FP8 kernels; under CUDA graphs they must already be on the GPU.
            k_scale, v_scale = self._scales(kv_cache, device) if fp8 else (plan.kv_lens, plan.kv_lens)
        else:
            check(key is not None and value is not None, "key", None, "the new tokens' keys for encoder_only")
            k_src, v_src = _last_dim_contiguous(key), _last_dim_contiguous(value)
            k_strides = (0, k_src.stride(0), k_src.stride(1))
            v_strides = (0, v_src.stride(0), v_src.stride(1))
            page, fp8 = 1, False
            k_scale = v_scale = plan.kv_lens  # never read
        heads = spec.num_heads
        sinks = _layer_tensor(layer.sinks, spec.has_sinks, "layer.sinks", heads, device)
        slopes = _layer_tensor(layer.alibi_slopes, spec.use_alibi, "layer.alibi_slopes", heads, device)
        common = dict(
            QUERIES_PER_KV=spec.num_queries_per_kv, HEAD_D=spec.head_size, HEAD_DV=spec.v_size,
            BLOCK_D=_pow2(spec.head_size, 16), BLOCK_DV=_pow2(spec.v_size, 16), PAGE=page,
            USE_WINDOW=spec.sliding_window is not None, USE_SINK_TOKENS=spec.num_sink_tokens > 0,
            # Under DCP the learned sink joins rank 0's softmax only, so the LSE merge counts it once.
            USE_SINKS=spec.has_sinks and meta.dcp_rank == 0, USE_ALIBI=spec.use_alibi, DCP=meta.dcp_size,
            USE_SOFTCAP=spec.logits_soft_cap is not None, KV_FP8=fp8,
            # FP8 K/V convert exactly and cheaply to fp16 (bf16 would need a second, slow conversion),
            # so with an FP8 cache both products run in fp16.
            FP8_AS_F16=fp8 and query.dtype != torch.float32,
            DOT_PRECISION=dot_precision(query.dtype),
        )  # fmt: skip
        scalars = (
            spec.softmax_scale, spec.logits_soft_cap or 1.0, spec.sliding_window or 0, spec.num_sink_tokens
        )
        unused = plan.kv_lens  # a valid pointer for kernel arguments a disabled feature never reads
        tensors = (unused if sinks is None else sinks, unused if slopes is None else slopes, k_scale, v_scale)

        args = (query, out, lse, return_lse, tensors, scalars)
        fresh_tiles = (plan.fresh_tile_seq, plan.fresh_tile_q0) if plan.fresh_tile_seq is not None else None
        if fresh_tiles and self.fresh_input_reasons(key, value, kv_cache, num_tokens):
            # The step's K/V cannot stand in for the cache here; the pages hold the same keys, read
            # by the paged tiles and config the pages were tuned for. Not the fresh tiles' config:
            # its tiles are one row-descriptor load of the step's K/V each, and over the pages its
            # descriptors (kv_desc) stack BLOCK_N / page loads per tile (four at pages of 16: 6-7x
            # slower than the gather tiles on an H100, docs/performance.md).
            self._paged_prefill(plan, plan.prefill, plan.paged_fresh_tiles, kv_cache, k_src, v_src, k_strides,
                                v_strides, args, common)  # fmt: skip
        elif fresh_tiles:
            self._fresh_prefill(plan, plan.fresh_prefill, fresh_tiles, key, value, args, common)
        if plan.tile_seq.numel():
            self._paged_prefill(plan, plan.prefill, (plan.tile_seq, plan.tile_q0), kv_cache, k_src, v_src, k_strides,
                                v_strides, args, common)  # fmt: skip
        if plan.num_splits:
            self._decode(plan, query, k_src, v_src, k_strides, v_strides, out, lse, return_lse,
                         tensors, scalars, common)  # fmt: skip
        return (out, lse) if return_lse else out

    def _paged_prefill(self, plan, cfg, tiles, kv_cache, k_src, v_src, k_strides, v_strides, args, common) -> None:
        """The prefill tiles `tiles` (made for `cfg`) over the cache's pages (encoder-only: over the
        step's K/V, which k_src/v_src then are), through page descriptors where they apply."""
        kv_desc = not self.prefill_descriptor_reasons(cfg, kv_cache if self.spec.uses_kv_cache else None)
        if kv_desc:
            from meshserve.attention.kernels.kv_pages import kv_page_descriptors

            k_src, v_src = kv_page_descriptors(kv_cache.data, cfg.block_n, common["BLOCK_D"])
        self._prefill(plan, cfg, tiles, k_src, v_src, k_strides, v_strides, *args,
                      dict(common, KV_DESC=kv_desc), paged=self.spec.uses_kv_cache)  # fmt: skip

    def _fresh_prefill(self, plan, cfg, tiles, key, value, args, common) -> None:
        """The tiles of sequences with no cached context, over the step's own K/V rows: through row
        descriptors where they apply (one load per tile at any page size), else by pointers."""
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        k_strides, v_strides = (0, key.stride(0), key.stride(1)), (0, value.stride(0), value.stride(1))
        if cfg.gluon and not self.gluon_prefill_reasons(args[0], key, value):
            from meshserve.attention.kernels.prefill_gluon import gluon_fresh_prefill

            query, out, lse, return_lse = args[:4]
            gluon_fresh_prefill(query, key, value, out, lse, *tiles, plan.metadata.query_start_loc,
                                self.spec.softmax_scale, causal=self.spec.is_causal, return_lse=return_lse,
                                overlap=cfg.gluon_overlap, stages=cfg.num_stages)  # fmt: skip
            return
        kv_desc = not self.fresh_descriptor_reasons(cfg, key, value)
        if kv_desc:
            from meshserve.attention.kernels.kv_rows import kv_row_descriptors

            key, value = kv_row_descriptors(key, value, cfg.block_n, common["BLOCK_D"])
        self._prefill(plan, cfg, tiles, key, value, k_strides, v_strides, *args, dict(common, KV_DESC=kv_desc),
                      paged=False)  # fmt: skip

    def _prefill(self, plan, cfg, tiles, k_src, v_src, k_strides, v_strides, query, out, lse, return_lse,
                 tensors, scalars, common, *, paged: bool) -> None:  # fmt: skip
        from meshserve.attention.kernels.prefill import prefill_kernel

        tile_seq, tile_q0 = tiles
        # Heads vary fastest: the query heads of one tile run together and share K/V through L2.
        grid = (self.spec.num_heads, tile_seq.numel())
        launch = {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}
        prefill_kernel[grid](
            query, k_src, v_src, out, lse, tile_seq, tile_q0,
            plan.metadata.query_start_loc, plan.kv_lens, plan.positions, plan.block_table, *tensors, *scalars,
            plan.metadata.dcp_rank,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            *k_strides, *v_strides, plan.block_table.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGED=paged,
            CAUSAL=self.spec.is_causal, RETURN_LSE=return_lse,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common, **launch,
        )  # fmt: skip

    def prefill_descriptor_reasons(self, cfg: PrefillConfig, kv_cache: KVCache | None) -> list[str]:
        """Why the prefill kernel reads K/V by pointer gathers, not page descriptors (empty: it
        uses descriptors): not asked for by `cfg`, no cache, or the cache or device forbids them."""
        if kv_cache is None:
            return ["no KV cache (encoder-only attention reads the new tokens' K/V)"]
        if not cfg.kv_desc:
            return ["the prefill config does not ask for descriptors (kv_desc=False)"]
        block_d = _pow2(self.spec.head_size, 16)
        return descriptor_reasons(kv_cache.data, self.spec.head_size, block_d, cfg.block_n,
                                  self.problem.compute_capability)  # fmt: skip

    def fresh_cfg(self) -> PrefillConfig | None:
        """The config of the tiles of fresh sequences (no cached context), which read the step's
        own K/V: the prefill config if it asks for that (fresh_kv), else the measured default
        (kernels/config.py: GLUON_FRESH_CONFIG on sm_90 where the Gluon kernel serves the problem,
        else fresh_prefill_config; None on CPU, below sm_90, for FP8 caches and wide heads, or when
        a prefill config was given: fresh sequences then read the pages)."""
        return self.prefill_cfg if self.prefill_cfg.fresh_kv else self.default_fresh_cfg

    def fresh_kv_reasons(self, cfg: PrefillConfig | None = None, *, dcp_size: int = 1) -> list[str]:
        """Why no prefill sequence reads its keys from the step's own K/V (empty: every prefill
        sequence of a step whose first query is at position 0 does; one with cached context, a
        prefix-cache hit or a later chunk, always reads the pages). cfg: the fresh tiles' config
        (default: fresh_cfg()); dcp_size: the step's."""
        spec, out = self.spec, []
        if not spec.uses_kv_cache:
            return ["no KV cache (encoder-only attention always reads the step's K/V)"]
        cfg = cfg or self.fresh_cfg()
        if cfg is None:
            out.append("no fresh-prefill tiles for this problem (measured on CUDA sm_90+ for 16-bit K/V and heads "
                       "<= 128; a given prefill config must set fresh_kv)")  # fmt: skip
        elif not cfg.fresh_kv:
            out.append("the prefill config does not ask for it (fresh_kv=False)")
        return out + step_kv_refusals(spec, max(dcp_size, self.problem.dcp_size))

    def fresh_input_reasons(self, key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: KVCache | None,
                            num_tokens: int) -> list[str]:  # fmt: skip
        """Why this forward's key/value cannot stand in for what write_kv stored in the cache
        (empty: they can); num_tokens: the step's."""
        spec = self.spec
        if key is None or value is None:
            return ["forward was given no key/value"]
        out = []
        for name, x, head in (("key", key, spec.head_size), ("value", value, spec.v_size)):
            want = (num_tokens, spec.num_kv_heads, head)
            if tuple(x.shape) != want:
                out.append(f"{name} has shape {tuple(x.shape)}, not {list(want)}")
            if kv_cache is not None and x.dtype != kv_cache.data.dtype:
                out.append(f"{name} is {x.dtype}, the cache {kv_cache.data.dtype}: the cache holds other values")
        return out

    def gluon_prefill_reasons(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[str]:
        """Why fresh tiles run the portable kernel, not the Gluon one (kernels/prefill_gluon.py;
        empty: the Gluon one, where the config asks for it): the device, the problem or the tensors."""
        if self._gluon_refusals:
            return list(self._gluon_refusals)
        from meshserve.attention.kernels.prefill_gluon import gluon_prefill_reasons

        return gluon_prefill_reasons(query, key, value, self.problem.compute_capability)

    def _gluon_problem_reasons(self) -> list[str]:
        """gluon_prefill_reasons' part that the problem decides (the device, the head size, the
        masks, an importable Gluon): empty where fresh prompts default to the Gluon kernel."""
        spec, cc, out = self.spec, self.problem.compute_capability, []
        if self.problem.device != "cuda" or cc is None or cc[0] != 9:
            where = "CPU" if self.problem.device != "cuda" else "unknown" if cc is None else f"sm_{cc[0]}{cc[1]}"
            out.append(f"the Gluon prefill is written for sm_90's wgmma (have {where})")
        if spec.head_size not in (64, 128) or spec.v_size != spec.head_size:
            out.append(f"head_size={spec.head_size} (v {spec.v_size}): the Gluon prefill serves 64 and 128")
        for name, used in (("a sliding window", spec.sliding_window is not None), ("learned sinks", spec.has_sinks),
                           ("sink tokens", spec.num_sink_tokens > 0), ("ALiBi", spec.use_alibi),
                           ("a logit soft cap", spec.logits_soft_cap is not None)):  # fmt: skip
            if used:
                out.append(f"{name}: the Gluon prefill has plain causal or full masks only")
        if out:
            return out
        try:
            import meshserve.attention.kernels.prefill_gluon  # noqa: F401
        except ImportError as exc:  # a Triton without Gluon's Hopper ops
            return [f"Gluon cannot be imported: {exc}"]
        return []

    def fresh_descriptor_reasons(self, cfg: PrefillConfig, key: torch.Tensor, value: torch.Tensor) -> list[str]:
        """Why fresh sequences read the step's K/V by pointers, not row descriptors (empty: by
        descriptors): not asked for by `cfg` (kv_desc), or the tensors or the device forbid them."""
        if not cfg.kv_desc:
            return ["the prefill config does not ask for descriptors (kv_desc=False)"]
        block_d, cc = _pow2(self.spec.head_size, 16), self.problem.compute_capability
        return [f"{name}: {why}" for name, x in (("key", key), ("value", value))
                for why in row_descriptor_reasons(x, self.spec.head_size, block_d, cc)]  # fmt: skip

    def _decode(self, plan, query, k_src, v_src, k_strides, v_strides, out, lse, return_lse,
                tensors, scalars, common) -> None:  # fmt: skip
        from meshserve.attention.kernels.decode import decode_kernel
        from meshserve.attention.merge import merge_attn_states_n_triton

        spec, meta, cfg = self.spec, plan.metadata, plan.decode
        num_decodes = meta.num_decodes
        first_tok = meta.num_prefill_tokens
        final_o, final_lse = out[first_tok:], lse[first_tok:]
        split = plan.num_splits > 1
        o_dst = plan.partial_o if split else final_o.unsqueeze(0)
        l_dst = plan.partial_lse if split else final_lse.unsqueeze(0)
        block_h = _pow2(spec.num_queries_per_kv, 16)
        decode_kernel[(num_decodes, spec.num_kv_heads, plan.num_splits)](
            query, k_src, v_src, o_dst, l_dst, meta.query_start_loc, plan.kv_lens, plan.positions,
            plan.block_table,
            *tensors, meta.num_prefills, *scalars, plan.partition, meta.dcp_rank,
            query.stride(0), query.stride(1), o_dst.stride(0), o_dst.stride(1), o_dst.stride(2),
            l_dst.stride(0), l_dst.stride(1), l_dst.stride(2),
            *k_strides, *v_strides, plan.block_table.stride(0),
            BLOCK_H=block_h, BLOCK_N=cfg.block_n, WRITE_LSE=split or return_lse,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip
        if split:
            merge_attn_states_n_triton(
                plan.partial_o, plan.partial_lse, out=final_o, out_lse=final_lse if return_lse else None,
                return_lse=return_lse,
            )

    @staticmethod
    def _scales(kv_cache: KVCache, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        from meshserve.attention.kernels.write_kv import scales_on

        return scales_on(kv_cache, device)


def _choose_partition(max_keys, num_decodes, num_kv_heads, num_sms, cfg: DecodeConfig) -> tuple[int, int]:
    return choose_partition(
        max_keys, num_decodes, num_kv_heads, num_sms * cfg.programs_per_sm, cfg.block_n, cfg.min_partition
    )


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _layer_tensor(
    t: torch.Tensor | None, wanted: bool, field: str, num_heads: int, device: torch.device
) -> torch.Tensor | None:
    if not wanted:
        return None
    if t is None or tuple(t.shape) != (num_heads,):
        raise ConfigError(field, None if t is None else tuple(t.shape), f"a [{num_heads}] tensor")
    return t.to(device=device, dtype=torch.float32).contiguous()
