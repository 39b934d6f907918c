"""CPU_SDPA: the whole batch at once on a CPU, for serving.

TORCH attends one sequence at a time (a gather, a repeat_interleave, two einsums and a
logsumexp per sequence per layer); at batch 16 that was 71% of a CPU step (issue 28). Here a
step's sequences form two padded groups, prefills and decodes, and each group is a handful of
tensor ops per layer:

- `plan` (once per step, shared by every layer) turns the metadata into flat gather indices and
  an additive mask with numpy array ops: K/V index [2, S, Hkv, L] into the cache viewed as rows of
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

from dataclasses import dataclass

import numpy as np
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
from meshserve.attention.backends.torch_ref import scatter_kv
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype
from meshserve.errors import ConfigError


@dataclass(frozen=True)
class GroupPlan:
    """One padded group of sequences (the prefills, or the decodes) of a step.

    tokens:     (first, end) rows of the packed batch this group owns
    num_seqs, max_query_len (Lq), max_kv_len (L): padded sizes
    q_index:    [S * H * Lq] int64 rows of query.view(T * H, D) giving [S, H, Lq, D]; None when
                Lq == 1 (decodes: the packed query already is [S, H, D])
    out_rows:   [tokens] int64 rows of the padded [S * Lq] output that are real; None when Lq == 1
    kv_index:   [2 * S * Hkv * L] int64 rows of the cache viewed as [-1, D] (K then V), or for
                uncached layers [S * Hkv * L] rows of key.view(T * Hkv, D)
    bias:       [S, 1, 1, Lq, L] float32: 0 where visible, -inf where not
    rel:        [S, 1, 1, Lq, L] float32 kp - qp (ALiBi only)
    fresh:      every sequence is a whole prompt (nothing cached before, no DCP, no window and
                no ALiBi): its keys are exactly its new tokens, so SDPA can run per sequence on
                the step's own K/V with is_causal and skip the masked-out half (measured below)
    """

    tokens: tuple[int, int]
    num_seqs: int
    max_query_len: int
    max_kv_len: int
    q_index: torch.Tensor | None
    out_rows: torch.Tensor | None
    kv_index: torch.Tensor
    bias: torch.Tensor
    rel: torch.Tensor | None
    fresh: bool = False
    starts: tuple[int, ...] = ()  # token offsets of each sequence in the packed batch (fresh groups)
    v_bags: torch.Tensor | None = None  # [S * H * L] int64 V row of each key for each query head
    # (cached decode groups of >= BAGS_MIN_KEYS padded keys: embedding_bag's bags; head h reads KV head h // G)
    bag_offsets: torch.Tensor | None = None  # [S * H] int64 first entry of each bag in v_bags (0, L, 2L, ...)
    # Cached decode groups the paged decode kernel can serve (no window, no ALiBi, not cross):
    table: torch.Tensor | None = None  # [S, W] int32 block table rows of the group
    kv_lens: torch.Tensor | None = None  # [S] int32 keys this rank stores of each sequence


@dataclass(frozen=True)
class CpuPlan:
    groups: tuple[GroupPlan, ...]  # prefills first, then decodes; empty groups left out
    with_sinks: bool  # learned sinks join on DCP rank 0 only
    # ([T], [T]) int64 K and V rows of the new tokens in a contiguous cache viewed as [-1, Hkv, D],
    # when every token of the step is written (no -1 slot); else None. Built once per step: per
    # layer they cost the write five more ops (26 against 5 us, batch 1, demo shapes).
    write_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    write_block_size: int = 0  # the block size write_rows assume (the metadata's)


_NO_SINKS = torch.empty(0)

# Below this many padded keys in a decode group one SDPA call beats decode_bags' four ops
# (demo shapes, 1 thread: 28 against 48 us at 1 x 128 keys, level at 4 x 128, 388 against 332
# at 16 x 128, 1358 against 1002 at 64 x 128).
BAGS_MIN_KEYS = 512


class CpuSdpaBackend(AttentionBackend):
    name = "CPU_SDPA"
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
            rows = _write_rows(slot_mapping.cpu().numpy(), bs)
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
        groups = tuple(_plan_group(self.spec, meta, s0, s1, starts) for s0, s1 in splits if s1 > s0)
        rows = None
        if self.spec.uses_kv_cache and meta.slot_mapping.numel():
            rows = _write_rows(meta.slot_mapping.numpy(), meta.block_size)
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


def _write_rows(slots: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[T] int64 K and V rows of each slot in a cache [N, 2, block_size, Hkv, D] viewed as
    [-1, Hkv, D] (slot s = block * block_size + offset: K at block * 2 * block_size + offset, V
    block_size further); None when a slot is -1 (not written on this rank): the masked scatter."""
    if not (slots >= 0).all():
        return None
    k_rows = slots.astype(np.int64) + slots // block_size * block_size
    return torch.from_numpy(k_rows), torch.from_numpy(k_rows + block_size)


def _plan_group(spec: AttentionSpec, meta: AttentionMetadata, s0: int, s1: int, starts: list[int]) -> GroupPlan:
    """Indices and mask of sequences s0..s1-1, built with numpy array ops on the host (no per-token
    Python; numpy because this backend runs on the CPU, where a torch op's dispatch costs more
    than the work on these few elements), handed to torch without a copy."""
    num_seqs = s1 - s0
    H, Hkv = spec.num_heads, spec.num_kv_heads
    q_lens = np.asarray(meta.query_lens_host[s0:s1], np.int64)
    seq_lens = np.asarray(meta.seq_lens_host[s0:s1], np.int64)
    lq = int(q_lens.max())
    cross = spec.attn_type is AttentionType.CROSS
    if cross:
        kv_lens = np.asarray(meta.encoder_seq_lens_host[s0:s1], np.int64)
    elif spec.uses_kv_cache:  # what this DCP rank stores of each sequence (meta.local_len)
        kv_lens = (seq_lens - meta.dcp_rank + meta.dcp_size - 1) // meta.dcp_size
    else:
        kv_lens = q_lens
    L = max(int(kv_lens.max()), 1)

    j = np.arange(lq)
    ell = np.arange(L)
    # Padded key slots repeat a real key of the sequence (the last), so no unwritten memory is read.
    ell_c = np.minimum(ell[None, :], np.maximum(kv_lens - 1, 0)[:, None])  # [S, L]
    heads = np.arange(Hkv)
    if spec.uses_kv_cache:
        table = (meta.encoder_block_table if cross else meta.block_table)[s0:s1].numpy().astype(np.int64)
        bs = meta.block_size
        block = np.take_along_axis(table, ell_c // bs, 1)  # [S, L]
        base = (block * 2 * bs + ell_c % bs) * Hkv  # row of K head 0 in the cache viewed as [-1, D]
        idx = base[:, None, :] + heads[None, :, None]  # [S, Hkv, L]
        kv_index = np.stack([idx, idx + bs * Hkv]).reshape(-1)
    else:
        tok = np.asarray(starts[s0:s1], np.int64)[:, None] + ell_c - starts[s0]  # [S, L]
        kv_index = (tok[:, None, :] * Hkv + heads[None, :, None]).reshape(-1)

    q_valid = j[None, :] < q_lens[:, None]  # [S, Lq]
    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]  # [S, Lq] global positions
    k_pos = ell * meta.dcp_size + meta.dcp_rank if spec.uses_kv_cache and not cross else ell  # [L]
    qp, kp = q_pos[:, :, None], k_pos[None, None, :]
    visible = (ell[None, :] < kv_lens[:, None])[:, None, :]  # [S, 1, L]
    if spec.is_causal:
        visible = visible & (kp <= qp)
        if spec.sliding_window is not None:
            in_window = (qp - kp) < spec.sliding_window
            if spec.num_sink_tokens:
                in_window = in_window | (kp < spec.num_sink_tokens)
            visible = visible & in_window
    # Padded query rows see key 0 only: finite rows, dropped on the way out.
    visible = np.where(q_valid[:, :, None], visible, ell[None, None, :] == 0)  # [S, Lq, L]
    bias = np.where(visible, np.float32(0), np.float32(-np.inf))
    rel = torch.from_numpy((kp - qp).astype(np.float32))[:, None, None] if spec.use_alibi else None

    v_bags = bag_offsets = kernel_table = kernel_lens = None
    if lq == 1 and spec.uses_kv_cache and not cross and spec.sliding_window is None and not spec.use_alibi:
        # the paged decode kernel walks the table itself: every stored key is visible to a decode
        kernel_table = meta.block_table[s0:s1].contiguous()
        kernel_lens = torch.from_numpy(kv_lens.astype(np.int32))
    if lq == 1 and spec.uses_kv_cache and num_seqs * L >= BAGS_MIN_KEYS:
        # V rows (second half of kv_index), repeated for the query heads of each KV head
        v_rows = kv_index[kv_index.size // 2 :].reshape(num_seqs, Hkv, L)
        # flat, with the bags' offsets below: F.embedding_bag would build them (three more ops) per layer
        v_bags = torch.from_numpy(np.repeat(v_rows, H // Hkv, axis=1).reshape(-1))
        bag_offsets = torch.from_numpy(np.arange(0, num_seqs * H * L, L, dtype=np.int64))
    q_index = out_rows = None
    if lq > 1:
        tok = (np.asarray(starts[s0:s1], np.int64) - starts[s0])[:, None] + np.minimum(
            j[None, :], (q_lens - 1)[:, None]
        )  # [S, Lq] token row of each padded query
        q_index = torch.from_numpy((tok[:, None, :] * H + np.arange(H)[None, :, None]).reshape(-1))  # [S, H, Lq]
        out_rows = torch.from_numpy((np.arange(num_seqs)[:, None] * lq + j[None, :])[q_valid])
    fresh = (
        lq > 1
        and spec.attn_type is not AttentionType.CROSS
        and meta.dcp_size == 1
        and spec.sliding_window is None
        and not spec.use_alibi
        and meta.query_lens_host[s0:s1] == meta.seq_lens_host[s0:s1]
    )
    return GroupPlan(
        tokens=(starts[s0], starts[s1]),
        num_seqs=num_seqs,
        max_query_len=lq,
        max_kv_len=L,
        q_index=q_index,
        out_rows=out_rows,
        kv_index=torch.from_numpy(kv_index),
        bias=torch.from_numpy(bias)[:, None, None],
        rel=rel,
        fresh=fresh,
        starts=tuple(starts[s0 : s1 + 1]),
        v_bags=v_bags,
        bag_offsets=bag_offsets,
        table=kernel_table,
        kv_lens=kernel_lens,
    )


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
