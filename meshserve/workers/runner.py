"""Runs one StepPlan: packed inputs and attention metadata, the forward pass, sampling on rank 0.

Per step: order sequences prefill-first (the metadata's layout), build AttentionMetadata once
per KV layer group (one for most models; kvstore/groups.py), ask each backend instance for its
plan once per group it serves, run the model (each layer writes its new K/V and attends through
its backend with its group's plan), then sample the sequences whose last known token was computed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, compress

import numpy as np
import torch
import torch.distributed as dist

from meshserve.attention.backend import AttentionBackend, KVCache
from meshserve.attention.metadata import AttentionMetadata
from meshserve.core.arith import local_len
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.tensors import to_device
from meshserve.errors import check
from meshserve.kvstore.cache_tensors import copy_blocks
from meshserve.workers.constraints import ConstraintBuilder, RequestConstraints
from meshserve.workers.decode_graphs import DecodeGraphs
from meshserve.workers.grammar import GrammarState, wait_for_any
from meshserve.workers.models.contract import GenerativeModel
from meshserve.workers.models.transformer import EncoderStep, ForwardContext, LayerAttention
from meshserve.workers.piecewise_graphs import PiecewiseGraphs
from meshserve.workers.prompt_logprobs import PromptLogprobs, prompt_logprobs, wanted_rows
from meshserve.workers.request_tables import RequestTables
from meshserve.workers.sampler import Draw, Sampler, SamplingRow
from meshserve.workers.step import CachedRows, NewRequest, ScheduledSeq, StepOutput, StepPlan

# How long a step that computes nothing waits for a grammar's compile before it returns (the
# scheduler then polls again, and meanwhile admits what arrived).
GRAMMAR_POLL_S = 0.02
# On a CPU a step of more new tokens than this (a large prefill) runs its forward in parts of
# whole sequences, each at most this many tokens where a sequence allows: a 4096-token forward's
# activations ([T, 2I] gate/up and the rest, 25 MB and more for the demo model) leave the caches
# between the ops that write and read them. 64 prompts of 64 tokens: 490-540 -> 432-434 ms
# (docs/performance.md, "Packed oneDNN weights"). The values are those of one forward: rows
# are independent, each sequence's attention sees only its own keys.
CPU_FORWARD_TOKENS = 2048


@dataclass
class _Request:
    """A request as the runner knows it; the sampler reads it as its SamplingRow (same fields)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # kept for the requests that read it (penalties, seeds)
    encoder_ids: list[int] = field(default_factory=list)  # encoder-decoder models: the encoder input
    encoder_table: list[int] = field(default_factory=list)  # and the blocks of its cross K/V
    constraints: RequestConstraints | None = None  # logit_bias, bad words, grammar, ... (workers/constraints.py)


@dataclass(frozen=True)
class _Compiling:
    """A request's grammar on its way: reported ready or failed in a step output, or failed once
    `deadline` (time.monotonic()) passes (the announcement's grammar_timeout_s; inf: none)."""

    grammar: GrammarState
    timeout_s: float
    deadline: float


@dataclass
class _InFlight:
    """A submitted step whose sampled tokens the host has not read yet (`result` once read)."""

    step_id: int
    has_rows: bool = False  # it computes something (else it only announces, forgets or polls)
    request_ids: list[str] = field(default_factory=list)  # the request of each drawn row
    rows: list = field(default_factory=list)  # their _Request objects (an id may be reused meanwhile)
    draw: Draw | None = None
    result: StepOutput | None = None
    prompt_logprobs: PromptLogprobs | None = None  # already on the host


class ModelRunner:
    """Executes step plans on one rank. `is_driver` (rank 0) samples; other ranks only compute.

    `submit` runs a step up to its draw on the device and returns at once; `collect` reads the
    oldest submitted step's tokens (the step's one device->host copy). A step may be submitted
    before the previous one is collected: its sequences marked `from_last_step` take their
    input token from the previous step's draw on the device (overlap scheduling).
    """

    def __init__(self, model: GenerativeModel, *, backends: Sequence[AttentionBackend], kv_caches: Sequence[KVCache],
                 block_size: int, device: torch.device | str, is_driver: bool = True, seed: int = 0,
                 dcp_size: int = 1, dcp_rank: int = 0, layer_groups: Sequence[int] | None = None,
                 encoder_backend: AttentionBackend | None = None, constraints: ConstraintBuilder | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        """block_size: physical tokens per block of this rank's cache. Under DCP (dcp_size > 1) the
        block tables in step plans are logical (block_size * dcp_size tokens per block) and this
        rank stores positions dcp_rank, dcp_rank + dcp_size, ...
        layer_groups: per layer, the KV group whose block tables it reads (KVGroupLayout.group_of_layer);
        default: one group.
        encoder_backend: encoder-decoder models: the backend of the encoder's self-attention.
        constraints: makes the driver's per-request constraints (None: requests with any are refused).
        tp_group: the replica's ranks when tp > 1: a step whose rows take their input token from the
        previous step's draw gets rank 0's drawn tokens by a broadcast in it (overlap scheduling)."""
        num_layers = len(backends)  # one per cached attention layer (the model's attention_specs)
        check(len(kv_caches) == num_layers, "kv_caches", len(kv_caches), f"one per attention layer ({num_layers})")
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * num_layers
        check(len(self.layer_groups) == num_layers, "layer_groups", len(self.layer_groups),
              f"one per layer ({num_layers})")
        self.num_groups = max(self.layer_groups) + 1
        self.model = model
        self.backends = list(backends)
        self.encoder_backend = encoder_backend
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.device = torch.device(device)
        self.is_driver = is_driver
        self.sampler = Sampler(seed=seed, device=self.device) if is_driver else None
        self.tp_group = tp_group
        self.requests: dict[str, _Request] = {}
        self.tables = RequestTables(self.num_groups)  # every known request's block tables, one row each
        # Set by the worker when decode steps replay CUDA graphs (workers/decode_graphs.py).
        self.decode_graphs: DecodeGraphs | None = None
        # Set by the worker when steps with prefill tokens replay piecewise graphs (workers/piecewise_graphs.py).
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self._in_flight: deque[_InFlight] = deque()
        self._last: _InFlight | None = None  # the latest submitted step that drew tokens
        self._last_rows: dict[str, int] = {}  # request id -> its row in self._last.draw.tokens
        self._reads_history: set[str] = set()  # requests with penalties, a seed or constraints (they read their tokens)
        self.constraints = constraints
        self._constrained: set[str] = set()  # requests with constraints (a subset of _reads_history)
        self._compiling: dict[str, _Compiling] = {}  # grammars whose outcome no step output has reported
        self._wants_prompt_logprobs: set[str] = set()

    @property
    def num_active_requests(self) -> int:
        return len(self.requests)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Run a step up to its draw on the device; `collect` returns its tokens."""
        reused: set[str] = set()  # ids that left and came back in this plan: the old request goes first
        if plan.finished and plan.new_requests:
            reused = {n.request_id for n in plan.new_requests}.intersection(plan.finished)
            for rid in reused:
                self._forget(rid)
        for new in plan.new_requests:
            check(new.num_tokens >= 0, "num_tokens", new.num_tokens,
                  f"an integer >= 0 (the first row of {new.request_id}; 0: announced only)")
            self.announce(new)
        copy_blocks(self.kv_caches, plan.copies)  # copy-on-write, before any K/V is written
        first_rows = [r for r in plan.new_requests if not r.is_announcement]
        flight = _InFlight(plan.step_id, has_rows=bool(first_rows) or plan.cached is not None)
        if flight.has_rows:
            self._run(first_rows, plan.cached, flight)
        self._in_flight.append(flight)
        for rid in plan.finished:
            if rid not in reused:
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self._reads_history.discard(rid)
        self._constrained.discard(rid)
        self._stop_compiling(rid)
        self._wants_prompt_logprobs.discard(rid)
        self.tables.remove(rid)

    def _stop_compiling(self, rid: str) -> None:
        """The request left while its grammar compiled: unless another request waits for that compile,
        it is dropped (queued) or written off (running: workers/grammar.py)."""
        c = self._compiling.pop(rid, None)
        if c is not None:
            c.grammar.stop_waiting(overdue=False)

    def announce(self, new: NewRequest) -> None:
        """Know a request from now on: its settings and tokens, an empty row of block tables
        (a step's row fills it)."""
        req = self.requests[new.request_id] = _Request(SamplingParams.from_dict(new.sampling),
                                                       list(new.prompt_ids), list(new.output_ids),
                                                       encoder_ids=list(new.encoder_ids))
        self._constrained.discard(new.request_id)  # (announced again after a detach)
        self._stop_compiling(new.request_id)
        self._wants_prompt_logprobs.discard(new.request_id)
        if req.params.prompt_logprobs is not None:
            self._wants_prompt_logprobs.add(new.request_id)
        if req.params.has_constraints and self.is_driver:
            check(self.constraints is not None, "sampling", new.request_id,
                  "no logit_bias, allowed_token_ids, bad_words, min_tokens or structured_outputs: this "
                  "worker has no tokenizer to apply them")
            req.constraints = self.constraints.make(req.params, req.output_ids)
            self._constrained.add(new.request_id)
            if req.constraints.grammar is not None:
                t = new.grammar_timeout_s
                self._compiling[new.request_id] = _Compiling(req.constraints.grammar, t,
                                                             time.monotonic() + t if t > 0 else float("inf"))
        if req.params.has_penalties or req.params.seed is not None or req.constraints is not None:
            self._reads_history.add(new.request_id)
        else:
            self._reads_history.discard(new.request_id)  # (announced again after a detach)
        self.tables.remove(new.request_id)  # announced again (after a detach): its tables start over
        self.tables.add(new.request_id)

    def collect(self) -> StepOutput:
        """The tokens of the oldest submitted step not yet collected."""
        check(bool(self._in_flight), "collect", "no step in flight", "one submit() per collect()")
        flight = self._in_flight.popleft()
        if (self._compiling and flight.result is None and not flight.has_rows
                and not any(f.has_rows for f in self._in_flight)):
            # Nothing to compute but grammars to wait for (the scheduler polls with empty plans):
            # return when one is compiled, not at once, so that polling does not spin.
            wait_for_any([c.grammar for c in self._compiling.values()], GRAMMAR_POLL_S)
        return self._read(flight)

    def step_ready(self) -> bool:
        """Whether `collect` would return without waiting for the device: the oldest step in
        flight drew nothing here (another rank samples) or its draw reached the host. Never blocks."""
        if not self._in_flight:
            return True
        flight = self._in_flight[0]
        return flight.result is not None or flight.draw is None or flight.draw.is_ready()

    def _grammar_outcomes(self, result: StepOutput) -> None:
        """Report the grammars whose compile ended or passed its bound (once each) in `result`.
        (A compile past its bound runs on to its end: xgrammar cannot stop it; its thread is
        written off and replaced: workers/grammar.py.)"""
        now = time.monotonic()
        for rid, c in list(self._compiling.items()):
            if c.grammar.is_compiling:
                if now > c.deadline:
                    del self._compiling[rid]
                    c.grammar.stop_waiting(overdue=True)
                    result.grammar_errors[rid] = f"not compiled within grammar_compile_timeout_s={c.timeout_s:g} s"
                continue
            del self._compiling[rid]
            error = c.grammar.compile_error()
            if error is None:
                result.grammars_ready.append(rid)
            elif c.grammar.refused_busy:
                result.grammar_busy[rid] = error
            else:
                result.grammar_errors[rid] = error

    def _read(self, flight: _InFlight) -> StepOutput:
        if flight.result is None:
            result = flight.result = StepOutput(flight.step_id)
            if flight.prompt_logprobs and self.is_driver:
                result.prompt_logprobs = flight.prompt_logprobs
            if self._compiling:
                self._grammar_outcomes(result)
            if flight.draw is not None:
                tokens, logprobs = flight.draw.to_host()  # waits for this step (and only this one)
                history = self._reads_history  # (requests forgotten meanwhile are not in it)
                if history:  # (a row of a request that left and whose id came back feeds the old object)
                    for rid, req, tok in zip(flight.request_ids, flight.rows, tokens):
                        if rid in history:
                            req.output_ids.append(tok)
                result.request_ids, result.token_ids = flight.request_ids, tokens
                if logprobs.count(None) < len(logprobs):
                    result.logprobs = {i: lp for i, lp in enumerate(logprobs) if lp is not None}
        return flight.result

    @torch.inference_mode()
    def _run(self, new_requests: Sequence[NewRequest], cached: CachedRows | None, flight: _InFlight) -> None:
        requests, tables = self.requests, self.tables
        cached_rows = None if cached is None else self._check_cached(cached)  # before any change
        for r in new_requests:
            tables.apply(ScheduledSeq(r.request_id, [], 0, r.block_tables))  # whole tables
            if r.encoder_table is not None:
                requests[r.request_id].encoder_table = list(r.encoder_table)
        ids = [r.request_id for r in new_requests]  # the request of each row, in the step's order
        tokens = np.fromiter(chain.from_iterable(r.token_ids for r in new_requests), np.int64,
                             sum(r.num_tokens for r in new_requests))  # the known new tokens, row after row
        cols = _Columns.of_new(new_requests, tables.row_of)
        if cached is not None:
            tables.apply_rows(cached_rows, cached.table_offsets, cached.block_counts, cached.blocks)
            for rid, table in cached.encoder_tables.items():
                requests[rid].encoder_table = list(table)
            more = _Columns(cached_rows, cached.context_lens, cached.num_tokens, cached.from_last_step,
                            cached.sample)
            cols = cols.concat(more) if ids else more
            tokens = np.concatenate([tokens, cached.token_ids]) if ids else cached.token_ids
            ids += cached.request_ids
        # The metadata wants prefills (and prompt chunks) first, then single-token decodes.
        if not cols.decodes_last():
            perm = np.argsort(cols.is_decode, kind="stable")
            tokens = _segments(tokens, cols.known, perm)
            ids, cols = [ids[i] for i in perm], cols.take(perm)
        batch = _PackedBatch.of(cols)
        local = local_len(cols.seq_lens, self.dcp_size, self.dcp_rank)  # [S] tokens stored here
        tables.check_cover(cols.rows, local, self.block_size, ids)
        rows = [tables.gather(cols.rows, g) for g in range(self.num_groups)]  # per group [S, W] int32
        fill = self._from_last_step(ids, cols, batch.ends)
        graphs = self.decode_graphs
        if graphs is not None and 0 < len(ids) <= graphs.max_batch and cols.all_sampled_decodes():
            token_ids = np.zeros(len(ids), np.int64)  # a decode row knows its token or takes it from `fill`
            token_ids[cols.known.astype(bool)] = tokens
            logits = graphs.run_arrays(token_ids, cols.context_lens, rows, fill=fill)  # [N, V]: every row samples
            sample_ids = ids
        else:
            to_sample = np.flatnonzero(cols.sample).tolist()
            logits = self._run_eager(ids, cols, tokens, rows, batch, to_sample, fill, flight)
            sample_ids = [ids[i] for i in to_sample]
        if sample_ids and self.is_driver:
            self._draw(sample_ids, logits, flight)
        elif sample_ids:  # rank 0 draws; the next step may take these rows' tokens (_previous_draw)
            self._last_rows = dict(zip(sample_ids, range(len(sample_ids))))

    def _check_cached(self, cached: CachedRows) -> np.ndarray:
        """[n] the RequestTables rows of a plan's cached rows, after checking that the runner knows
        each request, (from_last_step) drew its last token, and holds the tables the row changes."""
        ids, requests, last_rows = cached.request_ids, self.requests, self._last_rows
        if not all(map(requests.__contains__, ids)):  # (the common case in C; the error names the first)
            check(False, "request_id", next(r for r in ids if r not in requests), "a request announced in new_requests")
        drawn = list(compress(ids, cached.from_last_step.tolist()))
        if not all(map(last_rows.__contains__, drawn)):
            check(False, "from_last_step", next(r for r in drawn if r not in last_rows),
                  "set only for a request that drew a token in the previous step that sampled")
        rows = np.fromiter(map(self.tables.row_of.__getitem__, ids), np.int64, len(ids))
        self.tables.check_changes(rows, ids, cached.table_offsets)
        return rows

    def _from_last_step(self, ids: Sequence[str], cols: _Columns, ends: np.ndarray):
        """A function that writes the tokens drawn in the previous step into a packed input_ids
        tensor (on the device, in stream order: no wait), or None when no sequence needs one.
        ids: the request of each row."""
        which = np.flatnonzero(cols.from_last_step)
        if not len(which):
            return None
        tokens = self._previous_draw()
        last_rows = self._last_rows
        dst = to_device(torch.from_numpy(ends[which]), self.device)
        src = np.fromiter(map(last_rows.__getitem__, map(ids.__getitem__, which.tolist())), np.int64, len(which))
        src = to_device(torch.from_numpy(src), self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return fill

    def _previous_draw(self) -> torch.Tensor:
        """[n] the tokens the previous sampling step drew, on this rank's device: rank 0's draw,
        which a tp > 1 replica broadcasts to its other ranks here (every rank runs the same plan,
        so all of them join; on CUDA the broadcast is queued in stream order: the host waits for nothing)."""
        if self.tp_group is None:
            return self._last.draw.tokens
        if self.is_driver:
            tokens = self._last.draw.tokens
        else:
            tokens = torch.empty(len(self._last_rows), dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, group=self.tp_group, group_src=0)
        return tokens

    def _run_eager(self, ids: Sequence[str], cols: _Columns, tokens: np.ndarray, tables: list[np.ndarray],
                   batch: _PackedBatch, to_sample: list[int], fill, flight: _InFlight | None = None
                   ) -> torch.Tensor | None:
        """ids: the request of each row; tokens: the rows' known new tokens, row after row;
        tables: per KV layer group, the rows' block tables ([S, W] int32)."""
        encoder = None
        cross: dict = {}  # encoder-decoder: group 0's metadata carries the encoder tables too
        if self.encoder_backend is not None:
            reqs = [self.requests[rid] for rid in ids]
            cross = dict(encoder_seq_lens=[len(r.encoder_ids) for r in reqs],
                         encoder_block_tables=[r.encoder_table for r in reqs])
            encoder = self._encoder_step([r for r, c in zip(reqs, cols.context_lens.tolist()) if c == 0])
        # A token drawn by the previous step is still on the device: 0 holds its place until `fill`.
        input_ids = to_device(torch.from_numpy(batch.input_ids(tokens, cols.from_last_step)), self.device)
        if fill is not None:
            fill(input_ids)
        positions = to_device(torch.from_numpy(batch.positions), self.device)
        parts = self._forward_parts(batch.query_lens) if encoder is None and not cross else None
        if parts is None:
            hidden = self._forward(batch.query_lens, batch.seq_lens, tables, input_ids, positions, encoder, cross)
        else:  # [T, hidden], part after part
            hidden = torch.cat([self._forward(batch.query_lens[a:b], batch.seq_lens[a:b], [t[a:b] for t in tables],
                                              input_ids[ta:tb], positions[ta:tb], None, {})
                                for a, b, ta, tb in parts])
        if self._wants_prompt_logprobs and flight is not None:  # (workers/prompt_logprobs.py)
            wanted = wanted_rows(ids, cols.context_lens, batch.query_lens, batch.ends, self.requests)
            if wanted:
                flight.prompt_logprobs = prompt_logprobs(self.model.compute_logits, hidden, wanted)
        if not to_sample:
            return None
        # Every rank computes logits: a vocabulary-parallel LM head gathers them collectively.
        rows = to_device(torch.from_numpy(batch.ends[to_sample]), self.device)
        return self.model.compute_logits(hidden[rows])  # [N, V] float32

    def _forward(self, query_lens: list[int], seq_lens: list[int], tables: list[np.ndarray], input_ids: torch.Tensor,
                 positions: torch.Tensor, encoder: EncoderStep | None, cross: dict) -> torch.Tensor:
        """The model's forward over these sequences' new tokens ([T] ids and positions): metadata
        per KV group, one plan per backend instance and group. Returns [T, hidden]: from the
        piecewise graphs (a view of their buffer) where they serve the step."""
        layers = self._step_layers(query_lens, seq_lens, tables, cross)
        graphs = self.piecewise_graphs
        if graphs is not None and encoder is None and not cross and graphs.serves(input_ids.shape[0]):
            return graphs.run(input_ids, positions, layers)
        return self.model(input_ids, positions, ForwardContext(layers=layers, encoder=encoder))

    def _step_layers(self, query_lens: list[int], seq_lens: list[int], tables: list[np.ndarray],
                     cross: dict) -> list[LayerAttention]:
        """Each layer's attention for this step: metadata per KV group, one plan per backend
        instance and group."""
        metas = [
            AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens,
                                    block_tables=tables[g], block_size=self.block_size,
                                    device=self.device, dcp_size=self.dcp_size, dcp_rank=self.dcp_rank, kv_group=g,
                                    **(cross if g == 0 else {}))
            for g in range(self.num_groups)
        ]  # fmt: skip
        plans: dict[tuple[int, int], object] = {}  # plan once per backend instance and group per step
        layers = []
        for b, kv, g in zip(self.backends, self.kv_caches, self.layer_groups):
            plan = plans.get((id(b), g))
            if plan is None:
                plan = plans[id(b), g] = b.plan(metas[g])
            layers.append(LayerAttention(b, plan, kv, metas[g].slot_mapping))
        return layers

    def _forward_parts(self, query_lens: list[int]) -> list[tuple[int, int, int, int]] | None:
        """On a CPU, a step of more than CPU_FORWARD_TOKENS new tokens runs in `forward_parts`;
        None: one forward (other devices, smaller steps, context parallel)."""
        if self.device.type != "cpu" or self.dcp_size > 1 or sum(query_lens) <= CPU_FORWARD_TOKENS:
            return None
        parts = forward_parts(query_lens, CPU_FORWARD_TOKENS)
        return parts if len(parts) > 1 else None

    def _encoder_step(self, reqs: Sequence[_Request]) -> EncoderStep | None:
        """The packed encoder inputs of requests starting (or restarting) their decoder this step;
        the metadata's slot mapping is where each encoder token's cross K/V go."""
        if not reqs:
            return None
        lens = [len(r.encoder_ids) for r in reqs]
        meta = AttentionMetadata.build(query_lens=lens, seq_lens=lens, block_tables=[r.encoder_table for r in reqs],
                                       block_size=self.block_size, device=self.device)
        ids = np.fromiter(chain.from_iterable(r.encoder_ids for r in reqs), np.int64, sum(lens))
        positions = np.concatenate([np.arange(n) for n in lens])
        return EncoderStep(input_ids=to_device(torch.from_numpy(ids), self.device),
                           positions=to_device(torch.from_numpy(positions), self.device),
                           backend=self.encoder_backend, plan=self.encoder_backend.plan(meta),
                           slot_mapping=meta.slot_mapping)

    def _draw(self, request_ids: list[str], logits: torch.Tensor, flight: _InFlight) -> None:
        """Draw the next token of each request from its row of logits, on the device."""
        requests = self.requests
        if self._reads_history and not self._reads_history.isdisjoint(request_ids):
            for earlier in self._in_flight:  # penalties and seeds read every token drawn so far
                self._read(earlier)
        # A _Request has a SamplingRow's fields (params, prompt_ids, output_ids): no row object per request.
        rows: list[SamplingRow] = [requests[rid] for rid in request_ids]  # type: ignore[misc]
        flight.draw = self.sampler.draw(logits, rows, constrained=bool(self._constrained)
                                        and not self._constrained.isdisjoint(request_ids))
        flight.request_ids, flight.rows = request_ids, rows
        self._last = flight
        self._last_rows = dict(zip(request_ids, range(len(request_ids))))


@dataclass(frozen=True)
class _Columns:
    """A step's rows as host arrays (one entry per row, in the step's order)."""

    rows: np.ndarray  # [S] int64 each request's row in the RequestTables
    context_lens: np.ndarray  # [S] int64 tokens already cached (the first new token's position)
    known: np.ndarray  # [S] int64 new tokens whose ids the host knows
    from_last_step: np.ndarray  # [S] bool one more new token: the one the previous step draws
    sample: np.ndarray  # [S] bool

    @classmethod
    def of_new(cls, new: Sequence[NewRequest], row_of: dict[str, int]) -> _Columns:
        n = len(new)
        return cls(rows=np.fromiter((row_of[r.request_id] for r in new), np.int64, n),
                   context_lens=np.fromiter((r.context_len for r in new), np.int64, n),
                   known=np.fromiter((r.num_tokens for r in new), np.int64, n), from_last_step=np.zeros(n, bool),
                   sample=np.fromiter((r.sample for r in new), bool, n))

    @property
    def query_lens(self) -> np.ndarray:
        """[S] new tokens, the one drawn by the previous step included."""
        return self.known + self.from_last_step

    @property
    def seq_lens(self) -> np.ndarray:
        return self.context_lens + self.query_lens

    @property
    def is_decode(self) -> np.ndarray:
        """The metadata's notion: exactly one new token after a non-empty cached context."""
        return (self.query_lens == 1) & (self.context_lens > 0)

    def decodes_last(self) -> bool:
        dec = self.is_decode
        return bool((dec[1:] >= dec[:-1]).all())  # no prefill after a decode

    def all_sampled_decodes(self) -> bool:
        return bool(self.is_decode.all() and self.sample.all())

    def take(self, perm: np.ndarray) -> _Columns:
        return _Columns(self.rows[perm], self.context_lens[perm], self.known[perm], self.from_last_step[perm],
                        self.sample[perm])

    def concat(self, other: _Columns) -> _Columns:
        return _Columns(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self)))


def forward_parts(query_lens: Sequence[int], limit: int) -> list[tuple[int, int, int, int]]:
    """The sequences (their new tokens, in order) in consecutive parts of at most `limit` tokens,
    a sequence of more than `limit` alone: (row start, row end, token start, token end) each."""
    parts, first, start, tokens = [], 0, 0, 0
    for i, n in enumerate(query_lens):
        if tokens and tokens + n > limit:
            parts.append((first, i, start, start + tokens))
            first, start, tokens = i, start + tokens, 0
        tokens += n
    parts.append((first, len(query_lens), start, start + tokens))
    return parts


def _segments(flat: np.ndarray, counts: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """`flat` holds counts[i] entries per row i, row after row; the same entries with the rows in
    the order `perm`."""
    starts = np.cumsum(counts) - counts
    c = counts[perm]
    return flat[np.arange(int(c.sum())) + np.repeat(starts[perm] - (np.cumsum(c) - c), c)]


@dataclass(frozen=True)
class _PackedBatch:
    """Host arrays of a step's sequences in packed order, built without a loop over tokens.

    query_lens, seq_lens: per sequence (lists, as AttentionMetadata.build takes them)
    ends:      [S] int64 index of each sequence's last new token in the packed batch
    positions: [T] int64 global position of each new token
    """

    query_lens: list[int]
    seq_lens: list[int]
    ends: np.ndarray
    positions: np.ndarray

    @classmethod
    def of(cls, cols: _Columns) -> _PackedBatch:
        context, q = cols.context_lens, cols.query_lens
        ends = np.cumsum(q) - 1
        starts = ends + 1 - q
        positions = np.arange(int(q.sum())) + np.repeat(context - starts, q)
        return cls(q.tolist(), (context + q).tolist(), ends, positions)

    def input_ids(self, known: np.ndarray, from_last_step: np.ndarray) -> np.ndarray:
        """[T] int64 token ids from the rows' known tokens (row after row); 0 in the place of a
        token the previous step draws (`from_last_step`: always a row's last)."""
        if not from_last_step.any():
            return known
        ids = np.zeros(len(self.positions), np.int64)
        has = np.ones(len(self.positions), bool)
        has[self.ends[from_last_step]] = False
        ids[has] = known
        return ids
