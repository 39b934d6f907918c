"""`meshserve serve`: load the model, serve gRPC, the OpenAI-compatible HTTP API and metrics until
SIGINT/SIGTERM, then drain. gRPC and HTTP sit on the same InferenceService in this process; by
default the engine behind it runs in a process of its own (--engine-process: api/engine_client.py,
docs/architecture.md), with --no-engine-process in this one.

The flags are a contract: deploy/helm's head.sh passes them (tests/unit/deploy parses its
command line with this parser). Every flag becomes a field of a config dataclass, which
validates it; the backend is `build_service`'s choice.

Backend: always the Coordinator (cluster/coordinator.py). With no cluster flags it runs one
unified replica whose rank lives in this process (runtime in-process: nothing to start, no
Ray); replicas > 1, tp > 1, disaggregated pools or --ray-address put the ranks on Ray (without
--ray-address an embedded one-node cluster on 127.0.0.1 that listens on loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import shutil
import signal
import sys

from meshserve.api import event_loop
from meshserve.api.api_servers import (
    ApiServerGroup,
    FrontendProcess,
    check_api_server_count,
    check_port_free,
    shared_metrics_dir,
)
from meshserve.config import (
    DEFAULT_BLOCK_SIZE,
    QUANTIZATION_HELP,
    QUANTIZE_LM_HEAD_HELP,
    SMALL_M_GEMM_HELP,
    AttentionConfig,
    CacheConfig,
    Dtype,
    KVTransport,
    ModelConfig,
    ParallelConfig,
    PoolConfig,
    PoolMode,
    SchedulerConfig,
    ServerConfig,
    SmallMGemm,
)
from meshserve.core.tasks import cancel_and_wait
from meshserve.errors import UnavailableError, check

log = logging.getLogger("meshserve.serve")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers; the parsed args go to `serve_main`."""
    p = subparsers.add_parser("serve", help="serve a model over gRPC (meshserve.v1.Inference) and OpenAI-compatible "
                                            "HTTP, with Prometheus metrics")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory or hub model id org/name, as --model (vLLM's positional form)")
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", default=None,
                   help="HF checkpoint directory, or a hub model id org/name (default: the bundled demo model)")
    m.add_argument("--revision", default=None, help="branch, tag or commit of a hub model id")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may use, the first in responses and metrics (default: the model id, or "
                        "the folder's name)")
    m.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for requests that leave them unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens for chat): auto = the checkpoint's "
                        "generation_config.json, vllm = none (OpenAI's defaults), or that file in DIR")
    m.add_argument("--chat-template", default=None, help="Jinja2 chat template file (default: the checkpoint's)")
    m.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the model's text with tool_choice auto: hermes, llama3_json, "
                        "deepseek_v3 or openai (default: detected from the chat template)")
    m.add_argument("--dtype", default="auto", choices=[d.value for d in Dtype])
    m.add_argument("--quantization", default="none", help=QUANTIZATION_HELP)
    m.add_argument("--quantize-lm-head", action="store_true", help=QUANTIZE_LM_HEAD_HELP)
    m.add_argument("--small-m-gemm", default="auto", choices=[v.value for v in SmallMGemm], help=SMALL_M_GEMM_HELP)
    m.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks per replica")
    m.add_argument("--dcp", "--decode-context-parallel-size", "-dcp", dest="dcp", type=int, default=1,
                   help="decode-context-parallel ranks (divides tp)")
    m.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks for MoE models (divides tp and the number of experts)")
    m.add_argument("--attention-backend", default=None,
                   help="CPU_SDPA, TORCH, TRITON or FLASHINFER, or a phase split prefill=NAME,decode=NAME "
                        "(default: automatic; `meshserve backends` says why)")
    m.add_argument("--block-size", type=int, default=None,
                   help=f"KV block size in tokens, a power of two (default {DEFAULT_BLOCK_SIZE}; embedding models: "
                        "the naive layout)")
    m.add_argument("--max-model-len", type=int, default=None, help="default: the model's own limit")
    m.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per replica (default: from memory)")
    m.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV budget per rank in bytes")
    m.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="fraction of the memory left free after the weights (and, on CUDA, the activation peak) "
                        "that the KV pool takes, in (0, 1]. CUDA: of the GPU's free memory (default 0.85). CPU: of "
                        "the host's available memory (default: a fixed 256 MiB pool)")
    m.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once per replica")
    m.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step per replica")
    m.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, dest="prefix_caching",
                   default=True, help="reuse the KV of cached prompt prefixes (default: on)")
    m.add_argument("--no-prefix-caching", action="store_false", dest="prefix_caching",
                   help="as --no-enable-prefix-caching")
    m.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without their own")
    m.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (default on CUDA: decode steps replay CUDA graphs, and steps with "
                        "prefill tokens replay the piecewise graphs of --piecewise-graph-tokens)")
    m.add_argument("--piecewise-graph-tokens", type=int, default=1024,
                   help="on CUDA, steps with prefill tokens of up to this many new tokens replay CUDA graphs of the "
                        "work between attention calls (vLLM's piecewise graphs); larger steps run eagerly; "
                        "0: every such step eagerly (default: 1024)")
    m.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="each replica runs three short greedy requests through its engine before readiness turns "
                        "SERVING, so that kernels built or compiled at first use are built then, not in a client's "
                        "first request (default: on CUDA)")
    m.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling: plan step N+1 while step N runs (vLLM's flag). Default: on where the "
                        "device runs steps asynchronously, i.e. CUDA; --no-async-scheduling plans each step only "
                        "after the previous one returned; --async-scheduling forces it on a CPU too, where it only "
                        "delays each token by a step (for tests and benches)")
    m.add_argument("--paced-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="with overlap scheduling, wait for arrivals while a step runs, for most of the host's slack "
                        "in the last steady decode, before planning the next, so a request arriving mid-step joins "
                        "the next step (docs/engine.md \"Paced overlap\"; default: on; --no-paced-overlap plans the "
                        "next step as soon as the last one's results are back)")
    m.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    c = p.add_argument_group("cluster")
    c.add_argument("--pools", default="unified", choices=[m.value for m in PoolMode])
    c.add_argument("--replicas", type=int, default=1, help="replicas in the unified pool")
    c.add_argument("--prefill-replicas", type=int, default=1, help="prefill replicas (disaggregated)")
    c.add_argument("--decode-replicas", type=int, default=1, help="decode replicas (disaggregated)")
    for role in ("prefill", "decode"):
        c.add_argument(f"--{role}-tp", type=int, default=None,
                       help=f"tensor-parallel ranks per {role} replica (disaggregated; default --tp)")
        c.add_argument(f"--{role}-dcp", type=int, default=None,
                       help=f"decode-context-parallel ranks per {role} replica, dividing its tp (default --dcp)")
    c.add_argument("--gpus-per-rank", type=float, default=1.0, metavar="FRACTION",
                   help="the share of a GPU each rank reserves on Ray, in (0, 1] (default 1): 0.5 lets a prefill and "
                        "a decode replica share one GPU (--pools disaggregated on a one-GPU machine; their KV then "
                        "moves by CUDA IPC). Each such rank's automatic KV budget is that fraction of the card "
                        "(--kv-cache-memory-bytes overrides it). Ranks of a tp > 1 replica need a GPU each")
    c.add_argument("--kv-transport", default="auto", choices=[t.value for t in KVTransport],
                   help="KV hand-over between the pools: auto (cuda_ipc when both ends are CUDA processes of one "
                        "host that see the same GPU, else nixl where both ends have it, else zmq), nixl (a NIXL READ "
                        "of the registered cache; falls back to zmq), cuda_ipc (falls back to zmq where it cannot "
                        "apply), or zmq")
    c.add_argument("--kv-verify-checksum", action="store_true",
                   help="direct KV pulls (nixl, cuda_ipc) verify the frames' checksum too (zmq pulls always do); it "
                        "costs a read of every handed-over byte on both ranks (docs/cluster.md, 'KV transports')")
    c.add_argument("--ray-address", default=None, help="join this Ray cluster (given to ray.init; 'auto' works)")
    c.add_argument("--placement-timeout", type=float, default=None, metavar="SECONDS",
                   help="fail start-up when Ray has not placed a replica's ranks within this time (default: wait "
                        "as long as it takes, health NOT_SERVING and progress logged every 30 s)")
    c.add_argument("--step-timeout-base", type=float, default=60.0, metavar="SECONDS",
                   help="a step unanswered for this long (+ --step-timeout-per-token x its tokens) means a hung "
                        "rank: the replica is killed and rebuilt, its streams move on (default 60)")
    c.add_argument("--step-timeout-per-token", type=float, default=0.005, metavar="SECONDS",
                   help="seconds a step's deadline grows per token it computes (default 0.005)")
    c.add_argument("--max-migrations", type=int, default=2,
                   help="times a stream may move to another replica after its replica died or hung, continuing "
                        "from the tokens already sent; then UNAVAILABLE (default 2; 0 = never)")
    s = p.add_argument_group("server (the OpenAI-compatible HTTP API on --host/--port, gRPC on --grpc-host/"
                             "--grpc-port, /metrics on the API port)")
    s.add_argument("--host", "--http-host", dest="http_host", default="127.0.0.1", metavar="HOST",
                   help="address of the OpenAI-compatible HTTP API (0.0.0.0 for every interface)")
    s.add_argument("--port", "--http-port", dest="http_port", type=int, default=8000, metavar="PORT",
                   help="its port (0 = any free port); /v1/..., /tokenize, /metrics, ... live here")
    s.add_argument("--no-http", action="store_true", help="serve gRPC only, no HTTP API (/metrics then on "
                                                          "--metrics-port, default 9400)")
    s.add_argument("--grpc-host", dest="grpc_host", default="127.0.0.1", metavar="HOST",
                   help="address of the gRPC service meshserve.v1.Inference (0.0.0.0 for every interface)")
    s.add_argument("--grpc-port", dest="grpc_port", type=int, default=50051, metavar="PORT",
                   help="its port (0 = any free port)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics on a port of its own (0 = any free port; default: only on --port)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of that metrics port (0.0.0.0 for every interface)")
    s.add_argument("--metrics-token-file", default=None,
                   help="file holding the bearer token a metrics scrape must send, on either port (default: none)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="bearer token(s) a client must send, to /v1 and gRPC (default: the environment's "
                        "VLLM_API_KEY, else MESHSERVE_API_KEY; the environment keeps keys out of `ps`)")
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: TLS on)")
    s.add_argument("--tls-key", default=None, help="PEM private key")
    s.add_argument("--auth-token-file", default=None,
                   help="file of bearer tokens, one per line; a client must send one, and its request ids are "
                        "its own")
    s.add_argument("--max-queue", type=int, default=1024, help="waiting requests before RESOURCE_EXHAUSTED")
    s.add_argument("--max-message-bytes", type=int, default=16 << 20, help="largest gRPC message either way")
    s.add_argument("--unhealthy-liveness-seconds", type=float, default=300.0, metavar="SECONDS",
                   help="liveness (grpc health service '') fails once the service, after serving, has had no ready "
                        "replica in some pool for this long (default 300)")
    s.add_argument("--drain-seconds", type=float, default=30.0, help="time streams get to finish on shutdown")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (coordinator and replicas) in a process of its own and the gRPC and HTTP "
                        "front-ends in this one, talking over a unix socket (vLLM's API-server / engine-core split: "
                        "per-token work of the front-ends does not share a GIL with the engine's step; "
                        "docs/performance.md). --no-engine-process: everything in one process. Embedding models "
                        "are served in one process either way (default: on)")
    s.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=False,
                   help="run the server's event loops (front-end processes and the engine process) on uvloop "
                        "(needs `pip install uvloop`) instead of asyncio's own: on the 2-core CPU it shortened "
                        "a lone request's HTTP hops but not a request's among 15 decoding streams "
                        "(docs/performance.md, \"HTTP parser and event loop\") (default: off)")
    s.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="front-end processes serving gRPC and HTTP on the same ports (SO_REUSEPORT), each with its "
                        "own connection to the one engine process (vLLM's flag): more streams a second than one "
                        "process's event loop turns into messages. 1 to the number of cores; above 1 only with "
                        "--engine-process. /metrics sums the processes; one that dies stops the whole server "
                        "(docs/architecture.md) (default: 1)")
    add_request_limit_flags(p)
    s.add_argument("--log-format", default=None, choices=["text", "json"],
                   help="log lines as text or JSON objects (default: MESHSERVE_LOG_FORMAT, else text)")
    p.set_defaults(func=serve_main)
    return p


def add_request_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one request, and one caller, may cost (docs/api.md: defaults and why)."""
    g = p.add_argument_group("request limits")
    g.add_argument("--max-prompts-per-request", type=int, default=64, help="prompts of one HTTP request (default 64)")
    g.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="prompts x max(n, best_of), or x beam width, of one request (default 256)")
    g.add_argument("--max-tokens-per-request", type=int, default=1 << 22,
                   help="one request's budget: over its sequences, prompt tokens + max_tokens (default 4194304)")
    g.add_argument("--max-sequences-per-caller", type=int, default=512,
                   help="sequences one caller (bearer token, else peer address) may have waiting or running; "
                        "beyond it 429 with Retry-After (default 512)")
    g.add_argument("--grammar-compile-timeout", type=float, default=60.0, dest="grammar_compile_timeout_s",
                   help="seconds a structured-output request may wait for its grammar's compile before it fails "
                        "alone with a 400 (default 60)")


def configs_of(args: argparse.Namespace):
    """Every flag into its config dataclass (each validates its fields)."""
    from meshserve.api.hub import resolve_model
    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.engine.engine_config import EngineConfig

    backend = args.attention_backend
    model_flag(args)
    if args.model is None:  # `serve --api-key KEY DIR`: the list flag took the model; say so, not serve the demo
        for flag, values in (("api_key", args.api_key), ("served_model_name", args.served_model_name)):
            last = (values or [""])[-1]
            option = "--" + flag.replace("_", "-")
            check(not os.path.isdir(last), flag, "<hidden>" if flag == "api_key" else values,
                  f"values without the model folder {last!r}: put MODEL first (meshserve serve MODEL {option} ...)")
        check(args.revision is None, "revision", args.revision, "unset unless --model names a hub model id")
        model = str(DEMO_MODEL_DIR)
    else:
        model = resolve_model(args.model, revision=args.revision, progress=sys.stderr.isatty())
    engine = EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                          seed=args.seed, enforce_eager=args.enforce_eager, quantization=args.quantization,
                          small_m_gemm=args.small_m_gemm, quantize_lm_head=args.quantize_lm_head,
                          cuda_graph_max_batch=max(1, min(args.max_num_seqs, 512)), warmup=args.warmup,
                          piecewise_graph_tokens=args.piecewise_graph_tokens),
        cache=CacheConfig(block_size=args.block_size or DEFAULT_BLOCK_SIZE, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.prefix_caching, kv_transport=args.kv_transport,
                          kv_verify_checksum=args.kv_verify_checksum),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_queue=args.max_queue,
                                  async_scheduling=args.async_scheduling,
                                  paced_overlap=args.paced_overlap,
                                  max_sequences_per_caller=args.max_sequences_per_caller,
                                  grammar_compile_timeout_s=args.grammar_compile_timeout_s),
        attention=AttentionConfig(backend=None if backend in (None, "", "auto") else backend),
        parallel=ParallelConfig(tp=args.tp, dcp=args.dcp, ep=args.ep, gpus_per_rank=args.gpus_per_rank),
    )
    pools = PoolConfig(mode=args.pools, replicas=args.replicas, prefill_replicas=args.prefill_replicas,
                       decode_replicas=args.decode_replicas, ray_address=args.ray_address,
                       placement_timeout_s=args.placement_timeout, step_timeout_base_s=args.step_timeout_base,
                       step_timeout_per_token_s=args.step_timeout_per_token, max_migrations=args.max_migrations)
    # the ports by their flags' names (ServerConfig's fields are grpc's `port` and `http_port`)
    for name, value in (("port", args.http_port), ("grpc_port", args.grpc_port), ("metrics_port", args.metrics_port)):
        check(value is None or 0 <= value <= 65535, name, value, "an integer in [0, 65535]")
    metrics_port = args.metrics_port if args.metrics_port is not None or not args.no_http else 9400
    server = ServerConfig(host=args.grpc_host, port=args.grpc_port, metrics_port=metrics_port,
                          metrics_host=args.metrics_host, metrics_token_file=args.metrics_token_file,
                          tls_cert=args.tls_cert,
                          tls_key=args.tls_key, auth_token_file=args.auth_token_file,
                          max_message_bytes=args.max_message_bytes, http_host=args.http_host,
                          http_port=None if args.no_http else args.http_port, chat_template=args.chat_template,
                          unhealthy_liveness_s=args.unhealthy_liveness_seconds, api_keys=api_keys_of(args),
                          max_prompts_per_request=args.max_prompts_per_request,
                          max_sequences_per_request=args.max_sequences_per_request,
                          max_tokens_per_request=args.max_tokens_per_request)
    check(args.drain_seconds >= 0, "drain_seconds", args.drain_seconds, "a number of seconds >= 0")
    check(not args.uvloop or importlib.util.find_spec("uvloop") is not None, "uvloop", True,
          "off unless uvloop is installed (pip install uvloop)")
    names = args.served_model_name or []
    check(len(names) == len(set(names)) and all(n.strip() for n in names), "served_model_name", names,
          "distinct non-empty names")
    return engine, pools, server


def model_flag(args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are one setting: args.model (given twice, they must agree)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        check(args.model in (None, tag), "model", args.model, f"unset or {tag!r} (the positional MODEL is {tag!r})")
        args.model = tag
        args.model_tag = None


API_KEY_ENV = ("VLLM_API_KEY", "MESHSERVE_API_KEY")


def api_keys_of(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, else VLLM_API_KEY (vLLM's variable), else MESHSERVE_API_KEY; () = no key."""
    if args.api_key:
        return tuple(args.api_key)
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return (os.environ[name],)
    return ()


def pool_parallel_of(args: argparse.Namespace, pools: PoolConfig) -> dict[str, ParallelConfig | None]:
    """{"prefill": ..., "decode": ...}: each pool's own layout from --prefill-tp/--prefill-dcp and
    --decode-tp/--decode-dcp (None: the pool uses --tp/--dcp). Refused with unified pools."""
    out: dict[str, ParallelConfig | None] = {}
    for role in ("prefill", "decode"):
        tp, dcp = getattr(args, f"{role}_tp"), getattr(args, f"{role}_dcp")
        if tp is None and dcp is None:
            out[role] = None
            continue
        given = f"{role}_tp" if tp is not None else f"{role}_dcp"
        check(pools.mode is PoolMode.DISAGGREGATED, given, tp if tp is not None else dcp,
              "set only with --pools disaggregated (a unified pool uses --tp/--dcp)")
        tp = args.tp if tp is None else tp
        dcp = args.dcp if dcp is None else dcp
        check(isinstance(tp, int) and 1 <= tp <= 1024, f"{role}_tp", tp, "an integer in [1, 1024]")
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        check(isinstance(dcp, int) and dcp >= 1 and tp % dcp == 0, f"{role}_dcp", dcp,
              f"a divisor of {role}_tp={tp}: one of {divisors}")
        out[role] = ParallelConfig(tp=tp, dcp=dcp, gpus_per_rank=args.gpus_per_rank)
    return out


def build_service(engine, pools: PoolConfig, *, model_name: str | None, device: str | None, progress: bool,
                  block_size: int | None = None, prefill_parallel: ParallelConfig | None = None,
                  decode_parallel: ParallelConfig | None = None):
    """The InferenceService these settings ask for (not started: `run_server` starts it).

    Always a Coordinator: one unified replica at tp=1 without a Ray address runs its rank in
    this process (runtime in-process, the embedded default); any other layout puts the ranks on
    Ray (replica pools, tp/dcp ranks as actors, disaggregated prefill/decode).

    An embedding checkpoint gets an EmbeddingService (no KV cache: the cache settings do not
    apply; `block_size`, when given, asks for the paged attention layout instead of the naive one).
    prefill_parallel / decode_parallel: a disaggregated pool's own (tp, dcp) (default engine.parallel).
    """
    from meshserve.cluster.coordinator import ClusterConfig, Coordinator, Runtime
    from meshserve.core.checkpoint_files import read_model_task

    if read_model_task(engine.model.model) == "embed":
        why = "1 for an embedding model (it is served in-process, without Ray)"
        check(pools.mode is PoolMode.UNIFIED, "pools", pools.mode.value, f"'unified' with replicas={why}")
        check(pools.replicas == 1, "replicas", pools.replicas, why)
        check(engine.parallel.tp == 1, "tp", engine.parallel.tp, why)
        from meshserve.cluster.embedding_service import EmbeddingService
        from meshserve.workers.embedder import Embedder

        embedder = Embedder(engine.model.model, dtype=engine.model.dtype.value,
                            attention_backend=engine.attention.backend, block_size=block_size,
                            max_model_len=engine.model.max_model_len,
                            max_num_batched_tokens=engine.scheduler.max_num_batched_tokens, device=device)
        return EmbeddingService(embedder, model_name=model_name, max_queue=engine.scheduler.max_queue)
    if engine.cache.memory_utilization is not None and device != "cuda":
        import torch  # here, where the engine runs: serve's front-end processes import no torch

        if device == "cpu" or not torch.cuda.is_available():
            log.info("--gpu-memory-utilization %g on CPU: the KV pool takes that fraction of the host's available "
                     "memory", engine.cache.memory_utilization)
    single = (pools.mode is PoolMode.UNIFIED and pools.replicas == 1 and pools.ray_address is None
              and engine.parallel.tp == 1)
    runtime = Runtime.IN_PROCESS if single else Runtime.RAY  # the embedded default: no Ray to start
    return Coordinator(ClusterConfig(engine=engine, pools=pools, runtime=runtime, device=device,
                                     model_name=model_name, progress=progress,
                                     prefill_parallel=prefill_parallel, decode_parallel=decode_parallel))


def default_model_name(args: argparse.Namespace) -> str | None:
    """The first --served-model-name, else a hub id as given (not its snapshot folder's hash), else None
    (the folder's name)."""
    from meshserve.api.hub import is_model_id

    model_flag(args)
    if args.served_model_name:
        return args.served_model_name[0]
    if args.model is None or os.path.isdir(args.model):
        return None
    return args.model if is_model_id(args.model) else None


async def run_server(service, server_config: ServerConfig, *, max_queue: int, drain_seconds: float,
                     announce=print, chat_template=None, sampling_defaults=None,
                     frontend: FrontendProcess | None = None, api_servers: ApiServerGroup | None = None,
                     on_serving=None) -> None:
    """Serve until SIGINT or SIGTERM, then drain and shut the service down.

    The front-ends bind first (a busy port fails before any model loads), then the service
    starts behind them: meanwhile health answers, readiness NOT_SERVING and requests
    UNAVAILABLE. A service that fails to start (e.g. --placement-timeout passed) stops them all.

    --api-server-count (api/api_servers.py): `frontend` says which front-end process this is;
    process 0 gets the others as `api_servers` (started once its ports are bound, stopped and
    waited for before the service shuts down; one that exits stops the server with an error);
    the others stop on SIGTERM only and call `on_serving` once they serve."""
    from meshserve.api.convert import ApiLimits
    from meshserve.api.generation_defaults import SamplingDefaults
    from meshserve.api.http.server import HttpServer
    from meshserve.api.server import ApiServer

    limits = ApiLimits.of(server_config)
    sampling_defaults = sampling_defaults or SamplingDefaults()
    frontend = frontend or FrontendProcess()
    server = ApiServer(service, server_config, max_queue=max_queue, limits=limits, sampling_defaults=sampling_defaults,
                       api_server=frontend.index, shared_metrics_dir=frontend.metrics_dir,
                       reuse_port=frontend.shares_ports, metrics=frontend.index == 0)  # its own port: process 0's
    http = None
    try:
        if api_servers is not None:  # shared ports: nobody may hold them yet, not even a sharing server
            check_port_free(server_config.http_host, server_config.http_port, "http_port")
            check_port_free(server_config.host, server_config.port, "grpc_port")
        if server_config.http_port is not None:  # bound first: a busy port fails before gRPC starts
            http = HttpServer(service, host=server_config.http_host, port=server_config.http_port,
                              metrics=server.metrics, tokens=server.tokens, chat_template=chat_template, limits=limits,
                              max_body_bytes=server_config.max_message_bytes, tls_cert=server_config.tls_cert,
                              tls_key=server_config.tls_key, metrics_token=server.metrics_token,
                              sampling_defaults=sampling_defaults, reuse_port=frontend.shares_ports)
            await http.start()
        await server.start()
        if api_servers is not None:
            api_servers.start(http_port=None if http is None else http.port, grpc_port=server.port)
    except BaseException:  # a busy port: the other front-end does not outlive the refusal
        if http is not None:
            await http.stop(grace=0)
        await server.stop(grace=0)
        raise
    # a log line, not stdout: the first stdout line stays "meshserve: serving ..." (scripts wait for it)
    metrics_url = server.metrics_url or (f"{http.url}/metrics" if http is not None else "process 0's metrics port")
    log.info("health on %s (readiness NOT_SERVING until the replicas are up), metrics on %s; starting the service",
             server.address, metrics_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: the user does not want to wait for the drain
            os.write(2, b"meshserve: interrupted again: exiting now\n")
            os._exit(130)
        stop.set()

    # the other front-end processes stop when process 0 tells them (a Ctrl-C reaches them all)
    signals = (signal.SIGINT, signal.SIGTERM) if frontend.index == 0 else (signal.SIGTERM,)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    failure: list[str] = []
    watch = None

    async def start_all() -> None:
        if hasattr(service, "start"):
            await service.start()
        if api_servers is not None:
            await api_servers.wait_ready()

    async def watch_api_servers() -> None:
        failure.append(await api_servers.watch())
        log.error("%s: stopping the whole server", failure[0])
        stop.set()

    try:
        if await _start_or_stop(start_all, stop):
            await server.health.update()  # readiness flips now, not at the next poll
            for sig in signals:  # again: joining Ray may have replaced them
                loop.add_signal_handler(sig, on_signal)
            if api_servers is not None:
                watch = loop.create_task(watch_api_servers())
            model = service.models()[0].name
            announce(f"meshserve: serving {model} on {server.address}, metrics on {metrics_url}")
            if http is not None:
                announce(f"meshserve: OpenAI-compatible API on {http.url}/v1")
            if on_serving is not None:
                on_serving()
            await stop.wait()
        announce(f"meshserve: draining (up to {drain_seconds:g} s)")
        if api_servers is not None:  # every process drains its own streams; the engine stops after all
            api_servers.terminate()
        await asyncio.gather(server.stop(grace=drain_seconds),
                             *([http.stop(grace=drain_seconds)] if http is not None else []),
                             *([api_servers.wait(drain_seconds)] if api_servers is not None else []))
        await service.shutdown(drain=False)
    except BaseException:
        if api_servers is not None:
            api_servers.kill()
        await asyncio.gather(server.stop(grace=0), *([http.stop(grace=0)] if http is not None else []),
                             return_exceptions=True)
        await service.shutdown(drain=False)
        raise
    finally:
        if watch is not None:
            watch.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
    if failure:
        raise UnavailableError(f"{failure[0]}: the whole server stopped (--api-server-count)")
    announce("meshserve: stopped")


async def _start_or_stop(start, stop: asyncio.Event) -> bool:
    """Run `start()` (a coroutine function) unless `stop` is set first: True once started,
    False when stopped while starting; a failed start raises."""
    starting = asyncio.create_task(start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if starting.done():
        starting.result()  # raises the start's error
        return True
    await cancel_and_wait(starting)
    return False


def _is_embedding_model(model: str) -> bool:
    from meshserve.core.checkpoint_files import read_model_task

    return read_model_task(model) == "embed"


def engine_client(args: argparse.Namespace, *, model: str, model_name: str | None,
                  metrics_dir: str | None = None):
    """--engine-process: the EngineClient over a fresh engine process (started by its start), and
    with --api-server-count > 1 the group of the other front-end processes (else None)."""
    from meshserve.api.engine_client import EngineClient
    from meshserve.api.engine_process import EngineProcess
    from meshserve.core.secret import ClusterSecret

    # the resolved folder, not a hub id again
    settings = argparse.Namespace(**{**vars(args), "model": model, "model_tag": None, "revision": None})
    process = EngineProcess(settings, model_name=model_name, secret=ClusterSecret.resolve())
    client = EngineClient(process.address, process.key, model_dir=model, max_queue=args.max_queue, process=process)
    group = None
    if args.api_server_count > 1:
        group = ApiServerGroup(settings, count=args.api_server_count, engine=process, model_name=model_name,
                               metrics_dir=metrics_dir)
    return client, group


def serve_main(args: argparse.Namespace) -> int:
    from meshserve.cluster.logs import configure_logging

    level = os.environ.get("MESHSERVE_LOG") or "info"  # serve logs at info unless told
    configure_logging(level, args.log_format)
    check_api_server_count(args.api_server_count, engine_process=args.engine_process)
    # before anything imports prometheus_client (api/api_servers.py)
    metrics_dir = shared_metrics_dir() if args.api_server_count > 1 else None
    try:
        return _serve(args, level, metrics_dir)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(args: argparse.Namespace, level: str, metrics_dir: str | None) -> int:
    from meshserve.api.generation_defaults import load_sampling_defaults
    from meshserve.api.http.chat import ChatTemplate
    from meshserve.api.preflight import check_layout_fits_model

    engine, pools, server = configs_of(args)
    chat_template = ChatTemplate.load(engine.model.model, override=server.chat_template,
                                      tool_call_parser=args.tool_call_parser)
    sampling_defaults = load_sampling_defaults(args.generation_config, engine.model.model)
    # exported once every flag is good, so that rank processes and actors log alike
    os.environ["MESHSERVE_LOG"] = level
    if args.log_format:
        os.environ["MESHSERVE_LOG_FORMAT"] = args.log_format
    per_pool = pool_parallel_of(args, pools)
    check_layout_fits_model(engine.model.model, engine.parallel, per_pool)  # before Ray places anything
    api_servers = None
    embedding = _is_embedding_model(engine.model.model)
    check(not embedding or args.api_server_count == 1, "api_server_count", args.api_server_count,
          "1 for an embedding model (it is served in one process)")
    if args.engine_process and not embedding:
        service, api_servers = engine_client(args, model=engine.model.model, model_name=default_model_name(args),
                                             metrics_dir=metrics_dir)
    else:
        service = build_service(engine, pools, model_name=default_model_name(args), device=args.device,
                                progress=sys.stderr.isatty(), block_size=args.block_size,
                                prefill_parallel=per_pool["prefill"], decode_parallel=per_pool["decode"])
    if args.served_model_name and len(args.served_model_name) > 1:
        from meshserve.api.served_names import ServedNames

        service = ServedNames(service, args.served_model_name)
    announce = lambda line: print(line, flush=True)
    frontend = FrontendProcess(index=0, count=args.api_server_count, metrics_dir=metrics_dir)
    try:
        event_loop.run(run_server(service, server, max_queue=args.max_queue, drain_seconds=args.drain_seconds,
                                  announce=announce, chat_template=chat_template,
                                  sampling_defaults=sampling_defaults, frontend=frontend, api_servers=api_servers),
                       use_uvloop=args.uvloop)
    finally:
        if api_servers is not None:
            api_servers.close()
    return 0
