"""Decode steps over static input buffers, captured as one CUDA graph per batch-size bucket.

A pure-decode step of n sequences runs as the graph of the smallest bucket b >= n (buckets 1,
2, 4, 8, then steps of 8 up to the largest batch to capture). Its inputs are written into
static buffers that every graph reads (token ids, positions, sequence lengths, block tables
and slot mappings per KV layer group), so a replay launches the whole forward pass — every
layer and the LM head — as one graph. Rows n..b-1 are padding: token 0 at position 0 with one
key, block table row [0] and slot 0, i.e. they read and write only the null block 0 that the
KV store never hands out, and their logits are never sampled; MoE layers route them to no
expert (ForwardContext.num_real_tokens: n, a static buffer too), so no expert's weights are
read for them and the load counters count only the n real rows. MLA layers (DeepSeek) take part
through their MLAAttention, whose decode backend plans for the graph; their one latent row per
token goes to the same null slot.

The same static path runs without capture (`capture=False`): that is how the CPU tests check
its contract (buffers keep their addresses, padded rows reach neither the sampler nor a real
block, tokens equal the eager path's).

Graphs are captured largest first into one shared memory pool (a smaller graph's activations
fit in the pool the largest one sized). Steps with prefill tokens, and batches larger than
the largest bucket, stay eager.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from meshserve.attention.backend import AttentionBackend, KVCache
from meshserve.attention.metadata import AttentionMetadata, pad_table, token_slots
from meshserve.core.arith import cdiv
from meshserve.core.tensors import copy_into
from meshserve.errors import check
from meshserve.workers.models.transformer import CausalLM, ForwardContext, LayerAttention
from meshserve.workers.step import ScheduledSeq

log = logging.getLogger("meshserve.graphs")

NULL_SLOT = 0  # slot 0 of block 0: the null block, never handed out by the KV store


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, then multiples of 8, and max_batch itself."""
    check(isinstance(max_batch, int) and max_batch >= 1, "max_batch", max_batch, "an integer >= 1")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def graph_refusal(backend: object) -> str | None:
    """Why a layer's attention cannot run in decode graphs (None: it can). A standard backend
    answers by its declared capabilities; a layer object that composes backends (MLAAttention:
    its decode backend's record) answers through its own `graph_refusal()`."""
    own = getattr(backend, "graph_refusal", None)
    if own is not None:
        return own()
    caps = getattr(type(backend), "capabilities", None)
    if caps is None or not caps.cuda_graphs:
        return f"attention backend {backend.name} declares no CUDA-graph support"
    return None


class DecodeGraphs:
    """Static buffers, per-bucket plans and (on CUDA) graphs for the decode steps of one rank."""

    def __init__(self, model: CausalLM, *, backends: Sequence[AttentionBackend], kv_caches: Sequence[KVCache],
                 layer_groups: Sequence[int], block_size: int, max_local_len: int, max_batch: int,
                 device: torch.device, dcp_size: int = 1, dcp_rank: int = 0, capture: bool = True) -> None:
        """max_local_len: tokens of the longest sequence this rank stores (a max_model_len sequence
        under its DCP share); it sizes the block tables and the plans' split counts."""
        for b in dict.fromkeys(backends):
            check(graph_refusal(b) is None, "attention_backend", b.name,
                  "a backend whose capabilities declare cuda_graphs (or enforce_eager)")
        check(not capture or device.type == "cuda", "device", device.type, "cuda to capture CUDA graphs")
        self.model, self.backends, self.kv_caches = model, list(backends), list(kv_caches)
        self.layer_groups = list(layer_groups)
        self.num_groups = max(self.layer_groups) + 1
        self.block_size, self.max_local_len = block_size, max_local_len
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.device, self.capture = device, capture
        self.sizes = capture_sizes(max_batch)
        b, width = self.sizes[-1], cdiv(max_local_len, block_size)
        # Device buffers, written in place before every replay (their addresses are in the graphs).
        # The per-row inputs are rows of two slabs, so that one host-to-device copy per dtype
        # fills them all: int64 [input_ids, positions, slot mapping per group], int32 [seq_lens,
        # context_lens, (the step's real row count n, then unused)]; block tables have one buffer per group.
        self._slab64 = torch.zeros(2 + self.num_groups, b, dtype=torch.int64, device=device)
        self._slab32 = torch.zeros(3, b, dtype=torch.int32, device=device)
        self.input_ids, self.positions = self._slab64[0], self._slab64[1]
        self.slot_mappings = [self._slab64[2 + g] for g in range(self.num_groups)]  # NULL_SLOT when unused
        self.seq_lens, self.context_lens = self._slab32[0], self._slab32[1]
        self.num_real_tokens = self._slab32[2, :1]  # [1]: rows [n, b) of a bucket b are padding
        self.seq_lens.fill_(1)
        # 0 until the first step: the warm-ups before capture route every row to no expert (they
        # compile the same kernels) and leave the MoE load counters as they were.
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # one token per row
        self.block_tables = [torch.zeros(b, width, dtype=torch.int32, device=device) for _ in range(self.num_groups)]
        self._decode_qsl = np.arange(b + 1)  # one new token per row
        self._contexts: dict[int, ForwardContext] = {}
        self._plans: dict[int, list[tuple[AttentionBackend, int, object]]] = {}  # (backend, group, plan)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits_out: torch.Tensor | None = None  # [max_batch, V] float32, every graph's output
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.num_steps = 0  # decode steps served here (replays, or static runs without capture)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket holding num_seqs rows."""
        check(1 <= num_seqs <= self.max_batch, "num_seqs", num_seqs, f"an integer in [1, {self.max_batch}]")
        return next(s for s in self.sizes if s >= num_seqs)

    def serves(self, seqs: Sequence[ScheduledSeq]) -> bool:
        """Whether a step runs here: only decodes that sample, at most max_batch of them."""
        return 0 < len(seqs) <= self.max_batch and all(s.is_decode and s.sample for s in seqs)

    # ------------------------------------------------------------------------------ set-up
    def _metadata(self, b: int, group: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            context_lens=self.context_lens[:b], block_table=self.block_tables[group][:b],
            slot_mapping=self.slot_mappings[group][:b], num_prefills=0, num_prefill_tokens=0, num_decodes=b,
            max_query_len=1, max_seq_len=self.max_local_len * self.dcp_size, block_size=self.block_size,
            query_lens_host=(1,) * b, seq_lens_host=(self.max_local_len * self.dcp_size,) * b,
            dcp_size=self.dcp_size, dcp_rank=self.dcp_rank, kv_group=group,
        )  # fmt: skip

    def _context(self, b: int) -> ForwardContext:
        if b not in self._contexts:
            metas = [self._metadata(b, g) for g in range(self.num_groups)]
            plans: dict[tuple[int, int], tuple[AttentionBackend, object]] = {}  # one per backend and group
            layers = []
            for backend, kv, g in zip(self.backends, self.kv_caches, self.layer_groups):
                key = (id(backend), g)
                if key not in plans:
                    plans[key] = (backend, backend.plan_for_graph(metas[g]))
                layers.append(LayerAttention(backend, plans[key][1], kv, self.slot_mappings[g][:b]))
            self._plans[b] = [(backend, g, plan) for (_, g), (backend, plan) in plans.items()]
            self._contexts[b] = ForwardContext(layers=layers, num_real_tokens=self.num_real_tokens)
        return self._contexts[b]

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._context(b))  # [b, hidden]
        logits = self.model.compute_logits(hidden)  # [b, V] float32
        if self._logits_out is None:  # the first run (a warm-up, outside any capture) sizes it
            self._logits_out = logits.new_empty(self.max_batch, logits.shape[1])
        # One output buffer for every bucket: each graph's own [b, V] result would stay allocated in
        # the pool (about 2 GiB over the buckets up to 256 at a 128k vocabulary).
        out = self._logits_out[:b]
        out.copy_(logits)
        return out

    @torch.inference_mode()
    def capture_all(self, *, progress: bool = True) -> None:
        """Capture every bucket's graph, largest first, into one memory pool; log time and memory."""
        if not self.capture:
            return
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        for b in tqdm(list(reversed(self.sizes)), desc="Capturing decode graphs", unit="graph", file=sys.stderr,
                      disable=not progress, leave=False):  # fmt: skip
            self._context(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile the kernels and settle the allocator outside the capture
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d decode graphs (batch 1..%d) in %.1fs, %.0f MiB", len(self.sizes), self.max_batch,
                 self.capture_seconds, self.capture_bytes / 2**20)

    # ------------------------------------------------------------------------------- a step
    @torch.inference_mode()
    def run(self, seqs: Sequence[ScheduledSeq], tables: Sequence[np.ndarray] | None = None, *,
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [len(seqs), V] float32 of one decode step, rows in the order of `seqs`.

        tables: per KV layer group, the seqs' block tables as an [n, W] int32 host array (row i
        for seqs[i]; entries past a row's blocks are never read); default: from the seqs' own
        block_tables (plans that carry whole tables).
        fill: writes the tokens the host does not know yet (`from_last_step`) into the token-id
        buffer, on the device, before the replay."""
        check(self.serves(seqs), "seqs", len(seqs), f"1..{self.max_batch} decodes that sample")
        token_ids = np.fromiter((s.token_ids[0] if s.token_ids else 0 for s in seqs), np.int64, len(seqs))
        context_lens = np.fromiter((s.context_len for s in seqs), np.int64, len(seqs))
        if tables is None:
            tables = [pad_table([s.block_tables[g] for s in seqs]) for g in range(self.num_groups)]
        return self.run_arrays(token_ids, context_lens, tables, fill=fill)

    @torch.inference_mode()
    def run_arrays(self, token_ids: np.ndarray, context_lens: np.ndarray, tables: Sequence[np.ndarray], *,
                   fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """`run` for a step given as host arrays: token_ids [n] int64 (any value where `fill`
        writes the token), context_lens [n] int64 (each row's position), tables per group
        [n, W] int32. Every buffer is filled by array ops and one host-to-device copy."""
        n = len(token_ids)
        check(1 <= n <= self.max_batch, "num_seqs", n, f"an integer in [1, {self.max_batch}]")
        b = self.bucket(n)
        slab64 = np.zeros((2 + self.num_groups, self.max_batch), np.int64)  # padding: token 0, position 0, NULL_SLOT
        slab64[0, :n] = token_ids
        slab64[1, :n] = context_lens
        slab32 = np.zeros((3, self.max_batch), np.int32)
        slab32[0] = 1  # padding rows: one key (the null slot)
        slab32[0, :n] = context_lens + 1
        slab32[1, :n] = context_lens
        slab32[2, 0] = n  # num_real_tokens: MoE layers route rows n.. to no expert
        seq_lens = slab32[0, :b]
        padded = []
        for g in range(self.num_groups):
            table = tables[g]
            check(table.shape[0] == n and table.shape[1] <= self.block_tables[g].shape[1], "block_tables",
                  tuple(table.shape), f"{n} rows of at most {self.block_tables[g].shape[1]} blocks (max_model_len)")
            rows = np.zeros((b, max(table.shape[1], 1)), np.int32)  # padding rows: block 0
            rows[:n, : table.shape[1]] = table
            slab64[2 + g, :n] = token_slots(rows, self._decode_qsl[: n + 1], context_lens, self.block_size,
                                            self.dcp_size, self.dcp_rank, True)
            padded.append(rows)
        copy_into(self._slab64, torch.from_numpy(slab64))
        copy_into(self._slab32, torch.from_numpy(slab32))
        if fill is not None:
            fill(self.input_ids)
        for g, rows in enumerate(padded):
            # Columns right of the step's widest row stay stale: never read (lengths bound every read).
            copy_into(self.block_tables[g][:b, : rows.shape[1]], torch.from_numpy(rows))
            for backend, group, plan in self._plans.get(b, ()):
                if group == g:
                    backend.prepare_replay(plan, seq_lens, rows)
        self.num_steps += 1
        if self.capture:
            if b not in self._graphs:
                raise RuntimeError(f"no decode graph for batch {b}: capture_all() must run before run()")
            self._graphs[b].replay()
            return self._logits_out[:n]
        return self._forward(b)[:n]
