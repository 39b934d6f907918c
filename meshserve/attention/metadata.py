"""Per-step attention metadata: the packed batch layout every backend reads.

Tokens of all sequences are concatenated without padding. Prefill sequences (whole prompts or
chunks of a longer prompt whose earlier chunks are already cached) come first, decode sequences
(one new token each, after a cached context) after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from meshserve.core.arith import cdiv
from meshserve.core.arith import local_len as _local_len
from meshserve.core.tensors import to_device
from meshserve.errors import check


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch, shared by every layer.

    Fields (S = number of sequences, T = number of new tokens in the step):
      query_start_loc  [S + 1] int32  offsets of each sequence's new tokens in the packed batch
      seq_lens         [S] int32      context length including the new tokens
      context_lens     [S] int32      tokens already in the cache before this step (seq_len - query_len)
      block_table      [S, max_blocks] int32  physical block ids, row s for sequence s
                                      (entries past a sequence's last block are 0 and never read)
      slot_mapping     [T] int64      cache slot (block * block_size + offset) of each new token;
                                      -1 marks a token whose K/V is not written
      num_prefills, num_prefill_tokens, num_decodes: counts; decodes follow prefills
      max_query_len, max_seq_len: maxima over the batch (host ints; no device sync needed)
      block_size: tokens per block of the cache these tables index
      kv_group: the KV layer group whose block tables these are (hybrid models build one
                metadata per group; backends with per-plan state keep it per group)
    Host copies of the lengths (`query_lens_host`, `seq_lens_host`) and of the block tables
    (`block_tables_host`: [S, max_blocks] int32 numpy, the host twin of block_table, when built
    on the host) are kept for backends whose planning happens on the host: reading the device
    tensors back would wait for the device.
    Decode context parallelism (dcp_size > 1): seq_lens, context_lens and query positions stay
    global; only storage is sharded. The token at global position p lives on DCP rank
    p % dcp_size at local position p // dcp_size, so block_table rows index local storage and
    slot_mapping is -1 for new tokens that belong to another rank. Learned sink logits join
    the softmax on DCP rank 0 only, so the LSE merge counts them once.
    Cross-attention layers read the encoder side instead of seq_lens/block_table:
      encoder_seq_lens_host  per sequence, the number of cached encoder tokens
      encoder_block_table    [S, max_encoder_blocks] int32
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    block_tables_host: np.ndarray | None = None
    encoder_seq_lens_host: tuple[int, ...] | None = None
    encoder_block_table: torch.Tensor | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    kv_group: int = 0

    def local_len(self, seq_len: int) -> int:
        """How many of a sequence's first `seq_len` tokens this DCP rank stores."""
        return _local_len(seq_len, self.dcp_size, self.dcp_rank)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
        write_kv: bool = True,
        encoder_seq_lens: Sequence[int] | None = None,
        encoder_block_tables: Sequence[Sequence[int]] | None = None,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        kv_group: int = 0,
    ) -> AttentionMetadata:
        """Build metadata from host lists; slot_mapping follows the block tables.

        block_tables: one list of block ids per sequence, or an [S, W] int32 array whose rows
        are the sequences' tables (entries past a sequence's blocks are never read; every row
        counts as W blocks long). A sequence counts as a decode when it adds exactly one token
        after a non-empty cached context; every decode must come after every prefill.
        """
        num_seqs = len(query_lens)
        check(len(seq_lens) == num_seqs, "seq_lens", len(seq_lens), f"one entry per sequence ({num_seqs})")
        check(
            len(block_tables) == num_seqs,
            "block_tables",
            len(block_tables),
            f"one row per sequence ({num_seqs})",
        )
        check(block_size >= 1, "block_size", block_size, "an integer >= 1")
        check(dcp_size >= 1, "dcp_size", dcp_size, "an integer >= 1")
        check(0 <= dcp_rank < dcp_size, "dcp_rank", dcp_rank, f"an integer in [0, {dcp_size - 1}]")
        # Host arrays, built with numpy without a Python loop over sequences or tokens (map and
        # chain run in C); numpy, not torch, because a torch op costs microseconds of dispatch on
        # these few elements and some (repeat_interleave) wait for a busy core.
        q = np.fromiter(query_lens, np.int64, num_seqs)  # [S]
        s = np.fromiter(seq_lens, np.int64, num_seqs)  # [S]
        padded = isinstance(block_tables, np.ndarray)
        if padded:
            check(block_tables.ndim == 2, "block_tables", block_tables.shape, "an [S, W] array")
            widths = np.full(num_seqs, block_tables.shape[1], np.int64)
        else:
            widths = np.fromiter(map(len, block_tables), np.int64, num_seqs)  # [S]
        _check_lengths(q, s, widths, block_size, dcp_size, dcp_rank)
        is_decode = (q == 1) & (s > 1)
        num_prefills = int(is_decode.argmax()) if is_decode.any() else num_seqs
        check(
            bool(is_decode[num_prefills:].all()),
            "query_lens",
            list(query_lens),
            "prefill sequences first, then decode sequences (one new token each)",
        )
        table = (np.ascontiguousarray(block_tables, np.int32) if padded and num_seqs and block_tables.shape[1]
                 else pad_table(block_tables, widths))
        encoder_table = None
        if encoder_seq_lens is not None:
            check(
                encoder_block_tables is not None
                and len(encoder_block_tables) == num_seqs
                and len(encoder_seq_lens) == num_seqs,
                "encoder_block_tables",
                None if encoder_block_tables is None else len(encoder_block_tables),
                f"one row per sequence ({num_seqs}) with encoder_seq_lens",
            )
            encoder_table = to_device(torch.from_numpy(pad_table(encoder_block_tables)), device)
        qsl = np.zeros(num_seqs + 1, np.int32)
        np.cumsum(q, out=qsl[1:])
        context = s - q
        slots = token_slots(table, qsl, context, block_size, dcp_size, dcp_rank, write_kv)
        return cls(  # stream-ordered copies: building never waits for the device (core/tensors.py)
            query_start_loc=to_device(torch.from_numpy(qsl), device),
            seq_lens=to_device(torch.from_numpy(s.astype(np.int32)), device),
            context_lens=to_device(torch.from_numpy(context.astype(np.int32)), device),
            block_table=to_device(torch.from_numpy(table), device),
            slot_mapping=to_device(torch.from_numpy(slots), device),
            num_prefills=num_prefills,
            num_prefill_tokens=sum(query_lens[:num_prefills]),
            num_decodes=num_seqs - num_prefills,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            block_tables_host=table,
            encoder_seq_lens_host=None if encoder_seq_lens is None else tuple(encoder_seq_lens),
            encoder_block_table=encoder_table,
            dcp_size=dcp_size,
            dcp_rank=dcp_rank,
            kv_group=kv_group,
        )


def split_prefill_decode(meta: AttentionMetadata) -> tuple[AttentionMetadata | None, AttentionMetadata | None]:
    """The prefill part and the decode part of a step's metadata (None where a part is empty).

    Each part is a batch of its own: its query_start_loc starts at 0 and its slot_mapping holds
    its own tokens; its block tables (device and host) and encoder fields are its own rows.
    Tensors are slices (views) of the step's; nothing is copied to the host. Layers that run the
    two phases on different backends cut the step with this (MLAAttention, PhaseSplitBackend).
    """
    npf, npt = meta.num_prefills, meta.num_prefill_tokens
    host = meta.block_tables_host
    enc_host, enc_table = meta.encoder_seq_lens_host, meta.encoder_block_table
    prefill = decode = None
    if npf:
        prefill = replace(
            meta,
            query_start_loc=meta.query_start_loc[: npf + 1],
            seq_lens=meta.seq_lens[:npf],
            context_lens=meta.context_lens[:npf],
            block_table=meta.block_table[:npf],
            slot_mapping=meta.slot_mapping[:npt],
            num_decodes=0,
            max_query_len=max(meta.query_lens_host[:npf]),
            max_seq_len=max(meta.seq_lens_host[:npf]),
            query_lens_host=meta.query_lens_host[:npf],
            seq_lens_host=meta.seq_lens_host[:npf],
            block_tables_host=None if host is None else host[:npf],
            encoder_seq_lens_host=None if enc_host is None else enc_host[:npf],
            encoder_block_table=None if enc_table is None else enc_table[:npf],
        )
    if meta.num_decodes:
        decode = replace(
            meta,
            query_start_loc=meta.query_start_loc[npf:] - npt,
            seq_lens=meta.seq_lens[npf:],
            context_lens=meta.context_lens[npf:],
            block_table=meta.block_table[npf:],
            slot_mapping=meta.slot_mapping[npt:],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
            max_seq_len=max(meta.seq_lens_host[npf:]),
            query_lens_host=meta.query_lens_host[npf:],
            seq_lens_host=meta.seq_lens_host[npf:],
            block_tables_host=None if host is None else host[npf:],
            encoder_seq_lens_host=None if enc_host is None else enc_host[npf:],
            encoder_block_table=None if enc_table is None else enc_table[npf:],
        )
    return prefill, decode


def _check_lengths(q: np.ndarray, s: np.ndarray, widths: np.ndarray, block_size: int, dcp_size: int,
                   dcp_rank: int) -> None:
    """The first inconsistent sequence, as the error a check of each sequence in turn gives."""
    needed = cdiv(_local_len(s, dcp_size, dcp_rank), block_size)  # [S] blocks
    bad = (q < 1) | (s < q) | (widths < needed)
    if not bad.any():
        return
    i = int(bad.argmax())
    qi, si = int(q[i]), int(s[i])
    check(qi >= 1, f"query_lens[{i}]", qi, "an integer >= 1")
    check(si >= qi, f"seq_lens[{i}]", si, f"an integer >= query_lens[{i}]={qi}")
    check(False, f"block_tables[{i}]", int(widths[i]),
          f">= {int(needed[i])} blocks for seq_len {si} at block_size {block_size} (dcp {dcp_rank}/{dcp_size})")


def token_slots(table: np.ndarray, qsl: np.ndarray, context: np.ndarray, block_size: int, dcp_size: int,
                dcp_rank: int, write_kv: bool) -> np.ndarray:
    """[T] int64 cache slot of each new token, -1 where this rank does not write it."""
    num_tokens = int(qsl[-1])
    if not write_kv:
        return np.full(num_tokens, -1, np.int64)
    seq = np.repeat(np.arange(len(context)), np.diff(qsl))  # [T] sequence of each token
    pos = context[seq] + np.arange(num_tokens) - qsl[seq]  # [T] global positions
    local = pos // dcp_size
    if dcp_size == 1:
        return table[seq, local // block_size].astype(np.int64) * block_size + local % block_size
    mine = pos % dcp_size == dcp_rank
    col = np.where(mine, local // block_size, 0)  # another rank's token may lie past this row's blocks
    slots = table[seq, col].astype(np.int64) * block_size + local % block_size
    return np.where(mine, slots, -1)


def pad_table(rows: Sequence[Sequence[int]], widths: np.ndarray | None = None) -> np.ndarray:
    """[len(rows), max_len] int32, rows padded with block 0 (never read past a sequence's end)."""
    num_rows = len(rows)
    if widths is None:
        widths = np.fromiter(map(len, rows), np.int64, num_rows)
    width = int(widths.max()) if num_rows else 0
    table = np.zeros((num_rows, max(width, 1)), np.int32)
    if width:
        flat = np.fromiter(chain.from_iterable(rows), np.int32, int(widths.sum()))
        table[np.arange(width) < widths[:, None]] = flat  # row-major: each row's entries in order
    return table
