"""CPU_SDPA's per-step plan: the metadata turned into flat gather indices, masks and (for the
paged decode kernel) table rows, with numpy array ops on the host, once per step and shared by
every layer. attention/backends/cpu_sdpa.py runs the groups these describe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.core.arith import local_len

_EMPTY_INDEX = torch.empty(0, dtype=torch.int64)


# Below this many padded keys in a decode group one SDPA call beats decode_bags' four ops
# (demo shapes, 1 thread: 28 against 48 us at 1 x 128 keys, level at 4 x 128, 388 against 332
# at 16 x 128, 1358 against 1002 at 64 x 128).
BAGS_MIN_KEYS = 512


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
    kernel_only: bool = False  # the kernel serves it: kv_index and bias were left empty (not built)


@dataclass(frozen=True)
class CpuPlan:
    groups: tuple[GroupPlan, ...]  # prefills first, then decodes; empty groups left out
    with_sinks: bool  # learned sinks join on DCP rank 0 only
    # ([T], [T]) int64 K and V rows of the new tokens in a contiguous cache viewed as [-1, Hkv, D],
    # when every token of the step is written (no -1 slot); else None. Built once per step: per
    # layer they cost the write five more ops (26 against 5 us, batch 1, demo shapes).
    write_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    write_block_size: int = 0  # the block size write_rows assume (the metadata's)


def write_rows(slots: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[T] int64 K and V rows of each slot in a cache [N, 2, block_size, Hkv, D] viewed as
    [-1, Hkv, D] (slot s = block * block_size + offset: K at block * 2 * block_size + offset, V
    block_size further); None when a slot is -1 (not written on this rank): the masked scatter."""
    if not (slots >= 0).all():
        return None
    k_rows = slots.astype(np.int64) + slots // block_size * block_size
    return torch.from_numpy(k_rows), torch.from_numpy(k_rows + block_size)


def plan_group(spec: AttentionSpec, meta: AttentionMetadata, s0: int, s1: int, starts: list[int], *,
                kernel_only: bool = False) -> GroupPlan:
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
        kv_lens = local_len(seq_lens, meta.dcp_size, meta.dcp_rank)
    else:
        kv_lens = q_lens
    L = max(int(kv_lens.max()), 1)
    kernel_group = lq == 1 and spec.uses_kv_cache and not cross and spec.sliding_window is None and not spec.use_alibi
    if kernel_group and kernel_only:
        return GroupPlan(tokens=(starts[s0], starts[s1]), num_seqs=num_seqs, max_query_len=1, max_kv_len=L,
                         q_index=None, out_rows=None, kv_index=_EMPTY_INDEX, bias=_EMPTY_INDEX, rel=None,
                         starts=tuple(starts[s0 : s1 + 1]), table=meta.block_table[s0:s1].contiguous(),
                         kv_lens=torch.from_numpy(kv_lens.astype(np.int32)), kernel_only=True)

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
    if kernel_group:
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


__all__ = ["BAGS_MIN_KEYS", "CpuPlan", "GroupPlan", "plan_group", "write_rows"]
