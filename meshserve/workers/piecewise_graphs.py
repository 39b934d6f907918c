"""Steps with prefill tokens, as CUDA graphs of the work between attention calls.

A decode-only step replays one graph per batch size (decode_graphs.py). A step with prefill
tokens cannot be one graph: its attention plan (tiles, splits, a FlashInfer host plan) depends
on every sequence's lengths. Everything else in the forward pass depends only on the step's
token count: the embedding, the norms, the projections, the rotary embedding with its K/V
write, the MLP. So a step of n <= max_tokens new tokens runs on the graphs of the smallest
bucket T >= n: graph 0 from the token ids to the first layer's attention inputs, graph i from
attention i-1's output to attention i's inputs, the last one to the final norm. Between two
graphs the layer's attention runs eagerly with the step's own plan (and, where the model does
not store K/V itself, the backend's write_kv), on static buffers the graphs fill (q, k, v) and
read (the attention output). This is vLLM's piecewise CUDA-graph scheme, without a compiler:
the model's attention call is the split point.

Why: eager, the host launches ~9 kernels per layer. On an H100 whose host ran Python about
twice as slowly as this project's development VM, a lone 512-token prompt of the 8B shape took
33 ms for 11 ms of GPU work (docs/performance.md, the sixteenth session); a replay launches
one graph and one attention kernel per layer.

Rows n..T-1 are padding: they compute on stale token ids and positions (whatever an earlier
step left there: valid values), write no K/V (slot -1 skips the write), are never attended to
(the attention runs on rows [:n] only) and never reach the sampler. MoE layers route them to no
expert (ForwardContext.num_real_tokens: n, in a static buffer filled before each replay), so
they cost no expert weight reads and are not counted in the load counters.

Without capture (`capture=False`) the same static path runs eagerly, attention in between:
that is how the CPU tests check the contract (tokens equal to the plain eager forward's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionBackend, KVCache, LayerParams
from meshserve.attention.mla.layer import MLAAttention
from meshserve.errors import check
from meshserve.workers.models.deepseek import DeepseekForCausalLM
from meshserve.workers.models.transformer import CausalLM, ForwardContext, LayerAttention

log = logging.getLogger("meshserve.graphs")

SKIP_SLOT = -1  # a padding row's K/V slot: the paged write skips it


def token_buckets(max_tokens: int) -> list[int]:
    """Bucket sizes: 16, 32, 64, 128, 256, then steps of 64 (a padded step wastes at most 64 rows
    where the GEMMs are compute-bound), and max_tokens itself."""
    check(isinstance(max_tokens, int) and max_tokens >= 1, "max_tokens", max_tokens, "an integer >= 1")
    sizes = [s for s in (16, 32, 64, 128) if s < max_tokens] + list(range(256, max_tokens + 1, 64))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def split_refusal(model: object) -> str | None:
    """Why `model`'s forward cannot be split at its attention calls (None: it can)."""
    if isinstance(model, DeepseekForCausalLM):
        if any(layer.self_attn.indexer is not None for layer in model.model.layers):
            return "sparse MLA (DeepSeek-V3.2): its indexer's top-k choice is not split out of the graphs yet"
        return None
    if not isinstance(model, CausalLM):
        return f"{type(model).__name__} does not split at an attention call (encoder models)"
    return None


def piecewise_refusal(model: object, dcp_size: int) -> str | None:
    """Why steps with prefill tokens cannot replay piecewise graphs here (None: they can)."""
    why = split_refusal(model)
    if why is not None:
        return why
    if not model.cuda_graph_safe:
        return f"{type(model).__name__} syncs with the host in its forward pass (MoE routing)"
    if dcp_size > 1:
        return "decode context parallel: a rank's slot mapping is its share of the tokens (not captured yet)"
    return None


@dataclass(frozen=True)
class _AttentionCall:
    """One split point: the layer whose attention runs there, and what the model passed to it."""

    layer: int
    params: LayerParams | None  # a standard layer's (None: an MLA layer's call)
    write: bool  # the model asked the backend to store K/V (it does not store them itself)
    weights: object | None = None  # an MLA layer's per-head kv_b_proj views (MLAWeights)


class _SplitBackend:
    """Stands in for layer `index`'s backend while a bucket runs on the static buffers: the
    model calls it as its backend, and it hands the call to the PiecewiseGraphs."""

    def __init__(self, graphs: PiecewiseGraphs, backend: AttentionBackend, index: int) -> None:
        self.graphs, self.backend, self.index = graphs, backend, index
        self.fused_kv_write = backend.fused_kv_write  # the model's choice must be the eager one

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
                 plan: object | None = None) -> None:
        self.graphs._write_requested = True  # done eagerly beside the attention, with the step's plan

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: KVCache | None, plan: object, *, layer: LayerParams = LayerParams(),
                return_lse: bool = False) -> torch.Tensor:
        check(not return_lse and key is not None and value is not None, "attention call", "return_lse or no K/V",
              "a plain attention call with the step's K/V (the model's layers make it)")
        return self.graphs._split(self.index, query, key, value, layer)


class _SplitMLA:
    """_SplitBackend for an MLA layer (DeepSeek's MLAAttention: write_kv(latent, k_pe, cache,
    plan), then forward(q, cache, plan, weights)): the latent rows and q go to static buffers."""

    def __init__(self, graphs: PiecewiseGraphs, backend: object, index: int) -> None:
        self.graphs, self.backend, self.index = graphs, backend, index

    def write_kv(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: object, plan: object) -> None:
        self.graphs._copy_in("latent", latent)
        self.graphs._copy_in("k_pe", k_pe)
        self.graphs._write_requested = True  # done eagerly beside the attention, with the step's plan

    def forward(self, query: torch.Tensor, cache: object, plan: object, weights: object, *,
                return_lse: bool = False) -> torch.Tensor:
        check(not return_lse, "attention call", "return_lse", "a plain MLA call (the model's layers make it)")
        return self.graphs._split_mla(self.index, query, weights)


class PiecewiseGraphs:
    """Static buffers and, on CUDA, per-bucket segment graphs for the steps with prefill tokens
    of one rank (tp = 1)."""

    def __init__(self, model: torch.nn.Module, *, backends: Sequence[AttentionBackend], kv_caches: Sequence[KVCache],
                 layer_groups: Sequence[int], max_tokens: int, device: torch.device, capture: bool = True) -> None:
        why = split_refusal(model)
        check(why is None, "model", type(model).__name__,
              f"a model whose forward splits at its attention calls (not: {why})")
        check(not capture or device.type == "cuda", "device", device.type, "cuda to capture CUDA graphs")
        self.model, self.backends, self.kv_caches = model, list(backends), list(kv_caches)
        self.layer_groups = list(layer_groups)
        self.device, self.capture = device, capture
        self.sizes = token_buckets(max_tokens)
        t = self.sizes[-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        num_groups = max(self.layer_groups) + 1
        self.slot_mappings = [torch.full((t,), SKIP_SLOT, dtype=torch.int64, device=device)
                              for _ in range(num_groups)]  # fmt: skip
        # [1] the step's token count n: MoE layers route the bucket's rows n.. to no expert. 0 until
        # the first step: the warm-ups route every row to no expert and count nothing.
        self.num_real_tokens = torch.zeros(1, dtype=torch.int32, device=device)
        self._first_layer = [self.layer_groups.index(g) for g in range(num_groups)]
        # q, k, v in, the attention output back, the final hidden states out: one buffer each of
        # max_tokens rows, made at the first (uncaptured) run; every bucket's graphs use its rows [:T].
        self._buffers: dict[str, torch.Tensor] = {}
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._calls: dict[int, list[_AttentionCall]] = {}
        self._mode = "static"  # "warm" (no attention), "capture", "static" (attention in between)
        # The step's layers and its rows [:n] of every buffer (views made once a step, not once a layer).
        self._step: tuple[Sequence[LayerAttention], dict[str, torch.Tensor]] | None = None
        self._segment: torch.cuda.CUDAGraph | None = None
        self._segments: list[torch.cuda.CUDAGraph] = []
        self._recorded: list[_AttentionCall] = []
        self._pool = None
        self._write_requested = False
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.num_steps = 0  # steps served here (replays, or static runs without capture)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def serves(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        check(self.serves(num_tokens), "num_tokens", num_tokens, f"an integer in [1, {self.max_tokens}]")
        return next(s for s in self.sizes if s >= num_tokens)

    # --------------------------------------------------------------------------- the split
    def _buffer(self, name: str, rows: int, tail: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Rows [:rows] of the static buffer `name` ([max_tokens, *tail] of dtype)."""
        buf = self._buffers.get(name)
        if buf is None:
            check(self._mode == "warm", "piecewise buffers", name, "made by the warm-up run before any capture")
            buf = self._buffers[name] = torch.zeros(self.max_tokens, *tail, dtype=dtype, device=self.device)
        check(tuple(buf.shape[1:]) == tuple(tail) and buf.dtype == dtype, "attention layer", (*tail, dtype),
              f"rows of {tuple(buf.shape[1:])} {buf.dtype}, as every layer's (one buffer serves all layers)")
        return buf[:rows]

    def _copy_in(self, name: str, x: torch.Tensor) -> None:
        self._buffer(name, x.shape[0], x.shape[1:], x.dtype).copy_(x)

    def _split(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               params: LayerParams) -> torch.Tensor:
        """Called by the model at layer `index`'s attention: copy its inputs into the static
        buffers, end the running segment (capture), attend (static runs), start the next
        segment; returns the static output rows the model goes on with."""
        for name, x in (("q", query), ("k", key), ("v", value)):
            self._copy_in(name, x)
        out = self._buffer("o", query.shape[0], (query.shape[1], value.shape[2]), query.dtype)
        return self._at_split(_AttentionCall(index, params, self._write_requested), out)

    def _split_mla(self, index: int, query: torch.Tensor, weights: object) -> torch.Tensor:
        """_split for an MLA layer (its latent rows came with write_kv)."""
        self._copy_in("q", query)
        out = self._buffer("o", query.shape[0], (query.shape[1], weights.w_uv.shape[1]), query.dtype)
        return self._at_split(_AttentionCall(index, None, self._write_requested, weights), out)

    def _at_split(self, call: _AttentionCall, out: torch.Tensor) -> torch.Tensor:
        self._write_requested = False
        if self._mode == "capture":
            self._end_segment()
            self._recorded.append(call)
            self._begin_segment()
        elif self._mode == "static":
            self._attend(call)
        return out

    def _attend(self, call: _AttentionCall) -> None:
        """Layer call.layer's attention over the step's n rows, with the step's own plan."""
        layers, rows = self._step
        real = layers[call.layer]
        if call.weights is not None:  # MLA
            if call.write:
                real.backend.write_kv(rows["latent"], rows["k_pe"], real.kv_cache, real.plan)
            rows["o"].copy_(real.backend.forward(rows["q"], real.kv_cache, real.plan, call.weights))
            return
        q, k, v = rows["q"], rows["k"], rows["v"]
        if call.write:
            real.backend.write_kv(k, v, real.kv_cache, real.slot_mapping, plan=real.plan)
        rows["o"].copy_(real.backend.forward(q, k, v, real.kv_cache, real.plan, layer=call.params))

    def _forward(self, t: int) -> None:
        """The model over the static rows [:t], its attention calls split; hidden states -> buffer."""
        layers = [LayerAttention((_SplitMLA if isinstance(b, MLAAttention) else _SplitBackend)(self, b, i), None, kv,
                                 self.slot_mappings[g][:t])
                  for i, (b, kv, g) in enumerate(zip(self.backends, self.kv_caches, self.layer_groups))]  # fmt: skip
        ctx = ForwardContext(layers=layers, num_real_tokens=self.num_real_tokens)
        hidden = self.model(self.input_ids[:t], self.positions[:t], ctx)
        self._copy_in("hidden", hidden)

    def _begin_segment(self) -> None:
        self._segment = torch.cuda.CUDAGraph()
        self._segment.capture_begin(pool=self._pool)

    def _end_segment(self) -> None:
        self._segment.capture_end()
        self._pool = self._segment.pool()  # every segment of every bucket shares one pool
        self._segments.append(self._segment)
        self._segment = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Make the buffers (a warm-up run of the largest bucket, which also compiles the
        segments' kernels), then capture every bucket's segments, largest first."""
        self._mode = "warm"
        self._forward(self.max_tokens)
        if not self.capture:
            self._mode = "static"
            return
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                for t in reversed(self.sizes):
                    self._mode = "warm"
                    self._forward(t)  # compile this size's kernels outside the capture
                    self._mode, self._segments, self._recorded = "capture", [], []
                    self._begin_segment()
                    self._forward(t)
                    self._end_segment()
                    self._graphs[t], self._calls[t] = self._segments, self._recorded
        except BaseException:
            if self._segment is not None:  # end the stream's capture mode, whatever made it fail
                with contextlib.suppress(Exception):
                    self._segment.capture_end()
            self._graphs.clear()
            raise
        finally:
            self._mode, self._segments, self._recorded, self._segment = "static", [], [], None
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured piecewise graphs of %d token buckets (up to %d tokens, %d segments each) in %.1fs, %.0f MiB",
                 len(self.sizes), self.max_tokens, len(self._graphs[self.max_tokens]), self.capture_seconds,
                 self.capture_bytes / 2**20)

    # ------------------------------------------------------------------------------- a step
    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layers: Sequence[LayerAttention]) -> torch.Tensor:
        """The final-normed hidden states [n, hidden] of a step's n new tokens (ids and positions
        [n] int64 on the device), attending through `layers` (the step's own plans). The result
        is a view of a static buffer: valid until the next step runs here."""
        n = input_ids.shape[0]
        t = self.bucket(n)
        check(len(layers) == len(self.backends), "layers", len(layers), f"{len(self.backends)} (one per layer)")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.num_real_tokens.fill_(n)
        for g, first in enumerate(self._first_layer):
            self.slot_mappings[g][:n].copy_(layers[first].slot_mapping)
            if t > n:
                self.slot_mappings[g][n:t].fill_(SKIP_SLOT)
        self._step = (layers, {name: buf[:n] for name, buf in self._buffers.items()})
        self.num_steps += 1
        try:
            if not self.capture:
                self._forward(t)
            else:
                graphs, calls = self._graphs[t], self._calls[t]
                for segment, call in zip(graphs, calls):
                    segment.replay()
                    self._attend(call)
                graphs[-1].replay()
        finally:
            self._step = None
        return self._buffers["hidden"][:n]
