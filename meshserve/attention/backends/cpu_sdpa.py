"""CPU_SDPA: the whole batch at once on a CPU, for serving.

TORCH attends one sequence at a time (a gather, a repeat_interleave, two einsums and a
logsumexp per sequence per layer); at batch 16 that was 71% of a CPU step (issue 28). Here a
step's sequences form two padded groups, prefills and decodes, and each group is a handful of
tensor ops per layer:

- `plan` (once per step, shared by every layer; cpu_sdpa_plan.py) turns the metadata into flat
  gather indices and an additive mask with numpy array ops: K/V index [2, S, Hkv, L] into the cache viewed as rows of
  head_size, so one `index_select` yields K and V already laid out [S, Hkv, L, D];
- `forward` gathers, then either `scaled_dot_product_attention` with `enable_gqa` and the mask
  (when neither the LSE, a soft-cap nor learned sinks are asked for) or explicit matmuls with
  the query viewed as [S, Hkv, G * Lq, D] against the shared K/V: no repeat_interleave copies.
  Whole prompts skip the gather: SDPA per sequence on the step's own K/V with is_causal.
- decodes over a float32 cache (no sliding window, no ALiBi, not cross-attention) go through the
  compiled paged decode kernel (`cpu_paged_decode.py`): it walks each sequence's block table and
  reads K and V once, in place, with soft-cap, sinks and the LSE. When it cannot be built, the
  torch ops below serve:
- decodes over a float32 cache with neither the LSE, a soft-cap, sinks nor ALiBi gather K only:
  scores by one matmul, softmax, then `embedding_bag` sums the V rows weighted by the
  probabilities straight from the cache (`decode_bags`): V is never copied. On a CPU a decode
  step's attention is memory-bound and the gather was half of it (docs/performance.md).

Padded key slots point at a real key of the same sequence (never at unwritten cache memory)
and are masked with -inf; padded query rows see key 0 and are dropped on the way out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshserve.attention.backend import (
    AttentionBackend,
    AttentionProblem,
    BackendCapabilities,
    KVCache,
    LayerParams,
)
from meshserve.attention.backends.cpu_paged_decode import paged_decode_op
from meshserve.attention.backends.cpu_sdpa_math import explicit_attention, sdpa_per_sequence
from meshserve.attention.backends.cpu_sdpa_plan import CpuPlan, GroupPlan, plan_group, write_rows
from meshserve.attention.backends.torch_ref import scatter_kv
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype
from meshserve.errors import ConfigError

_NO_SINKS = torch.empty(0)


class CpuSdpaBackend(AttentionBackend):
    name = "CPU_SDPA"
    fused_kv_write = True  # write_kv is the TORCH reference scatter: the model may fuse it with the rotation
    capabilities = BackendCapabilities(
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        kv_cache_dtypes=frozenset(KVCacheDtype),
        min_block_size=1,
        max_block_size=1 << 20,
        naive_layout=True,
        paged_layout=True,
        min_head_size=1,
        max_head_size=1024,
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
        devices=frozenset({"cpu"}),
        notes="whole batch at once: prefills and decodes each one padded group (one K/V gather from the "
        "paged cache, GQA without K/V copies) through scaled_dot_product_attention, or explicit matmuls "
        "when the LSE, a soft-cap or learned sinks are needed; float32 decodes without window or ALiBi "
        "through a C++ paged decode kernel compiled on first use (K/V read once, in place; torch ops "
        "when it cannot be built); float32 math; CPU only",
    )

    def __init__(self, problem: AttentionProblem) -> None:
        super().__init__(problem)
        if problem.dtype == "float32" and self.spec.uses_kv_cache and not self.spec.kv_cache_dtype.is_fp8:
            paged_decode_op()  # built (once per machine) or loaded here, not in the first request's decode

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        spec = problem.spec
        if spec.uses_kv_cache and spec.v_size != spec.head_size:
            # K and V rows are gathered from one [-1, head_size] view of the cache
            return [f"head_size_v={spec.v_size} != head_size={spec.head_size} with a KV cache not supported"]
        return []

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
        plan: object | None = None,
    ) -> None:
        """The shared torch scatter, with a fast path for the common step (every slot written, no
        FP8): two index_copy_ calls at the rows this step's plan computed once (`write_rows`)
        instead of boolean selection (90 us of a 6 ms batch-1 step per layer went to
        scatter_kv's masking, 1 thread, demo model)."""
        data = kv_cache.data
        bs = data.shape[2]
        rows = plan.write_rows if isinstance(plan, CpuPlan) and plan.write_block_size == bs else None
        if rows is None and slot_mapping.numel():
            rows = write_rows(slot_mapping.cpu().numpy(), bs)
        if rows is None or kv_cache.is_fp8 or not data.is_contiguous():
            scatter_kv(key, value, kv_cache, slot_mapping)
            return
        flat = data.view(-1, *data.shape[3:])
        flat.index_copy_(0, rows[0], _as(key, data.dtype))
        flat.index_copy_(0, rows[1], _as(value, data.dtype))

    def plan(self, metadata: AttentionMetadata) -> CpuPlan:
        meta = metadata
        starts = [0]
        for q in meta.query_lens_host:
            starts.append(starts[-1] + q)
        splits = ((0, meta.num_prefills), (meta.num_prefills, meta.num_seqs))
        # With the kernel at hand, a decode group needs only its table rows and lengths: the
        # gather indices, mask and bags of the torch path are not built (0.3 ms a step at batch 64)
        kernel = self.problem.dtype == "float32" and not self.spec.kv_cache_dtype.is_fp8
        kernel = kernel and paged_decode_op() is not None
        groups = tuple(plan_group(self.spec, meta, s0, s1, starts, kernel_only=kernel) for s0, s1 in splits if s1 > s0)
        rows = None
        if self.spec.uses_kv_cache and meta.slot_mapping.numel():
            rows = write_rows(meta.slot_mapping.numpy(), meta.block_size)
        return CpuPlan(groups, with_sinks=meta.dcp_rank == 0, write_rows=rows, write_block_size=meta.block_size)

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
        if not isinstance(plan, CpuPlan):
            raise ConfigError("plan", type(plan).__name__, "the CpuPlan returned by CpuSdpaBackend.plan")
        spec = self.spec
        outs, lses = [], []
        for g in plan.groups:
            t0, t1 = g.tokens
            use_sinks = spec.has_sinks and plan.with_sinks
            plain = not return_lse and spec.logits_soft_cap is None and not use_sinks
            if g.fresh and plain:
                outs.append(sdpa_per_sequence(spec, query, key, value, g.starts))
                continue
            if g.table is not None and kv_cache.data.dtype == torch.float32 and kv_cache.data.is_contiguous():
                kernel = paged_decode_op()  # None when it cannot be built: the torch paths below
                if kernel is None and g.kernel_only:
                    raise ConfigError("plan", "a kernel-only decode group", "a plan made without the kernel")
                if kernel is not None:
                    o, lse = kernel(_as(query[t0:t1], torch.float32).contiguous(), kv_cache.data, g.table,
                                    g.kv_lens, spec.softmax_scale, spec.logits_soft_cap or 0.0,
                                    layer.sinks.float() if use_sinks else _NO_SINKS)
                    outs.append(o)
                    lses.append(lse)
                    continue
            if g.v_bags is not None and plain and not spec.use_alibi and kv_cache.data.dtype == torch.float32:
                outs.append(decode_bags(spec, query[t0:t1], kv_cache.data, g))
                continue
            k, v = self._gather_kv(g, key, value, kv_cache)  # [S, Hkv, L, D] float32 each
            q = _padded_query(query[t0:t1], g, spec)  # [S, H, Lq, D] float32
            if plain:  # one fused kernel: 19 vs 80 us at 1 decode, 207 vs 284 us at 16 (demo shapes)
                o, lse = _sdpa(spec, q, k, v, g, layer), None
            else:
                o, lse = explicit_attention(spec, q, k, v, g.bias, g.rel, layer, use_sinks)
            outs.append(_unpad(o, g))  # [tokens, H, Dv]
            if return_lse:
                lses.append(_unpad(lse[..., None], g)[..., 0])  # [tokens, H]
        out = _as(outs[0] if len(outs) == 1 else torch.cat(outs), query.dtype)
        if not return_lse:
            return out
        return out, lses[0] if len(lses) == 1 else torch.cat(lses)

    def _gather_kv(
        self, g: GroupPlan, key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        shape = (g.num_seqs, spec.num_kv_heads, g.max_kv_len)
        if not spec.uses_kv_cache:  # encoder-only: the new tokens are all the keys there are
            t0, t1 = g.tokens
            k = key[t0:t1].reshape(-1, spec.head_size).index_select(0, g.kv_index)
            v = value[t0:t1].reshape(-1, spec.v_size).index_select(0, g.kv_index)
            return k.view(*shape, -1).float(), v.view(*shape, -1).float()
        data = kv_cache.data
        k, v = data.view(-1, data.shape[-1]).index_select(0, g.kv_index).view(2, *shape, -1).unbind()
        if kv_cache.is_fp8:
            return k.float() * kv_cache.k_scale.float(), v.float() * kv_cache.v_scale.float()
        return _as(k, torch.float32), _as(v, torch.float32)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; no dispatch when it already is (a no-op `.to` still costs an op call, and
    a CPU decode step made about 50 of them: docs/performance.md)."""
    return x if x.dtype == dtype else x.to(dtype)


def _padded_query(query: torch.Tensor, g: GroupPlan, spec: AttentionSpec) -> torch.Tensor:
    """[S, H, Lq, D] float32 from the group's packed rows [tokens, H, D]."""
    if g.q_index is None:
        return _as(query, torch.float32).reshape(g.num_seqs, spec.num_heads, 1, spec.head_size)
    q = query.reshape(-1, spec.head_size).index_select(0, g.q_index)
    return q.view(g.num_seqs, spec.num_heads, g.max_query_len, spec.head_size).float()


def _unpad(x: torch.Tensor, g: GroupPlan) -> torch.Tensor:
    """[S, H, Lq, E] padded -> [tokens, H, E] packed."""
    if g.out_rows is None:
        return x.reshape(g.num_seqs, x.shape[1], x.shape[-1])
    x = x.transpose(1, 2).reshape(g.num_seqs * g.max_query_len, x.shape[1], x.shape[-1])
    return x.index_select(0, g.out_rows)


def _sdpa(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupPlan, layer: LayerParams
) -> torch.Tensor:
    mask = g.bias[:, 0]  # [S, 1, Lq, L]
    if spec.use_alibi:
        mask = mask + layer.alibi_slopes.float()[None, :, None, None] * g.rel[:, 0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.softmax_scale, enable_gqa=True)


def decode_bags(spec: AttentionSpec, query: torch.Tensor, cache: torch.Tensor, g: GroupPlan) -> torch.Tensor:
    """One query per sequence against a float32 paged cache, V read in place: [S, H, D] float32.

    query [S, H, D]; cache [N, 2, bs, Hkv, D] float32. K is gathered ([S, Hkv, L, D], half the
    bytes of the K/V gather), the query heads of each KV head score it in one matmul, and
    `embedding_bag` (mode sum, per-sample weights) adds the V rows scaled by their probabilities
    without copying them out. Masked key slots get probability 0 (their rows are real, finite keys).
    """
    S, H, D, Hkv, L = g.num_seqs, spec.num_heads, spec.head_size, spec.num_kv_heads, g.max_kv_len
    rows = cache.view(-1, D)  # [N * 2 * bs * Hkv, D]
    k = rows.index_select(0, g.kv_index[: S * Hkv * L]).view(S, Hkv, L, D)
    q = query.float().view(S, Hkv, H // Hkv, D) * spec.softmax_scale  # [S, Hkv, G, D]
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + g.bias.view(S, 1, 1, L), dim=-1)  # [S, Hkv, G, L]
    o = F.embedding_bag(g.v_bags, rows, g.bag_offsets, per_sample_weights=probs.view(-1), mode="sum")  # [S * H, D]
    return o.view(S, H, D)


__all__ = ["CpuSdpaBackend", "CpuPlan", "GroupPlan", "decode_bags"]
