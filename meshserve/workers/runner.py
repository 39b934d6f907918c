"""Runs one StepPlan: packed inputs and attention metadata, the forward pass, sampling on rank 0.

Per step: order sequences prefill-first (the metadata's layout), build AttentionMetadata once
per KV layer group (one for most models; kvstore/groups.py), ask each backend instance for its
plan once per group it serves, run the model (each layer writes its new K/V and attends through
its backend with its group's plan), then sample the sequences whose last known token was computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, compress

import numpy as np
import torch

from meshserve.attention.backend import AttentionBackend, AttentionProblem, KVCache
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.registry import select_backend_for_layers
from meshserve.attention.spec import AttentionSpec
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.tensors import to_device
from meshserve.errors import check
from meshserve.kvstore.cache_tensors import copy_blocks
from meshserve.workers.constraints import ConstraintBuilder, RequestConstraints
from meshserve.workers.decode_graphs import DecodeGraphs
from meshserve.workers.models.transformer import CausalLM, EncoderStep, ForwardContext, LayerAttention
from meshserve.workers.prompt_logprobs import PromptLogprobs, prompt_logprobs, wanted_rows
from meshserve.workers.request_tables import RequestTables
from meshserve.workers.sampler import Draw, Sampler, SamplingRow
from meshserve.workers.step import DecodeRows, ScheduledSeq, StepOutput, StepPlan

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def make_backends(specs: Sequence[AttentionSpec], *, name: str | None, dtype: torch.dtype, block_size: int,
                  max_model_len: int, device: torch.device, dcp_size: int = 1) -> list[AttentionBackend]:
    """One backend instance per distinct spec, listed per layer.

    The backend class is chosen once (by name, or the first by priority that serves every
    layer's problem); otherwise the registry's error lists the reasons per layer kind. MLA layers get
    an MLAAttention instead (its decode and prefill backends are chosen from their own tables),
    sparse MLA layers a SparseMLAAttention (one backend from the MLA_SPARSE table).
    """
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None

    def problem(spec: AttentionSpec) -> AttentionProblem:
        return AttentionProblem(spec=spec, dtype=DTYPE_NAMES[dtype], block_size=block_size,
                                max_model_len=max_model_len, device=device.type, compute_capability=cc,
                                dcp_size=dcp_size)

    distinct = list(dict.fromkeys(specs))
    standard = [spec for spec in distinct if spec.mla is None]
    instances: dict[AttentionSpec, object] = {}
    if standard:
        # One class for all layers (windowed and full, with or without sinks), or the reasons why not.
        chosen = select_backend_for_layers([problem(spec) for spec in standard], name)
        instances.update({spec: chosen(problem(spec)) for spec in standard})
    for spec in distinct:
        if spec.mla is not None and spec.mla.indexer is not None:  # sparse MLA: one backend, both phases
            from meshserve.attention.mla.sparse_layer import SparseMLAAttention

            instances[spec] = SparseMLAAttention.named(problem(spec), name)
        elif spec.mla is not None:  # MLA layers: a decode and a prefill backend, each from its own table
            from meshserve.attention.mla.layer import MLAAttention

            instances[spec] = MLAAttention.named(problem(spec), name)
    return [instances[spec] for spec in specs]


@dataclass
class _Request:
    """A request as the runner knows it; the sampler reads it as its SamplingRow (same fields)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # kept for the requests that read it (penalties, seeds)
    encoder_ids: list[int] = field(default_factory=list)  # encoder-decoder models: the encoder input
    encoder_table: list[int] = field(default_factory=list)  # and the blocks of its cross K/V
    constraints: RequestConstraints | None = None  # logit_bias, bad words, grammar, ... (workers/constraints.py)


@dataclass
class _InFlight:
    """A submitted step whose sampled tokens the host has not read yet (`result` once read)."""

    step_id: int
    request_ids: list[str] = field(default_factory=list)  # the request of each drawn row
    draw: Draw | None = None
    prompt_logprobs: PromptLogprobs | None = None  # already on the host
    result: StepOutput | None = None


class ModelRunner:
    """Executes step plans on one rank. `is_driver` (rank 0) samples; other ranks only compute.

    `submit` runs a step up to its draw on the device and returns at once; `collect` reads the
    oldest submitted step's tokens (the step's one device->host copy). A step may be submitted
    before the previous one is collected: its sequences marked `from_last_step` take their
    input token from the previous step's draw on the device (overlap scheduling).
    """

    def __init__(self, model: CausalLM, *, backends: Sequence[AttentionBackend], kv_caches: Sequence[KVCache],
                 block_size: int, device: torch.device | str, is_driver: bool = True, seed: int = 0,
                 dcp_size: int = 1, dcp_rank: int = 0, layer_groups: Sequence[int] | None = None,
                 encoder_backend: AttentionBackend | None = None, constraints: ConstraintBuilder | None = None) -> None:
        """block_size: physical tokens per block of this rank's cache. Under DCP (dcp_size > 1) the
        block tables in step plans are logical (block_size * dcp_size tokens per block) and this
        rank stores positions dcp_rank, dcp_rank + dcp_size, ...
        layer_groups: per layer, the KV group whose block tables it reads (KVGroupLayout.group_of_layer);
        default: one group.
        encoder_backend: encoder-decoder models: the backend of the encoder's self-attention.
        constraints: makes the driver's per-request constraints (None: requests with any are refused)."""
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
        self.requests: dict[str, _Request] = {}
        self.tables = RequestTables(self.num_groups)  # every known request's block tables, one row each
        # Set by the worker when decode steps replay CUDA graphs (workers/decode_graphs.py).
        self.decode_graphs: DecodeGraphs | None = None
        self._in_flight: deque[_InFlight] = deque()
        self._last: _InFlight | None = None  # the latest submitted step that drew tokens
        self._last_rows: dict[str, int] = {}  # request id -> its row in self._last.draw.tokens
        self._reads_history: set[str] = set()  # requests with penalties, a seed or constraints (they read their tokens)
        self.constraints = constraints
        self._constrained: set[str] = set()  # requests with constraints (a subset of _reads_history)
        self._wants_prompt_logprobs: set[str] = set()

    @property
    def num_active_requests(self) -> int:
        return len(self.requests)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        """Run a step up to its draw on the device; `collect` returns its tokens."""
        for new in plan.new_requests:
            req = self.requests[new.request_id] = _Request(SamplingParams.from_dict(new.sampling),
                                                           list(new.prompt_ids), list(new.output_ids),
                                                           encoder_ids=list(new.encoder_ids))
            self._constrained.discard(new.request_id)  # (announced again after a detach)
            if req.params.prompt_logprobs is not None:
                self._wants_prompt_logprobs.add(new.request_id)
            if req.params.has_constraints and self.is_driver:
                check(self.constraints is not None, "sampling", new.request_id,
                      "no logit_bias, allowed_token_ids, bad_words, min_tokens or structured_outputs: this "
                      "worker has no tokenizer to apply them")
                req.constraints = self.constraints.make(req.params, req.output_ids)
                self._constrained.add(new.request_id)
            if req.params.has_penalties or req.params.seed is not None or req.constraints is not None:
                self._reads_history.add(new.request_id)
            else:
                self._reads_history.discard(new.request_id)  # (announced again after a detach)
            self.tables.remove(new.request_id)  # announced again (after a detach): its tables start over
            self.tables.add(new.request_id)
        copy_blocks(self.kv_caches, plan.copies)  # copy-on-write, before any K/V is written
        flight = _InFlight(plan.step_id)
        if plan.seqs or plan.decodes is not None:
            self._run(plan.seqs, plan.decodes, flight)
        self._in_flight.append(flight)
        for rid in plan.finished:
            self.requests.pop(rid, None)
            self._reads_history.discard(rid)
            self._constrained.discard(rid)
            self._wants_prompt_logprobs.discard(rid)
            self.tables.remove(rid)

    def collect(self) -> StepOutput:
        """The tokens of the oldest submitted step not yet collected."""
        check(bool(self._in_flight), "collect", "no step in flight", "one submit() per collect()")
        return self._read(self._in_flight.popleft())

    def _read(self, flight: _InFlight) -> StepOutput:
        if flight.result is None:
            result = flight.result = StepOutput(flight.step_id)
            if flight.prompt_logprobs and self.is_driver:
                result.prompt_logprobs = flight.prompt_logprobs
            if flight.draw is not None:
                tokens, logprobs = flight.draw.to_host()  # waits for this step (and only this one)
                history = self._reads_history  # (requests forgotten meanwhile are not in it)
                if history:
                    for rid, tok in zip(flight.request_ids, tokens):
                        if rid in history:
                            self.requests[rid].output_ids.append(tok)
                result.request_ids, result.token_ids = flight.request_ids, tokens
                if logprobs.count(None) < len(logprobs):
                    result.logprobs = {i: lp for i, lp in enumerate(logprobs) if lp is not None}
        return flight.result

    @torch.inference_mode()
    def _run(self, seqs: Sequence[ScheduledSeq], decodes: DecodeRows | None, flight: _InFlight) -> None:
        requests, last_rows, tables = self.requests, self._last_rows, self.tables
        for s in seqs:
            if s.request_id not in requests or (s.from_last_step and s.request_id not in last_rows):
                check(s.request_id in requests, "request_id", s.request_id, "a request announced in new_requests")
                check(False, "from_last_step", s.request_id,
                      "set only for a request that drew a token in the previous step on this (driver) rank")
            if s.encoder_table is not None:
                requests[s.request_id].encoder_table = list(s.encoder_table)
        decode_rows = None if decodes is None else self._decode_rows(decodes)  # checked before any change
        tables.apply_all(seqs)
        # The metadata wants prefills (and prompt chunks) first, then single-token decodes.
        cols = _Columns.of(seqs, tables.row_of)
        if not cols.decodes_last():
            perm = np.argsort(cols.is_decode, kind="stable")
            seqs, cols = [seqs[i] for i in perm], cols.take(perm)
        ids = [s.request_id for s in seqs]  # the request of each row, in the step's order
        if decodes is not None:  # decode rows come last already
            ones = np.ones(len(decodes), np.int64)
            dec = _Columns(decode_rows, decodes.context_lens, ones, decodes.from_last_step, ones.astype(bool))
            cols = cols.concat(dec) if seqs else dec
            ids += decodes.request_ids
        batch = _PackedBatch.of(cols)
        local = (cols.seq_lens - self.dcp_rank + self.dcp_size - 1) // self.dcp_size  # [S] tokens stored here
        tables.check_cover(cols.rows, local, self.block_size, ids)
        rows = [tables.gather(cols.rows, g) for g in range(self.num_groups)]  # per group [S, W] int32
        fill = self._from_last_step(ids, cols, batch.ends)
        graphs = self.decode_graphs
        if graphs is not None and 0 < len(ids) <= graphs.max_batch and cols.all_sampled_decodes():
            token_ids = np.fromiter((s.token_ids[0] if s.token_ids else 0 for s in seqs), np.int64, len(seqs))
            if decodes is not None:
                token_ids = np.concatenate([token_ids, decodes.token_ids]) if seqs else decodes.token_ids
            logits = graphs.run_arrays(token_ids, cols.context_lens, rows, fill=fill)  # [N, V]: every row samples
            sample_ids = ids
        else:
            order = list(seqs) if decodes is None else [*seqs, *decodes.seqs()]
            to_sample = np.flatnonzero(cols.sample).tolist()
            logits = self._run_eager(order, rows, batch, to_sample, fill, flight)
            sample_ids = [ids[i] for i in to_sample]
        if sample_ids and self.is_driver:
            self._draw(sample_ids, logits, flight)

    def _decode_rows(self, decodes: DecodeRows) -> np.ndarray:
        """[n] the RequestTables rows of a plan's DecodeRows, after checking that the runner knows each
        request, holds the tables the plan says it does, and (from_last_step) drew its last token."""
        ids, requests, last_rows = decodes.request_ids, self.requests, self._last_rows
        if not all(map(requests.__contains__, ids)):  # (the common case in C; the error names the first)
            check(False, "request_id", next(r for r in ids if r not in requests), "a request announced in new_requests")
        drawn = list(compress(ids, decodes.from_last_step.tolist()))
        if not all(map(last_rows.__contains__, drawn)):
            check(False, "from_last_step", next(r for r in drawn if r not in last_rows),
                  "set only for a request that drew a token in the previous step on this (driver) rank")
        return self.tables.rows_holding(ids, decodes.table_lens)

    def _from_last_step(self, ids: Sequence[str], cols: _Columns, ends: np.ndarray):
        """A function that writes the tokens drawn in the previous step into a packed input_ids
        tensor (on the device, in stream order: no wait), or None when no sequence needs one.
        ids: the request of each row."""
        which = np.flatnonzero(cols.from_last_step)
        if not len(which):
            return None
        tokens = self._last.draw.tokens
        last_rows = self._last_rows
        dst = to_device(torch.from_numpy(ends[which]), self.device)
        src = np.fromiter(map(last_rows.__getitem__, map(ids.__getitem__, which.tolist())), np.int64, len(which))
        src = to_device(torch.from_numpy(src), self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return fill

    def _run_eager(self, order: Sequence[ScheduledSeq], tables: list[np.ndarray], batch: _PackedBatch,
                   to_sample: list[int], fill, flight: _InFlight | None = None) -> torch.Tensor | None:
        """tables: per KV layer group, the block tables of `order` ([S, W] int32, row s for order[s])."""
        encoder = None
        cross: dict = {}  # encoder-decoder: group 0's metadata carries the encoder tables too
        if self.encoder_backend is not None:
            reqs = [self.requests[s.request_id] for s in order]
            cross = dict(encoder_seq_lens=[len(r.encoder_ids) for r in reqs],
                         encoder_block_tables=[r.encoder_table for r in reqs])
            encoder = self._encoder_step([r for s, r in zip(order, reqs) if s.context_len == 0])
        metas = [
            AttentionMetadata.build(query_lens=batch.query_lens, seq_lens=batch.seq_lens,
                                    block_tables=tables[g], block_size=self.block_size,
                                    device=self.device, dcp_size=self.dcp_size, dcp_rank=self.dcp_rank, kv_group=g,
                                    **(cross if g == 0 else {}))
            for g in range(self.num_groups)
        ]  # fmt: skip
        # A token drawn by the previous step is still on the device: 0 holds its place until `fill`.
        input_ids = to_device(torch.from_numpy(batch.input_ids(order)), self.device)
        if fill is not None:
            fill(input_ids)
        plans: dict[tuple[int, int], object] = {}  # plan once per backend instance and group per step
        layers = []
        for b, kv, g in zip(self.backends, self.kv_caches, self.layer_groups):
            plan = plans.get((id(b), g))
            if plan is None:
                plan = plans[id(b), g] = b.plan(metas[g])
            layers.append(LayerAttention(b, plan, kv, metas[g].slot_mapping))
        ctx = ForwardContext(layers=layers, encoder=encoder)
        hidden = self.model(input_ids, to_device(torch.from_numpy(batch.positions), self.device), ctx)  # [T, hidden]
        if self._wants_prompt_logprobs and flight is not None:  # (workers/prompt_logprobs.py)
            wanted = wanted_rows(order, batch.query_lens, batch.ends, self.requests)
            if wanted:
                flight.prompt_logprobs = prompt_logprobs(self.model.compute_logits, hidden, wanted)
        if not to_sample:
            return None
        # Every rank computes logits: a vocabulary-parallel LM head gathers them collectively.
        rows = to_device(torch.from_numpy(batch.ends[to_sample]), self.device)
        return self.model.compute_logits(hidden[rows])  # [N, V] float32

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
        flight.request_ids = request_ids
        self._last = flight
        self._last_rows = dict(zip(request_ids, range(len(request_ids))))


@dataclass(frozen=True)
class _Columns:
    """A step's sequences as host arrays (one entry per sequence, in the step's order)."""

    rows: np.ndarray  # [S] int64 each request's row in the RequestTables
    context_lens: np.ndarray  # [S] int64 tokens already cached (the first new token's position)
    query_lens: np.ndarray  # [S] int64 new tokens, the one drawn by the previous step included
    from_last_step: np.ndarray  # [S] bool
    sample: np.ndarray  # [S] bool

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq], row_of: dict[str, int]) -> _Columns:
        n = len(seqs)
        last = np.fromiter((s.from_last_step for s in seqs), bool, n)
        known = np.fromiter(map(len, (s.token_ids for s in seqs)), np.int64, n)
        return cls(rows=np.fromiter((row_of[s.request_id] for s in seqs), np.int64, n),
                   context_lens=np.fromiter((s.context_len for s in seqs), np.int64, n),
                   query_lens=known + last, from_last_step=last,
                   sample=np.fromiter((s.sample for s in seqs), bool, n))

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
        return _Columns(self.rows[perm], self.context_lens[perm], self.query_lens[perm], self.from_last_step[perm],
                        self.sample[perm])

    def concat(self, other: _Columns) -> _Columns:
        return _Columns(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self)))


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

    def input_ids(self, order: Sequence[ScheduledSeq]) -> np.ndarray:
        """[T] int64 token ids; 0 in the row of a token the previous step draws (`from_last_step`)."""
        known = chain.from_iterable(s.token_ids for s in order)
        num_tokens = len(self.positions)
        if not any(s.from_last_step for s in order):
            return np.fromiter(known, np.int64, num_tokens)
        ids = np.zeros(num_tokens, np.int64)
        # The unknown token is always a sequence's last: its row is its `ends` entry.
        has = np.ones(num_tokens, bool)
        has[self.ends[[i for i, s in enumerate(order) if s.from_last_step]]] = False
        ids[has] = np.fromiter(known, np.int64, num_tokens - int((~has).sum()))
        return ids
