"""The messages between a replica's scheduler and its workers: one StepPlan in, one StepOutput out.

Both travel as msgpack (never pickle). A request's prompt and sampling settings are sent once,
when it first appears (`new_requests`); afterwards each step carries only the new tokens,
where they start and what changed in its block tables (one per KV layer group:
kvstore/groups.py). Long id lists (a prompt, a prompt chunk, a whole block table) travel as
little-endian int32 bytes, which msgpack copies in one piece and the receiver turns back into
a list in C; short ones (a decode step's one token, its block changes) stay msgpack lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from meshserve.core.outputs import TokenLogprobs
from meshserve.errors import check


@dataclass
class NewRequest:
    """A request the workers have not seen: its prompt and settings (SamplingParams.to_dict()).

    output_ids: tokens already generated elsewhere (a hand-over); empty for a fresh request.
    encoder_ids: an encoder-decoder model's encoder input (the user's prompt; prompt_ids are then
                 the decoder's start tokens); empty for decoder-only models.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    output_ids: list[int] = field(default_factory=list)
    encoder_ids: list[int] = field(default_factory=list)


PACKED_IDS_MIN = 32  # id lists at least this long travel as int32 bytes


def pack_ids(ids: list[int]) -> list[int] | bytes:
    """An id list as it goes into a msgpack message (see the module docstring)."""
    return np.asarray(ids, "<i4").tobytes() if len(ids) >= PACKED_IDS_MIN else ids


def unpack_ids(ids: list[int] | bytes) -> list[int]:
    return np.frombuffer(ids, "<i4").tolist() if isinstance(ids, bytes) else ids


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step.

    token_ids:   the new tokens whose K/V this step computes and writes, as far as the host
                 knows them
    context_len: tokens of this sequence already in the cache (the first new token's position)
    block_tables: per KV layer group (one for most models), physical block ids; with the
                 workers' tables (see table_offsets) they cover at least seq_len tokens
    sample:      whether a next token is drawn after the last new token (False for a prompt
                 chunk that is not the prompt's last)
    from_last_step: one more new token follows token_ids: the token this request sampled in
                 the previous step, which the host has not seen yet (overlap scheduling: the
                 step was planned while that one ran); the runner takes it from the device
    table_offsets: None when block_tables are the request's whole tables; else, per group,
                 the index in the table the workers hold from which block_tables replace it
                 (a plan carries what changed: new blocks and a copied last block)
    encoder_table: encoder-decoder models: the request's encoder block table (cross-attention
                 K/V), sent with the whole tables (table_offsets None); a step whose
                 context_len is 0 runs the encoder and fills it
    """

    request_id: str
    token_ids: list[int]
    context_len: int
    block_tables: list[list[int]]
    sample: bool = True
    from_last_step: bool = False
    table_offsets: list[int] | None = None
    encoder_table: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + self.from_last_step

    @property
    def seq_len(self) -> int:
        return self.context_len + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """The metadata's notion: exactly one new token after a non-empty cached context."""
        return self.num_new_tokens == 1 and self.context_len > 0


def apply_table_changes(tables: list[list[int]], seq: ScheduledSeq) -> list[list[int]]:
    """The request's block tables after `seq`'s changes (`tables`: the ones held so far; updated
    in place where they are kept). The definition on lists; workers keep their tables as arrays
    and apply the same changes there (workers/request_tables.py; its tests compare with this)."""
    if seq.table_offsets is None:
        return [list(t) for t in seq.block_tables]
    check(len(seq.table_offsets) == len(tables) == len(seq.block_tables), "table_offsets",
          seq.table_offsets, f"one offset per KV layer group ({len(tables)})")
    for table, offset, blocks in zip(tables, seq.table_offsets, seq.block_tables):
        check(0 <= offset <= len(table), "table_offsets", offset, f"an index in [0, {len(table)}] "
              f"(the blocks held for {seq.request_id})")
        del table[offset:]
        table.extend(blocks)
    return tables


@dataclass(eq=False)
class DecodeRows:
    """Decode rows that just continue, as columns (most rows of most steps): one new token each
    (known, or the one the step in flight draws: `from_last_step`), a token sampled after it,
    and no change to the request's block tables. As a ScheduledSeq each would be a message of
    its own; here a step's rows are five arrays, which travel as bytes and which the runner
    reads as they are.

    request_ids:    [n] ids of requests the workers know
    token_ids:      [n] int64 the new token; 0 where from_last_step (the device holds it)
    context_lens:   [n] int64 tokens already cached (the new token's position)
    from_last_step: [n] bool
    table_lens:     [n, G] int64 per KV layer group, the blocks the workers hold for the request
                    (unchanged by this step: the runner checks that its tables agree)
    """

    request_ids: list[str]
    token_ids: np.ndarray
    context_lens: np.ndarray
    from_last_step: np.ndarray
    table_lens: np.ndarray

    def __len__(self) -> int:
        return len(self.request_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodeRows) and self.request_ids == other.request_ids and all(
            np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays()))

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.token_ids, self.context_lens, self.from_last_step, self.table_lens

    def seqs(self) -> list[ScheduledSeq]:
        """The same rows as ScheduledSeqs (the eager path, tools and tests)."""
        groups = self.table_lens.shape[1]
        return [ScheduledSeq(rid, [] if last else [tok], ctx, [[] for _ in range(groups)], True, last, lens)
                for rid, tok, ctx, last, lens in zip(self.request_ids, self.token_ids.tolist(),
                                                     self.context_lens.tolist(), self.from_last_step.tolist(),
                                                     self.table_lens.tolist())]  # fmt: skip

    def to_wire(self) -> list:
        return [self.request_ids, np.asarray(self.token_ids, "<i4").tobytes(),
                np.asarray(self.context_lens, "<i4").tobytes(), np.asarray(self.from_last_step, "u1").tobytes(),
                self.table_lens.shape[1], np.asarray(self.table_lens, "<i4").tobytes()]

    @classmethod
    def from_wire(cls, wire: list) -> DecodeRows:
        ids, tokens, context, last, groups, lens = wire
        def int64(data: bytes) -> np.ndarray:
            return np.frombuffer(data, "<i4").astype(np.int64)

        return cls(ids, int64(tokens), int64(context), np.frombuffer(last, "u1").astype(bool),
                   int64(lens).reshape(len(ids), groups))


@dataclass
class StepPlan:
    """Everything every worker needs for one forward step.

    seqs:     the step's sequences, except
    decodes:  the decode rows that just continue, as columns (None: no such rows); they run after
              `seqs` (whose order is the scheduler's: running requests by arrival, then admitted ones)
    finished: request ids the workers may forget (after this step).
    copies:   (src, dst) block pairs to copy in every cache tensor before any K/V is written
              (copy-on-write of a shared partial block; ids are unique across layer groups).
    """

    step_id: int
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    decodes: DecodeRows | None = None

    def all_seqs(self) -> list[ScheduledSeq]:
        """Every sequence of the step as a ScheduledSeq: `seqs`, then `decodes`."""
        return self.seqs if self.decodes is None else self.seqs + self.decodes.seqs()

    @property
    def num_new_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs) + (0 if self.decodes is None else len(self.decodes))

    def to_msgpack(self) -> bytes:
        short = PACKED_IDS_MIN
        seqs = [  # per sequence every step: one comprehension, a decode packs nothing
            [s.request_id, s.token_ids if len(s.token_ids) < short else pack_ids(s.token_ids), s.context_len,
             s.block_tables if s.table_offsets is not None and sum(map(len, s.block_tables)) < short
             else [np.asarray(t, "<i4").tobytes() for t in s.block_tables],  # every group's, even short ones
             s.sample, s.from_last_step, s.table_offsets,
             None if s.encoder_table is None else pack_ids(s.encoder_table)]
            for s in self.seqs
        ]  # fmt: skip
        return msgpack.packb({
            "step_id": self.step_id,
            "seqs": seqs,
            "new": [[r.request_id, pack_ids(r.prompt_ids), r.sampling, pack_ids(r.output_ids), pack_ids(r.encoder_ids)]
                    for r in self.new_requests],
            "finished": self.finished,
            "copies": [list(c) for c in self.copies],
            "decodes": None if self.decodes is None else self.decodes.to_wire(),
        })

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepPlan:
        d = msgpack.unpackb(data)
        return cls(
            step_id=d["step_id"],
            seqs=[ScheduledSeq(rid, tok if tok.__class__ is list else unpack_ids(tok), ctx,
                               tables if not tables or tables[0].__class__ is list else list(map(unpack_ids, tables)),
                               sample, last, offsets, None if enc is None else unpack_ids(enc))
                  for rid, tok, ctx, tables, sample, last, offsets, enc in d["seqs"]],
            new_requests=[NewRequest(rid, unpack_ids(prompt), sampling, unpack_ids(out), unpack_ids(enc))
                          for rid, prompt, sampling, out, enc in d["new"]],
            finished=d["finished"],
            copies=[tuple(c) for c in d["copies"]],
            decodes=None if d["decodes"] is None else DecodeRows.from_wire(d["decodes"]),
        )


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class StepOutput:
    """Tokens drawn this step (rank 0 only; other ranks return none), as columns: row i is
    request_ids[i]'s token token_ids[i], with logprobs[i] when the request asked for them.
    (A list of per-row messages would cost a Python object per request per step twice over.)"""

    step_id: int
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> its logprobs
    # request id -> [(index of a prompt token, its logprobs)] (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)

    @classmethod
    def of(cls, step_id: int, sampled: Sequence[SampledToken]) -> StepOutput:
        return cls(step_id, [s.request_id for s in sampled], [s.token_id for s in sampled],
                   {i: s.logprobs for i, s in enumerate(sampled) if s.logprobs is not None})

    @property
    def sampled(self) -> list[SampledToken]:
        """The rows as SampledTokens."""
        lps = self.logprobs
        return [SampledToken(rid, tok, lps.get(i))
                for i, (rid, tok) in enumerate(zip(self.request_ids, self.token_ids))]

    def to_msgpack(self) -> bytes:
        lps = [[i, lp.logprob, [list(p) for p in lp.top]] for i, lp in self.logprobs.items()]
        plps = [[rid, [[i, lp.token_id, lp.logprob, [list(p) for p in lp.top]] for i, lp in items]]
                for rid, items in self.prompt_logprobs.items()]
        return msgpack.packb({"step_id": self.step_id, "ids": self.request_ids, "tokens": self.token_ids,
                              "logprobs": lps, "prompt_logprobs": plps})

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepOutput:
        d = msgpack.unpackb(data)
        tokens = d["tokens"]
        lps = {i: TokenLogprobs(tokens[i], lp, tuple((int(t), v) for t, v in top)) for i, lp, top in d["logprobs"]}
        plps = {rid: [(i, TokenLogprobs(t, lp, tuple((int(a), v) for a, v in top))) for i, t, lp, top in items]
                for rid, items in d.get("prompt_logprobs", ())}
        return cls(d["step_id"], d["ids"], tokens, lps, plps)
