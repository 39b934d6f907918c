"""The messages between a replica's scheduler and its workers: one StepPlan in, one StepOutput out.

Both travel as msgpack (never pickle). A plan has one row per scheduled request, in one of two
places (vLLM v1's NewRequestData / CachedRequestData): a request the workers have not seen comes
as a `NewRequest` (prompt, sampling settings, whole block tables, its first tokens); every other
row is in the plan's columnar `CachedRows`: the new tokens, where they start and what changed in
the block tables (one per KV layer group: kvstore/groups.py). engine/plan_encoder.py writes them.
Columns and long id lists (a prompt, a whole block table) travel as little-endian int32 bytes,
which msgpack copies in one piece and the receiver reads as arrays; short lists stay msgpack lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

from meshserve.core.outputs import TokenLogprobs
from meshserve.errors import check


@dataclass
class NewRequest:
    """A request the workers have not seen, with its first row of work (vLLM v1's NewRequestData).

    sampling:      SamplingParams.to_dict()
    output_ids:    tokens already generated elsewhere (a hand-over); empty for a fresh request
    encoder_ids:   an encoder-decoder model's encoder input (the user's prompt; prompt_ids are then
                   the decoder's start tokens); empty for decoder-only models
    context_len:   tokens of prompt_ids + output_ids already in the cache (a prefix-cache hit, a
                   fork's shared blocks, a hand-over's imported K/V)
    num_tokens:    how many tokens after those this step computes; 0 for an announcement only (a
                   request waiting for its grammar, which the driver rank compiles from now on:
                   its rows come later among the cached ones, its tables whole the first time)
    sample:        whether a token is drawn after the last of them
    block_tables:  per KV layer group, the request's whole table
    encoder_table: encoder-decoder models: the encoder block table (cross-attention K/V), which
                   this step fills when context_len is 0; None for decoder-only models
    grammar_timeout_s: an announcement's bound on its grammar's compile (SchedulerConfig's
                   grammar_compile_timeout_s, counted from here): the driver reports the request
                   failed past it; 0: none
    """

    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    output_ids: list[int] = field(default_factory=list)
    encoder_ids: list[int] = field(default_factory=list)
    context_len: int = 0
    num_tokens: int = 0
    sample: bool = True
    block_tables: list[list[int]] = field(default_factory=list)
    encoder_table: list[int] | None = None
    grammar_timeout_s: float = 0.0

    @property
    def is_announcement(self) -> bool:
        """Only made known to the workers: no row this step."""
        return self.num_tokens == 0

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes."""
        start, end = self.context_len, self.context_len + self.num_tokens
        if end <= len(self.prompt_ids):
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    def seq(self) -> ScheduledSeq:
        """The row as a ScheduledSeq (tools and tests)."""
        return ScheduledSeq(self.request_id, self.token_ids, self.context_len, [list(t) for t in self.block_tables],
                            self.sample, False, None, self.encoder_table)

    def to_wire(self) -> list:
        return [self.request_id, pack_ids(self.prompt_ids), self.sampling, pack_ids(self.output_ids),
                pack_ids(self.encoder_ids), self.context_len, self.num_tokens, self.sample,
                [np.asarray(t, "<i4").tobytes() for t in self.block_tables],
                None if self.encoder_table is None else pack_ids(self.encoder_table), self.grammar_timeout_s]

    @classmethod
    def from_wire(cls, wire: list) -> NewRequest:
        rid, prompt, sampling, out, enc, context, num, sample, tables, enc_table, grammar_timeout = wire
        return cls(rid, unpack_ids(prompt), sampling, unpack_ids(out), unpack_ids(enc), context, num, sample,
                   [np.frombuffer(t, "<i4").tolist() for t in tables],
                   None if enc_table is None else unpack_ids(enc_table), grammar_timeout)


PACKED_IDS_MIN = 32  # id lists at least this long travel as int32 bytes


def pack_ids(ids: list[int]) -> list[int] | bytes:
    """An id list as it goes into a msgpack message (see the module docstring)."""
    return np.asarray(ids, "<i4").tobytes() if len(ids) >= PACKED_IDS_MIN else ids


def unpack_ids(ids: list[int] | bytes) -> list[int]:
    return np.frombuffer(ids, "<i4").tolist() if isinstance(ids, bytes) else ids


@dataclass(slots=True)
class ScheduledSeq:
    """One row of a step as a plain record: the view tools and tests read and build plans from
    (StepPlan.from_seqs, StepPlan.all_seqs); plans themselves carry NewRequest and CachedRows.

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
                 K/V), sent with the whole tables; a step whose context_len is 0 runs the encoder
                 and fills it
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


def _int64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i4").astype(np.int64)


@dataclass(eq=False)
class CachedRows:
    """Every row of a step whose request the workers already hold, as columns (vLLM v1's
    CachedRequestData): most rows of most steps are decodes, and as columns a step's rows travel
    as a few byte strings that the runner reads as they are.

    request_ids:    [n] ids of requests the workers know
    num_tokens:     [n] int64 new tokens whose ids the host knows (a decode: 1, or 0 when its
                    token is the one the previous step draws)
    token_ids:      [sum(num_tokens)] int64 those tokens, row after row
    context_lens:   [n] int64 tokens already cached (the first new token's position)
    sample:         [n] bool a token is drawn after the row's last new token
    from_last_step: [n] bool one more new token follows: the one the previous step draws for
                    the request, still on the device (overlap scheduling)
    table_offsets:  [n, G] int64 per KV layer group, the index in the table the workers hold
                    from which `blocks` replace it (the table ends there when none follow):
                    the held length when the table did not change (most decodes), 0 when
                    the whole table is resent
    block_counts:   [n, G] int64 how many blocks replace it from there
    blocks:         [sum(block_counts)] int64 those blocks, by row, then by group
    encoder_tables: request id -> encoder block table, for encoder-decoder rows whose tables
                    are resent whole (their decoder restarts)
    """

    request_ids: list[str]
    num_tokens: np.ndarray
    token_ids: np.ndarray
    context_lens: np.ndarray
    sample: np.ndarray
    from_last_step: np.ndarray
    table_offsets: np.ndarray
    block_counts: np.ndarray
    blocks: np.ndarray
    encoder_tables: dict[str, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.num_tokens, self.token_ids, self.context_lens, self.sample, self.from_last_step,
                self.table_offsets, self.block_counts, self.blocks)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CachedRows) and self.request_ids == other.request_ids
                and self.encoder_tables == other.encoder_tables
                and all(np.array_equal(a, b) for a, b in zip(self._arrays(), other._arrays())))

    @classmethod
    def of(cls, request_ids: list[str], num_tokens: Sequence[int], token_ids: Sequence[int],
           context_lens: Sequence[int], sample: Sequence[bool], from_last_step: Sequence[bool],
           table_offsets: Sequence[Sequence[int]], block_counts: Sequence[Sequence[int]], blocks: Sequence[int],
           encoder_tables: dict[str, list[int]] | None = None) -> CachedRows:
        """From host lists (the plan encoder's)."""
        n = len(request_ids)
        offsets, counts = np.array(table_offsets, np.int64), np.array(block_counts, np.int64)
        groups = offsets.size // n if n else 1
        return cls(request_ids, np.array(num_tokens, np.int64), np.array(token_ids, np.int64),
                   np.array(context_lens, np.int64), np.array(sample, bool), np.array(from_last_step, bool),
                   offsets.reshape(n, groups), counts.reshape(n, groups), np.array(blocks, np.int64),
                   encoder_tables or {})

    @classmethod
    def from_seqs(cls, seqs: Sequence[ScheduledSeq]) -> CachedRows:
        """The rows of ScheduledSeqs (a seq with table_offsets None resends its tables whole)."""
        offsets, counts, blocks = [], [], []
        for s in seqs:
            offsets.append(s.table_offsets if s.table_offsets is not None else [0] * len(s.block_tables))
            counts.append([len(t) for t in s.block_tables])
            for t in s.block_tables:
                blocks.extend(t)
        return cls.of([s.request_id for s in seqs], [len(s.token_ids) for s in seqs],
                      [t for s in seqs for t in s.token_ids], [s.context_len for s in seqs],
                      [s.sample for s in seqs], [s.from_last_step for s in seqs], offsets, counts, blocks,
                      {s.request_id: list(s.encoder_table) for s in seqs if s.encoder_table is not None})

    def seqs(self) -> list[ScheduledSeq]:
        """The same rows as ScheduledSeqs (tools and tests)."""
        out = []
        tokens, blocks = self.token_ids.tolist(), self.blocks.tolist()
        t = b = 0
        for i, rid in enumerate(self.request_ids):
            k = int(self.num_tokens[i])
            tables = []
            for count in self.block_counts[i].tolist():
                tables.append(blocks[b:b + count])
                b += count
            out.append(ScheduledSeq(rid, tokens[t:t + k], int(self.context_lens[i]), tables, bool(self.sample[i]),
                                    bool(self.from_last_step[i]), self.table_offsets[i].tolist(),
                                    self.encoder_tables.get(rid)))
            t += k
        return out

    def to_wire(self) -> list:
        flags = self.sample.astype(np.uint8) | (self.from_last_step.astype(np.uint8) << 1)
        def i32(a: np.ndarray) -> bytes:
            return np.asarray(a, "<i4").tobytes()

        return [self.request_ids, i32(self.num_tokens), i32(self.token_ids), i32(self.context_lens), flags.tobytes(),
                self.table_offsets.shape[1], i32(self.table_offsets), i32(self.block_counts), i32(self.blocks),
                self.encoder_tables]

    @classmethod
    def from_wire(cls, wire: list) -> CachedRows:
        ids, num, tokens, context, flags, groups, offsets, counts, blocks, encoder = wire
        flags = np.frombuffer(flags, "u1")
        n = len(ids)
        return cls(ids, _int64(num), _int64(tokens), _int64(context), (flags & 1).astype(bool),
                   (flags & 2).astype(bool), _int64(offsets).reshape(n, groups), _int64(counts).reshape(n, groups),
                   _int64(blocks), encoder)


@dataclass
class StepPlan:
    """Everything every worker needs for one forward step: one row per scheduled request.

    new_requests: rows of requests the workers have not seen (announced with their prompt)
    cached:   the rows of requests they hold, as columns (None: no such rows)
    finished: request ids the workers may forget (after this step).
    copies:   (src, dst) block pairs to copy in every cache tensor before any K/V is written
              (copy-on-write of a shared partial block; ids are unique across layer groups).
    """

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached: CachedRows | None = None
    finished: list[str] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_seqs(cls, step_id: int, seqs: Sequence[ScheduledSeq], new_requests: Sequence[NewRequest] = (),
                  finished: Sequence[str] = (), copies: Sequence[tuple[int, int]] = ()) -> StepPlan:
        """A plan from rows as ScheduledSeqs (tools and tests): the row of a request announced in
        `new_requests` becomes that NewRequest's work (its tables whole), the others `cached`."""
        first = {r.request_id: r for r in new_requests}
        new, cached = [], []
        for s in seqs:
            r = first.pop(s.request_id, None)
            if r is None:
                cached.append(s)
                continue
            check(not s.from_last_step and s.table_offsets is None, "seqs", s.request_id,
                  "the first row of a new request: whole tables, no token from a previous step")
            new.append(replace(r, context_len=s.context_len, num_tokens=len(s.token_ids), sample=s.sample,
                               block_tables=[list(t) for t in s.block_tables], encoder_table=s.encoder_table))
            check(new[-1].token_ids == list(s.token_ids), "seqs", s.request_id,
                  "token ids that continue the request's prompt_ids + output_ids from context_len")
        check(not first, "new_requests", sorted(first), "requests with a row in seqs")
        return cls(step_id, new, CachedRows.from_seqs(cached) if cached else None, list(finished), list(copies))

    def all_seqs(self) -> list[ScheduledSeq]:
        """Every row of the step as a ScheduledSeq: the new requests', then the cached ones."""
        return ([r.seq() for r in self.new_requests if not r.is_announcement]
                + ([] if self.cached is None else self.cached.seqs()))

    @property
    def num_new_tokens(self) -> int:
        cached = self.cached
        return sum(r.num_tokens for r in self.new_requests) + (
            0 if cached is None else int(cached.num_tokens.sum() + cached.from_last_step.sum()))

    def to_msgpack(self) -> bytes:
        return msgpack.packb({
            "step_id": self.step_id,
            "new": [r.to_wire() for r in self.new_requests],
            "cached": None if self.cached is None else self.cached.to_wire(),
            "finished": self.finished,
            "copies": [list(c) for c in self.copies],
        })

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepPlan:
        d = msgpack.unpackb(data)
        return cls(
            step_id=d["step_id"],
            new_requests=[NewRequest.from_wire(r) for r in d["new"]],
            cached=None if d["cached"] is None else CachedRows.from_wire(d["cached"]),
            finished=d["finished"],
            copies=[tuple(c) for c in d["copies"]],
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
    (A list of per-row messages would cost a Python object per request per step twice over.)

    grammars_ready: requests whose grammar the driver compiled since its previous output (the
                    scheduler may now have them drawn: workers/grammar.py)
    grammar_errors: request id -> why its grammar did not compile (the scheduler fails it alone)
    grammar_busy: request id -> why its grammar was not compiled for want of compile capacity (the
                  scheduler fails it alone, as unavailable: workers/grammar.py MAX_STUCK_COMPILES)
    """

    step_id: int
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> its logprobs
    # request id -> [(index of a prompt token, its logprobs)] (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    grammars_ready: list[str] = field(default_factory=list)
    grammar_errors: dict[str, str] = field(default_factory=dict)
    grammar_busy: dict[str, str] = field(default_factory=dict)

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
                              "logprobs": lps, "prompt_logprobs": plps, "grammars_ready": self.grammars_ready,
                              "grammar_errors": self.grammar_errors, "grammar_busy": self.grammar_busy})

    @classmethod
    def from_msgpack(cls, data: bytes) -> StepOutput:
        d = msgpack.unpackb(data)
        tokens = d["tokens"]
        lps = {i: TokenLogprobs(tokens[i], lp, tuple((int(t), v) for t, v in top)) for i, lp, top in d["logprobs"]}
        plps = {rid: [(i, TokenLogprobs(t, lp, tuple((int(a), v) for a, v in top))) for i, t, lp, top in items]
                for rid, items in d.get("prompt_logprobs", ())}
        return cls(d["step_id"], d["ids"], tokens, lps, plps, d.get("grammars_ready", []),
                   d.get("grammar_errors", {}), d.get("grammar_busy", {}))
