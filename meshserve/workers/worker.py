"""One rank of a replica: model shard + KV cache shard + runner. Plain Python, no Ray.

Protocol (the only methods an executor may call): `start() -> WorkerInfo`,
`execute_step(plan: bytes) -> bytes` (msgpack StepPlan in, msgpack StepOutput out),
`check_health() -> dict`, `shutdown()`.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass

import torch

from meshserve.attention.layer_backends import make_backends
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig, Quantization
from meshserve.core.arith import cdiv
from meshserve.core.cpu_threads import apply_cpu_threads
from meshserve.errors import check
from meshserve.kvstore.cache_tensors import allocate_caches, block_bytes
from meshserve.kvstore.groups import KVGroupLayout
from meshserve.parallel.dcp_wrap import wrap_for_dcp
from meshserve.parallel.groups import ParallelContext, init_parallel, shutdown_parallel
from meshserve.parallel.transform import local_attention_spec
from meshserve.workers.checkpoint import read_arch
from meshserve.workers.constraints import ConstraintBuilder
from meshserve.workers.cpu_weights import input_major_linears
from meshserve.workers.decode_graphs import DecodeGraphs, graph_refusal
from meshserve.workers.grammar import CompileStats
from meshserve.workers.kv_budget import decode_peak_bytes, num_kv_blocks
from meshserve.workers.loader import load_model, resolve_dtype
from meshserve.workers.models import tensor_parallel_transform
from meshserve.workers.models.arch import ModelArch
from meshserve.workers.models.bart import BartArch, is_encoder_decoder_dir, load_bart, read_bart_arch
from meshserve.workers.models.contract import GenerativeModel
from meshserve.workers.models.expert_layer import ExpertLayer
from meshserve.workers.piecewise_graphs import PiecewiseGraphs, piecewise_refusal
from meshserve.workers.runner import ModelRunner
from meshserve.workers.sharding import routed_experts
from meshserve.workers.step import StepOutput, StepPlan

log = logging.getLogger("meshserve.worker")

@dataclass(frozen=True)
class WorkerInfo:
    """What the scheduler needs to know about a started worker (plain values: msgpack-able).

    num_kv_blocks counts the null block 0, which the KV store never hands out.
    kv_groups: per KV layer group (kvstore/groups.py: one for most models, one per group of a
    hybrid layout), what its cache must retain: [sliding_window, num_sink_tokens].
    """

    rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    backend: str
    dtype: str
    kv_groups: tuple[tuple[int | None, int], ...] = ((None, 0),)
    # Encoder-decoder models (the prompt is the encoder's input): the decoder's first tokens and
    # the longest encoder input; () and 0 for decoder-only models.
    decoder_prompt: tuple[int, ...] = ()
    max_encoder_len: int = 0
    device: str = "cpu"  # the rank's device type: on "cuda" a submitted step runs while the host plans the next

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.decoder_prompt)


def resolve_max_model_len(model: ModelConfig, arch: ModelArch | BartArch) -> int:
    limit = arch.max_position_embeddings
    if model.max_model_len is None:
        return limit
    check(model.max_model_len <= limit, "max_model_len", model.max_model_len,
          f"an integer in [1, {limit}] (the model's max_position_embeddings)")
    return model.max_model_len


@dataclass(frozen=True)
class LoadedModel:
    """What a model family's load step hands the shared start-up pipeline."""

    arch: ModelArch | BartArch
    model: GenerativeModel
    dtype: torch.dtype
    max_model_len: int
    # Encoder-decoder models: the decoder's first tokens and the longest encoder input.
    decoder_prompt: tuple[int, ...] = ()
    max_encoder_len: int = 0


class Worker:
    """Holds one rank's model and cache; executes step plans handed to it by an executor."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, attention: AttentionConfig | None = None,
                 parallel: ParallelConfig | None = None, *, rank: int = 0,
                 device: str | torch.device | None = None, progress: bool = True,
                 init_method: str | None = None) -> None:
        """init_method: torch.distributed rendezvous of the replica's ranks (needed when tp > 1),
        e.g. "tcp://127.0.0.1:29517"; every rank of a replica gets the same one."""
        check(model.model is not None, "model", None, "a checkpoint directory")
        self.model_config = model
        self.cache_config = cache
        self.attention_config = attention or AttentionConfig()
        self.parallel = parallel or ParallelConfig()
        check(0 <= rank < self.parallel.tp, "rank", rank, f"an integer in [0, {self.parallel.tp - 1}]")
        self.rank = rank
        self.init_method = init_method
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._load_copy: tuple[torch.Tensor, torch.cuda.Event] | None = None  # expert counts on their way
        self.progress = progress
        self.runner: ModelRunner | None = None
        self.ctx = ParallelContext()
        self.info: WorkerInfo | None = None
        self.kv_layout: KVGroupLayout | None = None  # which layers share a block table (start)

    def start(self) -> WorkerInfo:
        """Load the model, choose (and DCP-wrap) its attention backends, size and allocate the KV
        cache, capture decode graphs where they can run. Idempotent.

        One pipeline for every model; the model family's load step is the hook where they differ
        (`_load_decoder_only`, `_load_encoder_decoder`); the rest reads the model contract.
        """
        if self.info is not None:
            return self.info
        if self.device.type == "cpu":  # before the first torch op of the load (core/cpu_threads.py)
            apply_cpu_threads(ranks_on_host=self.parallel.tp)
        t0 = time.perf_counter()
        encdec = is_encoder_decoder_dir(self.model_config.model)
        loaded = self._load_encoder_decoder() if encdec else self._load_decoder_only()
        model, dtype, max_model_len = loaded.model, loaded.dtype, loaded.max_model_len
        ctx, par = self.ctx, self.parallel  # (the load step joined the replica's process group)
        bs = self.cache_config.block_size
        logical_bs = bs * par.dcp  # a block-table entry covers bs tokens on each of the dcp ranks
        specs = [local_attention_spec(spec, ctx) for spec in model.attention_specs()]  # this rank's heads
        encoder_spec = model.encoder_spec()
        # Local tokens of the longest sequence a layer attends over (a decoder's or the encoder's input).
        capacity = cdiv(max(max_model_len, loaded.max_encoder_len), logical_bs) * bs
        backends = make_backends([*specs, *([encoder_spec] if encoder_spec else [])],
                                 name=self.attention_config.backend, dtype=dtype, block_size=bs,
                                 max_model_len=max(capacity, bs), device=self.device, dcp_size=par.dcp)
        encoder_backend = backends.pop() if encoder_spec else None
        if par.dcp > 1:
            backends = wrap_for_dcp(backends, ctx, par.dcp_comm)
        # A block id holds one group's worth of layers (kvstore/groups.py: the groups share tensors).
        self.kv_layout = layout = KVGroupLayout.from_specs(specs)
        use_graphs = self._graph_refusals(backends, model) == []
        piecewise_tokens = self._piecewise_tokens(model, par.dcp)
        reserve = 0  # each graph pool comes out of the KV budget
        if use_graphs:
            reserve += decode_peak_bytes(model, backends, specs, layout, block_size=bs, dtype=dtype,
                                         device=self.device, batch=self.model_config.cuda_graph_max_batch)
        if piecewise_tokens:  # (their pool holds the forward's activations; the LM head runs outside)
            reserve += decode_peak_bytes(model, backends, specs, layout, block_size=bs, dtype=dtype,
                                         device=self.device, batch=piecewise_tokens, sample=False)
        num_blocks = num_kv_blocks(self.cache_config, self.device,
                                   block_bytes([specs[i] for i in layout.groups[0]], bs, dtype), reserve=reserve,
                                   gpus_per_rank=par.gpus_per_rank)
        # The null block + one longest sequence in every group (an encoder group holds the encoder input).
        reach = [loaded.max_encoder_len if g == layout.encoder_group else max_model_len
                 for g in range(layout.num_groups)]
        needed = sum(cdiv(n, logical_bs) for n in reach) + 1
        check(num_blocks >= needed, "num_kv_blocks", num_blocks,
              f">= {needed} blocks of {logical_bs} tokens (the null block + one max_model_len={max_model_len} "
              f"sequence in each of {layout.num_groups} KV layer group(s)"
              + (f", the encoder's holding one {loaded.max_encoder_len}-token input" if encdec else "")
              + "); give more KV memory or lower max_model_len")
        caches = allocate_caches(specs, num_blocks=num_blocks, block_size=bs, dtype=dtype, device=self.device,
                                 layer_slots=layout.layer_slots(len(specs)))
        self.runner = ModelRunner(model, backends=backends, kv_caches=caches, block_size=bs, device=self.device,
                                  is_driver=ctx.is_driver, seed=self.model_config.seed, dcp_size=par.dcp,
                                  dcp_rank=ctx.dcp_rank, layer_groups=layout.group_of_layer(len(specs)),
                                  encoder_backend=encoder_backend,
                                  constraints=self._constraint_builder(loaded.arch),
                                  tp_group=ctx.tp_group if par.tp > 1 else None)
        if use_graphs:
            graphs = DecodeGraphs(model, backends=backends, kv_caches=caches, layer_groups=self.runner.layer_groups,
                                  block_size=bs, max_local_len=capacity, device=self.device, dcp_size=par.dcp,
                                  dcp_rank=ctx.dcp_rank, max_batch=self.model_config.cuda_graph_max_batch)
            graphs.capture_all(progress=self.progress)
            log.info("decode graphs hold %.0f MiB (%.0f MiB reserved before the KV cache was sized)",
                     graphs.capture_bytes / 2**20, reserve / 2**20)
            self.runner.decode_graphs = graphs
        if piecewise_tokens:
            pieces = PiecewiseGraphs(model, backends=backends, kv_caches=caches, layer_groups=self.runner.layer_groups,
                                     max_tokens=piecewise_tokens, device=self.device)
            try:
                pieces.capture_all()
                self.runner.piecewise_graphs = pieces
            except Exception as exc:  # (a model whose forward cannot be captured serves eagerly, not fail)
                log.warning("steps with prefill tokens run eagerly: their piecewise graphs could not be captured "
                            "(%s: %s)", type(exc).__name__, exc)
        for layer in self.runner.model.expert_layers():  # start-up's forwards (the peak's probe) served no request
            layer.expert_load.zero_()
        if self.device.type == "cuda":
            # A decode step allocates thousands of small objects; the collector's full passes
            # would otherwise walk everything start-up made (a host profile at batch 256 showed ~28 ms
            # per step in a function that only allocates: most likely such passes; not yet re-measured).
            gc.collect()
            gc.freeze()
        arch = loaded.arch
        self.info = WorkerInfo(rank=self.rank, num_kv_blocks=num_blocks, block_size=logical_bs,
                               max_model_len=max_model_len, vocab_size=arch.vocab_size,
                               eos_token_ids=arch.eos_token_ids, backend=backends[0].name,
                               dtype=str(dtype).removeprefix("torch."),
                               kv_groups=tuple((r.sliding_window, r.num_sink_tokens)
                                               for r in layout.decoder_retentions),
                               decoder_prompt=loaded.decoder_prompt, max_encoder_len=loaded.max_encoder_len,
                               device=self.device.type)
        log.info("worker %d ready in %.1fs: %s, backend %s, %d KV blocks, %d KV layer group(s)", self.rank,
                 time.perf_counter() - t0, arch.architecture, backends[0].name, num_blocks, layout.num_groups)
        return self.info

    def _load_decoder_only(self) -> LoadedModel:
        """Checks the parallel layout against the checkpoint, joins the replica's process group,
        loads this rank's shard (tensor-parallel transform on the meta model)."""
        arch = read_arch(self.model_config.model)
        par = self.parallel
        par.check_heads(arch.num_heads, arch.num_kv_heads)
        par.check_experts(routed_experts(arch))
        max_model_len = resolve_max_model_len(self.model_config, arch)
        dtype = resolve_dtype(self.model_config.dtype, arch, self.device.type)
        self.ctx = ctx = init_parallel(par, rank=self.rank, init_method=self.init_method, device=self.device.type)

        def transform(model):
            tensor_parallel_transform(arch)(model, ctx)

        model = load_model(self.model_config.model, dtype=dtype, device=self.device, rank=self.rank,
                           world=par.tp, dcp=par.dcp, ep=par.ep, max_positions=max_model_len, progress=self.progress,
                           transform=transform if par.tp > 1 else None,
                           quantization=self.model_config.quantization.value,
                           small_m_gemm=self.model_config.small_m_gemm.value,
                           quantize_lm_head=self.model_config.quantize_lm_head)
        if self.device.type == "cpu":
            input_major_linears(model)  # the same values, a faster CPU GEMM (workers/cpu_weights.py)
        return LoadedModel(arch, model, dtype, max_model_len)

    def _load_encoder_decoder(self) -> LoadedModel:
        """BART: its own loader, one rank. Its decoder self- and cross-attention layers form two KV
        groups sharing the pool (kvstore/groups.py); its encoder gets a backend of its own."""
        check(self.parallel.tp == 1, "tp", self.parallel.tp, "1 (encoder-decoder models run on one rank)")
        quantization = self.model_config.quantization
        check(quantization is Quantization.NONE, "quantization", quantization.value,
              "'none' for an encoder-decoder model (its weights load in the model dtype: online FP8 and "
              "--quantize-lm-head are not implemented for it)")
        arch = read_bart_arch(self.model_config.model)
        max_model_len = resolve_max_model_len(self.model_config, arch)
        dtype = resolve_dtype(self.model_config.dtype, arch, self.device.type)
        model = load_bart(self.model_config.model, arch, dtype=dtype, device=self.device)
        return LoadedModel(arch, model, dtype, max_model_len, decoder_prompt=tuple(arch.decoder_prompt),
                           max_encoder_len=arch.max_encoder_len)

    def _constraint_builder(self, arch: ModelArch | BartArch) -> ConstraintBuilder:
        """The driver's maker of per-request constraints (grammars, bad words: the checkpoint's tokenizer)."""
        return ConstraintBuilder(self.model_config.model, vocab_size=arch.vocab_size, eos_token_ids=arch.eos_token_ids)

    def _graph_refusals(self, backends, model: GenerativeModel) -> list[str]:
        """Why decode steps cannot replay CUDA graphs here (empty: they do); logged once."""
        why = []
        if self.device.type != "cuda":
            why.append(f"device is {self.device.type}")
        if self.model_config.enforce_eager:
            why.append("enforce_eager is set")
        if self.parallel.tp > 1:
            why.append(f"tp={self.parallel.tp}: collectives inside graphs are not captured yet")
        why += [r for r in map(graph_refusal, dict.fromkeys(backends)) if r is not None]
        if model.is_encoder_decoder:
            why.append("encoder-decoder model: the graph buffers carry no encoder tables yet")
        elif not model.cuda_graph_safe:
            why.append(f"{type(model).__name__} syncs with the host in its forward pass (MoE routing)")
        if why and self.device.type == "cuda":
            log.info("decode steps run eagerly: %s", "; ".join(why))
        return why

    def _piecewise_tokens(self, model: GenerativeModel, dcp: int) -> int:
        """The largest step with prefill tokens that replays piecewise graphs here (0: none); why not, logged once."""
        tokens = self.model_config.piecewise_graph_tokens
        why = []
        if self.device.type != "cuda" or self.model_config.enforce_eager or not tokens:
            return 0  # (the decode graphs' refusal says why for the first two)
        if self.parallel.tp > 1:
            why.append(f"tp={self.parallel.tp}: collectives inside graphs are not captured yet")
        refusal = piecewise_refusal(model, dcp)
        if refusal is not None:
            why.append(refusal)
        if why:
            log.info("steps with prefill tokens run eagerly: %s", "; ".join(why))
            return 0
        return tokens

    def execute_step(self, plan: bytes) -> bytes:
        check(self.runner is not None, "worker", "not started", "start() before execute_step()")
        return self.runner.execute(StepPlan.from_msgpack(plan)).to_msgpack()

    def submit(self, plan: StepPlan) -> None:
        """In-process callers: start a step (the plan object itself, nothing serialised); `collect`
        returns its tokens. A second step may be submitted before the first is collected."""
        check(self.runner is not None, "worker", "not started", "start() before submit()")
        self.runner.submit(plan)

    def collect(self) -> StepOutput:
        check(self.runner is not None, "worker", "not started", "start() before collect()")
        return self.runner.collect()

    def step_ready(self) -> bool:
        """Whether `collect` would return without waiting for the device (a query: never blocks)."""
        return self.runner is None or self.runner.step_ready()

    def expert_load(self) -> list[list[int]]:
        """Rows routed to each expert since start, one list of num_experts counts per MoE layer.

        A rank reports the experts it holds (zeros elsewhere); only the first EP group reports
        (the others count the same rows for their slices of the experts), so the replica sums
        its ranks' lists. Empty for dense models.
        """
        if self.runner is None:
            return []
        layers = self.runner.model.expert_layers()
        if not layers or self.ctx.expert_tp_rank != 0:
            return [[0] * routed_experts(self.runner.model.arch) for _ in layers]
        out = []
        for m, local in zip(layers, self._expert_counts(layers)):
            shard = m.expert_shard
            counts = [0] * (len(local) if shard is None else shard.num_experts)
            first = 0 if shard is None else shard.first
            counts[first : first + len(local)] = local
            out.append(counts)
        return out

    def _expert_counts(self, layers: list[ExpertLayer]) -> list[list[int]]:
        """Each layer's local counts, read without making the host wait for the device: on CUDA
        this call starts a copy into pinned memory and returns the previous call's (one reporting
        period old, long finished), so the step stream never drains for a metric."""
        now = torch.stack([m.expert_load for m in layers])
        if not now.is_cuda:
            return now.tolist()
        host = torch.empty(now.shape, dtype=now.dtype, pin_memory=True)
        host.copy_(now, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._load_copy = self._load_copy, (host, event)
        if previous is None:
            return torch.zeros(now.shape, dtype=now.dtype).tolist()
        previous[1].synchronize()
        return previous[0].tolist()

    def grammar_stats(self) -> dict[str, int]:
        """The driver's grammar compile threads (workers/grammar.py CompileStats, as a dict): the
        num_stuck compiles written off and still running, num_written_off and num_refused since
        start, num_serving threads. Zeros on the other ranks (they compile nothing) and before the
        first grammar."""
        builder = None if self.runner is None or not self.runner.is_driver else self.runner.constraints
        return asdict(CompileStats(0, 0, 0, 0) if builder is None else builder.compile_stats())

    def counters(self, reset: bool = False) -> dict[str, object]:
        """What the replica reads every RANK_COUNTERS_PERIOD steps and when idle, in one call (a
        channel round trip per rank): {"expert_load": expert_load(), "grammar": grammar_stats()}.
        reset: then zero the expert counters (the engine's warm-up served no client)."""
        out = {"expert_load": self.expert_load(), "grammar": self.grammar_stats()}
        if reset and self.runner is not None:
            for layer in self.runner.model.expert_layers():
                layer.expert_load.zero_()
            self._load_copy = None  # (a copy in flight holds counts from before the reset)
        return out

    def check_health(self) -> dict[str, object]:
        return {"rank": self.rank, "started": self.runner is not None,
                "active_requests": 0 if self.runner is None else self.runner.num_active_requests}

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.constraints is not None:
            self.runner.constraints.shutdown()
        self.runner = None
        self.info = None
        shutdown_parallel(self.ctx)
        self.ctx = ParallelContext()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
