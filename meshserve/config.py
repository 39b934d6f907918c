"""Every user-facing setting, as frozen dataclasses validated in one place.

Strings become enums here, once, at the boundary. A bad value raises ConfigError naming the
field, the value and what is allowed. Each subpackage reads only the config it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from meshserve.core.attention_options import KVCacheDtype, canonical_attention_backend
from meshserve.errors import as_enum, check


class Dtype(StrEnum):
    AUTO = "auto"  # the checkpoint's torch_dtype (float32 on CPU when it is half precision)
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Quantization(StrEnum):
    NONE = "none"  # weights as the checkpoint stores them (FP8 / MXFP4 checkpoints load as published)
    FP8 = "fp8"  # online FP8: a float checkpoint's linears quantized at load, one scale per channel


class SmallMGemm(StrEnum):
    """Which linears run the weight-streaming kernel for decode-sized inputs (<= 16 rows, CUDA)."""

    # auto: FP8 linears only (the kernel per rows bucket: workers/quant/gemm_table.py; the split-K
    # GEMV measured 1.5-1.75x bf16 cuBLAS on an H100, 2026-12-05). bf16/fp16 weights stay on cuBLAS:
    # the GEMV on 16-bit weights measured 0.80-1.00x cuBLAS per layer on an H100 (2026-12-06; the 8B
    # bs-1 step 7.21 ms against 6.32), and small_m.py's kernel 0.88x (docs/engine.md).
    AUTO = "auto"
    ON = "on"  # as auto, and the bf16/fp16 decoder-layer projections on the GEMV (gemm_table's small_m_dense)
    OFF = "off"  # none: FP8 decode rows quantize their activations and run the FP8 tensor-core GEMMs


SMALL_M_GEMM_HELP = ("decode GEMMs (<= 16 rows, CUDA) on one-launch GEMV kernels: auto (the default: FP8 weights, "
                     "the kernel per rows bucket from workers/quant/gemm_table.py), on (those and the bf16/fp16 "
                     "decoder projections: not measured on a GPU yet), off (never)")
QUANTIZATION_HELP = ("none (default: weights as the checkpoint stores them; FP8 and MXFP4 checkpoints load as "
                     "published) or fp8 (quantize a bf16/fp32 checkpoint's linears to FP8 at load; the LM head "
                     "stays in the model dtype unless --quantize-lm-head)")
QUANTIZE_LM_HEAD_HELP = ("with --quantization fp8: the LM head in FP8 too (one scale per vocabulary row), read at "
                         "half the bytes by every decode step. Off by default: the head chooses the tokens, so its "
                         "rounding moves the logits (a few percent of their norm) and can flip a near tie. Tied "
                         "embeddings keep the embedding in the model dtype and add an FP8 copy for the head "
                         "(vocab x hidden bytes more). An FP8 checkpoint's float head is quantized the same way")


class PoolMode(StrEnum):
    UNIFIED = "unified"
    DISAGGREGATED = "disaggregated"


class KVTransport(StrEnum):
    """How KV moves between the pools (kvtransfer/transport.py)."""

    AUTO = "auto"  # cuda_ipc where the importer sees the exporter's GPU, else nixl where both ends have it, else zmq
    ZMQ = "zmq"  # pyzmq over TCP: any two ends (host-staged from GPU caches); the fallback
    CUDA_IPC = "cuda_ipc"  # device to device within one host (falls back to zmq elsewhere)
    NIXL = "nixl"  # a NIXL READ of registered cache memory (DRAM or VRAM; UCX), falls back to zmq


def check_kv_transport(value: object) -> str:
    """A `kv_transport` value: a KVTransport name, or "package.module:Class" of a puller of one's own."""
    module, sep, name = str(value).partition(":")
    ok = isinstance(value, str) and (value in {t.value for t in KVTransport} or (
        bool(sep) and all(p.isidentifier() for p in module.split(".")) and name.isidentifier()))
    check(ok, "kv_transport", value, f"one of {[t.value for t in KVTransport]} or 'package.module:Class' of a puller")
    return str(value)


class DcpComm(StrEnum):
    AG_RS = "ag_rs"  # all-gather LSE, rescale, reduce-scatter outputs
    A2A = "a2a"  # all-to-all outputs and LSEs, then a local merge


MAX_WAIT_S = 7 * 24 * 3600.0  # a week: longer waits are a typo (ms for s), not a policy


def _seconds(name: str, value: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 1 <= value <= MAX_WAIT_S
    check(ok, name, value, f"a number of seconds in [1, {MAX_WAIT_S:.0f}]")


def _number(name: str, value: float, low: float, high: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high
    check(ok, name, value, f"a number of seconds in [{low:g}, {high:g}]")


def _positive(name: str, value: int, *, upper: int | None = None) -> None:
    allowed = "an integer >= 1" if upper is None else f"an integer in [1, {upper}]"
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    check(ok and (upper is None or value <= upper), name, value, allowed)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={"help": "HF checkpoint directory; None = bundled demo"})
    dtype: Dtype = Dtype.AUTO
    max_model_len: int | None = field(default=None, metadata={"help": "None = the model's own limit"})
    seed: int = 0
    enforce_eager: bool = field(default=False, metadata={
        "help": "never replay CUDA graphs (decode steps, or the piecewise graphs of steps with prefill tokens)"})
    warmup: bool | None = field(default=None, metadata={
        "help": "run three short greedy requests through each replica's engine before it takes requests, so that "
                "kernels built or compiled at first use are built at start (engine/warmup.py). None: on CUDA"})
    cuda_graph_max_batch: int = field(default=256, metadata={
        "help": "decode batches up to this size replay CUDA graphs (buckets 1, 2, 4, 8, 16, ...); larger run eager"})
    piecewise_graph_tokens: int = field(default=1024, metadata={
        "help": "steps with prefill tokens, up to this many new tokens, replay CUDA graphs of the work between "
                "attention calls (workers/piecewise_graphs.py); larger steps run eager; 0: always eager"})
    quantization: Quantization = field(default=Quantization.NONE, metadata={
        "help": "fp8: quantize a bf16/fp32 checkpoint's linear weights to FP8 at load (per-channel scales)"})
    small_m_gemm: SmallMGemm = field(default=SmallMGemm.AUTO, metadata={"help": SMALL_M_GEMM_HELP})
    quantize_lm_head: bool = field(default=False, metadata={"help": QUANTIZE_LM_HEAD_HELP})

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_enum(Dtype, "dtype", self.dtype))
        object.__setattr__(self, "quantization", as_enum(Quantization, "quantization", self.quantization or "none"))
        check(isinstance(self.quantize_lm_head, bool), "quantize_lm_head", self.quantize_lm_head, "true or false")
        check(not self.quantize_lm_head or self.quantization is Quantization.FP8, "quantize_lm_head",
              self.quantize_lm_head, f"false with quantization='{self.quantization}' (the LM head is quantized "
              "only together with the other linears: quantization='fp8', --quantization fp8)")
        object.__setattr__(self, "small_m_gemm", as_enum(SmallMGemm, "small_m_gemm", self.small_m_gemm))
        check(isinstance(self.enforce_eager, bool), "enforce_eager", self.enforce_eager, "true or false")
        check(self.warmup is None or isinstance(self.warmup, bool), "warmup", self.warmup,
              "true, false or unset (on CUDA)")
        _positive("cuda_graph_max_batch", self.cuda_graph_max_batch, upper=4096)
        check(isinstance(self.piecewise_graph_tokens, int) and not isinstance(self.piecewise_graph_tokens, bool)
              and 0 <= self.piecewise_graph_tokens <= 16384, "piecewise_graph_tokens", self.piecewise_graph_tokens,
              "an integer in [0, 16384] (0: steps with prefill tokens run eager)")
        if self.model is not None:
            check(Path(self.model).is_dir(), "model", self.model, "an existing checkpoint directory")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len, upper=1 << 22)
        check(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "an integer >= 0")


# KV block (page) size in tokens when the user gives none: the one switch for every entry point
# (CacheConfig, `meshserve serve|generate|backends`, LLM()). 16 keeps prefix reuse fine-grained;
# TRITON's prefill reads K/V through TMA descriptors only from pages of 64
# (attention/kernels/config.py PREFILL_DESCRIPTOR_MIN_PAGE; H200 2026-12-02: 0.77x FlashInfer at 64
# against 0.61x at 16, FlashInfer level at both). Change it only with a GPU measurement.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    num_kv_blocks: int | None = field(default=None, metadata={"help": "fixed block count; overrides memory"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"help": "KV budget per rank in bytes"})
    memory_utilization: float | None = field(default=None, metadata={
        "help": "fraction of the memory still free once weights are loaded that the KV pool takes (CUDA: the "
                "GPU's free memory, default 0.85; CPU: the host's available memory, default a fixed 256 MiB)"})
    enable_prefix_caching: bool = True
    kv_transport: str = field(default="auto", metadata={
        "help": "KV hand-over between pools: auto (cuda_ipc where the importer sees the exporter's GPU, else nixl "
                "where both ends have it, else zmq), nixl, zmq or cuda_ipc"})
    kv_verify_checksum: bool = field(default=False, metadata={
        "help": "direct KV pulls (nixl, cuda_ipc) verify the frames' checksum: every export then computes it at "
                "the offer (a read of every byte on the prefill rank: ~7 ms per 32k tokens of the demo model on "
                "a 2-core CPU; a kernel and a host sync on a GPU) and every pull checks it (the same again on the "
                "decode rank). zmq pulls always verify it"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", as_enum(KVCacheDtype, "kv_cache_dtype", self.kv_cache_dtype))
        object.__setattr__(self, "kv_transport", check_kv_transport(self.kv_transport))
        check(isinstance(self.kv_verify_checksum, bool), "kv_verify_checksum", self.kv_verify_checksum,
              "true or false")
        bs = self.block_size
        check(
            isinstance(bs, int) and 1 <= bs <= 1 << 20 and bs & (bs - 1) == 0,
            "block_size",
            bs,
            "a power of two (16..256 for paged backends; == max_model_len for the naive layout)",
        )
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.memory_utilization is not None:
            u = self.memory_utilization
            check(isinstance(u, float | int) and not isinstance(u, bool) and 0 < u <= 1, "gpu_memory_utilization",
                  u, "a fraction in (0, 1]")
            check(self.kv_cache_memory_bytes is None and self.num_kv_blocks is None, "gpu_memory_utilization", u,
                  "unset when --kv-cache-memory-bytes or --num-kv-blocks fixes the KV pool")


@dataclass(frozen=True)
class AttentionConfig:
    backend: str | None = field(default=None, metadata={
        "help": "TORCH, CPU_SDPA, TRITON, FLASHINFER, or a phase split prefill=NAME,decode=NAME (standard layers "
                "prefill on one backend and decode on the other, over one cache; MLA layers take each name for "
                "their prefill and decode backend); None = automatic"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", canonical_attention_backend(self.backend, "attention_backend"))


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dcp: int = 1
    dcp_comm: DcpComm = DcpComm.AG_RS
    # Expert parallelism (MoE models): the tp ranks form tp/ep groups of ep consecutive ranks;
    # each rank of a group holds num_experts/ep whole experts (sliced tp/ep ways across groups).
    ep: int = field(default=1, metadata={"help": "expert-parallel ranks (MoE models; a divisor of tp)"})
    # Below 1, several ranks share one GPU (Ray's fractional GPUs: their actors see the same device);
    # that rank's automatic KV budget is the same fraction of the card (workers/kv_budget.py).
    gpus_per_rank: float = field(default=1.0, metadata={
        "help": "the share of a GPU each rank reserves on Ray, in (0, 1]: 0.5 puts two one-rank replicas on one "
                "GPU (a prefill and a decode replica on a one-GPU machine); ranks of a tp > 1 replica need a "
                "whole GPU each"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "dcp_comm", as_enum(DcpComm, "dcp_comm", self.dcp_comm))
        _positive("tp", self.tp, upper=1024)
        _positive("dcp", self.dcp, upper=1024)
        _positive("ep", self.ep, upper=1024)
        g = self.gpus_per_rank
        check(isinstance(g, int | float) and not isinstance(g, bool) and 0 < g <= 1, "gpus_per_rank", g,
              "a fraction of a GPU in (0, 1]")
        object.__setattr__(self, "gpus_per_rank", float(g))
        # NCCL refuses two ranks of one group on one device, and Ray packs fractional bundles onto one GPU.
        check(self.gpus_per_rank == 1.0 or self.tp == 1, "gpus_per_rank", g,
              f"1 with tp={self.tp} (each rank of a tensor-parallel group needs a GPU of its own; fractions "
              "apply to one-rank replicas)")
        divisors = [d for d in range(1, self.tp + 1) if self.tp % d == 0]
        check(self.tp % self.dcp == 0, "dcp", self.dcp, f"a divisor of tp={self.tp}: one of {divisors}")
        check(self.tp % self.ep == 0, "ep", self.ep,
              f"a divisor of tp={self.tp} (experts spread over the replica's ranks): one of {divisors}")

    def check_experts(self, num_experts: int | None) -> None:
        """Refuse an ep the model's experts cannot be spread over (num_experts None: a dense model)."""
        if self.ep == 1:
            return
        check(num_experts is not None, "ep", self.ep, "1 for a model without routed experts")
        ok = [e for e in range(1, self.tp + 1) if self.tp % e == 0 and num_experts % e == 0]
        check(num_experts % self.ep == 0, "ep", self.ep,
              f"a divisor of num_experts={num_experts} and of tp={self.tp}: one of {ok}")

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Refuse head counts this layout cannot split, saying which tp values would work."""
        ok_tp = [t for t in range(1, num_heads + 1) if num_heads % t == 0
                 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]
        check(self.tp in ok_tp, "tp", self.tp,
              f"one of {ok_tp} for num_heads={num_heads}, num_kv_heads={num_kv_heads}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    max_queue: int = field(default=1024, metadata={"help": "waiting requests per pool before refusal"})
    async_scheduling: bool | None = field(default=None, metadata={
        "help": "plan step N+1 while step N runs (docs/engine.md). None: where the rank's "
                "device runs a step asynchronously to the host (CUDA); on a CPU a step's submit computes it whole, "
                "so overlap would only hand every token out one step later"})
    paced_overlap: bool = field(default=True, metadata={
        "help": "with overlap scheduling, a replica waits for arrivals while a step runs, for most of the host's "
                "slack in the last steady decode, before it plans the next one, so that a request arriving while a "
                "step runs joins the next step, not the one after (cluster/replica.py; H100 2026-12-06: TTFT with 15 "
                "streams -1.1 to -2.1 ms, their TPOT unchanged)"})
    max_sequences_per_caller: int = field(default=512, metadata={
        "help": "sequences (n / best_of / beams of each request) one caller may have waiting or running; "
                "beyond it 429 with Retry-After (a caller's only request is always let in)"})
    grammar_compile_timeout_s: float = field(default=60.0, metadata={
        "help": "a structured-output request whose grammar the driver rank has not compiled this many seconds "
                "after it was announced there fails alone with a 400-style error (docs/structured_outputs.md)"})

    def __post_init__(self) -> None:
        check(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
              self.async_scheduling, "true, false or unset (where the device runs steps asynchronously)")
        check(isinstance(self.paced_overlap, bool), "paced_overlap", self.paced_overlap, "true or false")
        t = self.grammar_compile_timeout_s
        check(isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= 86400, "grammar_compile_timeout_s",
              t, "a number of seconds in (0, 86400]")
        _positive("max_sequences_per_caller", self.max_sequences_per_caller, upper=1 << 24)
        _positive("max_num_seqs", self.max_num_seqs, upper=1 << 16)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, upper=1 << 24)
        _positive("max_queue", self.max_queue, upper=1 << 24)


@dataclass(frozen=True)
class PoolConfig:
    mode: PoolMode = PoolMode.UNIFIED
    replicas: int = 1
    prefill_replicas: int = 1
    decode_replicas: int = 1
    ray_address: str | None = field(default=None, metadata={"help": "join this Ray cluster; None = local"})
    placement_timeout_s: float | None = field(default=None, metadata={
        "help": "seconds a replica's ranks may wait for Ray to place them before start-up fails; "
                "None = wait forever (health NOT_SERVING meanwhile, progress logged)"})
    step_timeout_base_s: float = field(default=60.0, metadata={
        "help": "a step (or rank call) unanswered for this long plus --step-timeout-per-token x its tokens "
                "means a hung rank: the replica is failed, killed and rebuilt, its requests migrate"})
    step_timeout_per_token_s: float = field(default=0.005, metadata={
        "help": "seconds added to a step's deadline per token it computes (long prefills get longer)"})
    max_migrations: int = field(default=2, metadata={
        "help": "times a request may move to another replica after its replica died or hung; "
                "then its stream fails with UNAVAILABLE (0 = never move)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", as_enum(PoolMode, "pools", self.mode))
        for name in ("replicas", "prefill_replicas", "decode_replicas"):
            _positive(name, getattr(self, name), upper=4096)
        if self.placement_timeout_s is not None:
            _seconds("placement_timeout", self.placement_timeout_s)
        _number("step_timeout_base", self.step_timeout_base_s, 0.1, MAX_WAIT_S)
        _number("step_timeout_per_token", self.step_timeout_per_token_s, 0.0, 10.0)
        m = self.max_migrations
        check(isinstance(m, int) and not isinstance(m, bool) and 0 <= m <= 100, "max_migrations", m,
              "an integer in [0, 100]")


@dataclass(frozen=True)
class ServerConfig:
    # gRPC's bind address and port (the CLI's --grpc-host/--grpc-port; --host/--port are the HTTP API's)
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = field(default=None, metadata={
        "help": "a port of its own for /metrics (0 = any free port); None: /metrics only on the HTTP API's port"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "bind address of the Prometheus endpoint"})
    metrics_token_file: str | None = field(default=None, metadata={
        "help": "file whose first line is the bearer token a scrape must send (default: metrics open)"})
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None
    max_message_bytes: int = 16 << 20
    http_host: str = field(default="127.0.0.1", metadata={"help": "bind address of the OpenAI-compatible HTTP API"})
    http_port: int | None = field(default=8000, metadata={"help": "its port (0 = any free port); None = no HTTP API"})
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={
        "help": "bearer tokens a client may send (--api-key / VLLM_API_KEY), besides auth_token_file's"})
    chat_template: str | None = field(default=None, metadata={"help": "Jinja2 file replacing the model's template"})
    unhealthy_liveness_s: float = field(default=300.0, metadata={
        "help": "liveness (grpc health service '') turns NOT_SERVING once the service, after it first served, "
                "has not served (a ready replica in every pool) for this long"})
    # What one request may cost (docs/api.md), checked before anything is queued.
    max_prompts_per_request: int = field(default=64, metadata={"help": "prompts of one HTTP request"})
    max_sequences_per_request: int = field(default=256, metadata={
        "help": "prompts x max(n, best_of), or x beam width, of one request"})
    max_tokens_per_request: int = field(default=1 << 22, metadata={
        "help": "sum over its sequences of prompt tokens + max_tokens, of one request"})

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is None and name != "port":
                continue
            check(isinstance(value, int) and 0 <= value <= 65535, name, value, "an integer in [0, 65535]")
        check(self.metrics_port is not None or self.http_port is not None, "metrics_port", None,
              "a port when the HTTP API is off (/metrics lives on the API port otherwise)")
        for key in self.api_keys:
            check(isinstance(key, str) and key.strip() == key and len(key) >= 1 and " " not in key, "api_key",
                  "<hidden>", "a non-empty token without spaces")
        check((self.tls_cert is None) == (self.tls_key is None), "tls_key", self.tls_key,
              "set together with tls_cert (both or neither)")
        for name in ("tls_cert", "tls_key", "auth_token_file", "metrics_token_file", "chat_template"):
            path = getattr(self, name)
            if path is not None:
                check(Path(path).is_file(), name, path, "an existing readable file")
        _positive("max_message_bytes", self.max_message_bytes, upper=1 << 31)
        _seconds("unhealthy_liveness_seconds", self.unhealthy_liveness_s)
        _positive("max_prompts_per_request", self.max_prompts_per_request, upper=1 << 20)
        _positive("max_sequences_per_request", self.max_sequences_per_request, upper=1 << 24)
        _positive("max_tokens_per_request", self.max_tokens_per_request, upper=1 << 40)
