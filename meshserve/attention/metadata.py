"""Per-step attention metadata: the packed batch layout every backend reads.

Tokens of all sequences are concatenated without padding. Prefill sequences (whole prompts or
chunks of a longer prompt whose earlier chunks are already cached) come first, decode sequences
(one new token each, after a cached context) after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    (`block_tables_host`, when built from host lists) are kept for backends whose planning
    happens on the host: reading the device tensors back would wait for the device.
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
    block_tables_host: tuple[Sequence[int], ...] | None = None
    encoder_seq_lens_host: tuple[int, ...] | None = None
    encoder_block_table: torch.Tensor | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    kv_group: int = 0

    def local_len(self, seq_len: int) -> int:
        """How many of a sequence's first `seq_len` tokens this DCP rank stores."""
        return (seq_len - self.dcp_rank + self.dcp_size - 1) // self.dcp_size

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
        block_tables: Sequence[Sequence[int]],
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

        A sequence counts as a decode when it adds exactly one token after a non-empty cached
        context; every decode must come after every prefill.
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
        is_decode = []
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            check(q >= 1, f"query_lens[{i}]", q, "an integer >= 1")
            check(s >= q, f"seq_lens[{i}]", s, f"an integer >= query_lens[{i}]={q}")
            needed = -(-((s - dcp_rank + dcp_size - 1) // dcp_size) // block_size)
            check(
                len(block_tables[i]) >= needed,
                f"block_tables[{i}]",
                len(block_tables[i]),
                f">= {needed} blocks for seq_len {s} at block_size {block_size} (dcp {dcp_rank}/{dcp_size})",
            )
            is_decode.append(q == 1 and s > 1)
        num_prefills = next((i for i, d in enumerate(is_decode) if d), num_seqs)
        check(
            all(is_decode[num_prefills:]),
            "query_lens",
            list(query_lens),
            "prefill sequences first, then decode sequences (one new token each)",
        )
        table = _pad_table(block_tables)
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
            encoder_table = to_device(_pad_table(encoder_block_tables), device)
        slots: list[int] = []
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            for pos in range(s - q, s):
                if write_kv and pos % dcp_size == dcp_rank:
                    local = pos // dcp_size
                    slots.append(block_tables[i][local // block_size] * block_size + local % block_size)
                else:
                    slots.append(-1)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return cls(  # stream-ordered copies: building never waits for the device (core/tensors.py)
            query_start_loc=to_device(qsl, device, torch.int32),
            seq_lens=to_device(list(seq_lens), device, torch.int32),
            context_lens=to_device([s - q for q, s in zip(query_lens, seq_lens)], device, torch.int32),
            block_table=to_device(table, device),
            slot_mapping=to_device(slots, device, torch.int64),
            num_prefills=num_prefills,
            num_prefill_tokens=sum(query_lens[:num_prefills]),
            num_decodes=num_seqs - num_prefills,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            block_tables_host=tuple(block_tables),
            encoder_seq_lens_host=None if encoder_seq_lens is None else tuple(encoder_seq_lens),
            encoder_block_table=encoder_table,
            dcp_size=dcp_size,
            dcp_rank=dcp_rank,
            kv_group=kv_group,
        )


def _pad_table(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """[len(rows), max_len] int32, rows padded with block 0 (never read past a sequence's end)."""
    width = max((len(r) for r in rows), default=0)
    table = torch.zeros((len(rows), max(width, 1)), dtype=torch.int32)
    for i, row in enumerate(rows):
        if row:
            table[i, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
    return table
