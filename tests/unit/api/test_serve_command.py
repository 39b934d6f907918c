"""The `serve` and `client` commands' flags: the deploy contract, defaults, and refusals that come
before any model is loaded."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from meshserve.api.server import ApiServer
from meshserve.cli import build_parser, main
from meshserve.config import PoolMode, ServerConfig
from meshserve.errors import ConfigError

CORES = len(os.sched_getaffinity(0))
CONTRACT = ["serve", "--model", "/m", "--dtype", "bfloat16", "--tp", "8", "--dcp", "2", "--attention-backend",
            "FLASHINFER", "--block-size", "32", "--max-model-len", "4096", "--pools", "disaggregated",
            "--replicas", "3", "--prefill-replicas", "2", "--decode-replicas", "4", "--ray-address", "auto",
            "--grpc-host", "0.0.0.0", "--grpc-port", "1234", "--metrics-port", "5678", "--tls-cert", "c.pem",
            "--tls-key", "k.pem", "--auth-token-file", "t", "--max-queue", "99", "--host", "0.0.0.0", "--port", "8080",
            "--chat-template", "chat.jinja", "--revision", "v2", "--log-format", "json", "--metrics-host", "10.0.0.5",
            "--metrics-token-file", "mt"]


def test_every_contract_flag_parses():
    args = build_parser().parse_args(CONTRACT)
    assert (args.model, args.dtype, args.tp, args.dcp, args.attention_backend, args.block_size,
            args.max_model_len) == ("/m", "bfloat16", 8, 2, "FLASHINFER", 32, 4096)
    assert (args.pools, args.replicas, args.prefill_replicas, args.decode_replicas, args.ray_address) == (
        "disaggregated", 3, 2, 4, "auto")
    assert (args.grpc_host, args.grpc_port, args.metrics_port, args.tls_cert, args.tls_key, args.auth_token_file,
            args.max_queue) == ("0.0.0.0", 1234, 5678, "c.pem", "k.pem", "t", 99)
    assert (args.http_host, args.http_port, args.chat_template, args.revision, args.log_format) == (
        "0.0.0.0", 8080, "chat.jinja", "v2", "json")
    assert (args.metrics_host, args.metrics_token_file) == ("10.0.0.5", "mt")


def test_defaults_serve_the_demo_on_loopback():
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.grpc_host, args.grpc_port, args.metrics_port, args.pools, args.replicas) == (
        None, "127.0.0.1", 50051, None, PoolMode.UNIFIED.value, 1)  # metrics: on the API port
    assert (args.http_host, args.http_port, args.log_format) == ("127.0.0.1", 8000, None)
    assert (args.metrics_host, args.metrics_token_file) == ("127.0.0.1", None)  # not --host: metrics stay local
    assert (args.placement_timeout, args.unhealthy_liveness_seconds) == (None, 300.0)  # wait forever; 5 min
    assert (args.step_timeout_base, args.step_timeout_per_token, args.max_migrations) == (60.0, 0.005, 2)
    client = build_parser().parse_args(["client", "hello"])
    assert (client.address, client.prompt) == ("127.0.0.1:50051", "hello")


@pytest.mark.parametrize("flags, message", [
    (["--dcp", "2"], "dcp=2 is not allowed: a divisor of tp=1"),
    (["--replicas", "0"], "replicas=0 is not allowed"),
    (["--tp", "4", "--dcp", "3"], "dcp=3 is not allowed: a divisor of tp=4"),
    (["--block-size", "24"], "block_size=24 is not allowed: a power of two"),
    (["--tls-cert", "x.pem"], "tls_key=None is not allowed: set together with tls_cert"),
    (["--auth-token-file", "/no/such/file"], "auth_token_file='/no/such/file' is not allowed"),
    (["--port", "70000"], "port=70000 is not allowed: an integer in [0, 65535]"),
    (["--grpc-port", "-1"], "grpc_port=-1 is not allowed: an integer in [0, 65535]"),
    (["--tp", "3"], "tp=3 is not allowed: a divisor of the model's num_attention_heads=4"),  # before Ray starts
    (["--tp", "2", "--ep", "2"], "ep=2 is not allowed: 1 for a model without routed experts"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 is not allowed: a fraction in (0, 1]"),
    (["--generation-config", "/no/such/dir"], "generation_config='/no/such/dir' is not allowed: auto, vllm, or a "
                                              "directory holding generation_config.json"),
    (["--served-model-name", "a", "a"], "served_model_name=['a', 'a'] is not allowed: distinct non-empty names"),
    (["--chat-template", "/no/such.jinja"], "chat_template='/no/such.jinja' is not allowed: an existing readable file"),
    (["--revision", "v1"], "revision='v1' is not allowed: unset unless --model names a hub model id"),
    (["--model", "acme/not-in-the-cache"], "HF_HUB_OFFLINE is set and the hub cache has no snapshot"),
    (["--max-queue", "0"], "max_queue=0 is not allowed"),
    (["--model", "/no/such/model"], "model='/no/such/model' is not allowed: an existing checkpoint directory"),
    (["--attention-backend", "CUDNN"], "attention_backend='CUDNN' is not allowed"),
    (["--decode-tp", "2"], "decode_tp=2 is not allowed: set only with --pools disaggregated"),
    (["--pools", "disaggregated", "--decode-tp", "4", "--decode-dcp", "3"],
     "decode_dcp=3 is not allowed: a divisor of decode_tp=4: one of [1, 2, 4]"),
    (["--pools", "disaggregated", "--tp", "2", "--dcp", "2", "--prefill-tp", "1"],
     "prefill_dcp=2 is not allowed: a divisor of prefill_tp=1: one of [1]"),
    (["--pools", "disaggregated", "--prefill-tp", "0"], "prefill_tp=0 is not allowed: an integer in [1, 1024]"),
    (["--pools", "disaggregated", "--decode-dcp", "0"], "decode_dcp=0 is not allowed"),
    (["--placement-timeout", "0"], "placement_timeout=0.0 is not allowed: a number of seconds in [1, 604800]"),
    (["--placement-timeout", "1e9"], "placement_timeout=1000000000.0 is not allowed"),
    (["--step-timeout-base", "0"], "step_timeout_base=0.0 is not allowed: a number of seconds in [0.1, 604800]"),
    (["--step-timeout-per-token", "-1"], "step_timeout_per_token=-1.0 is not allowed: a number of seconds in [0, 10]"),
    (["--max-migrations", "-1"], "max_migrations=-1 is not allowed: an integer in [0, 100]"),
    (["--gpus-per-rank", "0"], "gpus_per_rank=0.0 is not allowed: a fraction of a GPU in (0, 1]"),
    (["--gpus-per-rank", "2"], "gpus_per_rank=2.0 is not allowed: a fraction of a GPU in (0, 1]"),
    (["--pools", "disaggregated", "--decode-tp", "2", "--gpus-per-rank", "0.5"],
     "gpus_per_rank=0.5 is not allowed: 1 with tp=2 (each rank of a tensor-parallel group needs a GPU of its own"),
    (["--unhealthy-liveness-seconds", "-5"],
     "unhealthy_liveness_seconds=-5.0 is not allowed: a number of seconds in [1, 604800]"),
    (["--api-server-count", "0"], f"api_server_count=0 is not allowed: an integer in [1, {CORES}] (--api-server-count"),
    (["--api-server-count", "4096"], f"api_server_count=4096 is not allowed: an integer in [1, {CORES}]"),
    (["--no-engine-process", "--api-server-count", "2"],
     "api_server_count=2 is not allowed: 1 with --no-engine-process"),
])
def test_refusals_name_the_flag_before_loading_anything(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bad_log_level_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("MESHSERVE_LOG", "loud")
    assert main(["serve"]) == 2
    assert "MESHSERVE_LOG='loud' is not allowed: one of debug, info, warning, error" in capsys.readouterr().err


class _NoService:
    """ApiServer.start binds ports before it asks the service anything."""

    def health(self):
        raise AssertionError("not reached")


def test_a_busy_port_is_refused_with_its_number():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ApiServer(_NoService(), ServerConfig(port=port, metrics_port=0), max_queue=1)
        with pytest.raises(ConfigError, match=f"^port={port} is not allowed: a free port on 127.0.0.1"):
            asyncio.run(server.start())


def test_a_busy_http_port_is_refused_with_its_number():
    from meshserve.api.http.server import HttpServer

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = HttpServer(_NoService(), port=port)
        with pytest.raises(ConfigError, match=f"^http_port={port} is not allowed: a free port on 127.0.0.1"):
            asyncio.run(server.start())


def test_the_cli_parser_needs_no_grpc():
    """`meshserve generate` must run where grpcio is missing or older than the checked-in stubs
    accept (seen on the GPU machine: grpcio 1.84 against stubs from 1.85.1): building the parser
    and parsing `generate` import neither grpc nor the stubs."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['grpc'] = None\n"  # any `import grpc` now raises ImportError
            "from meshserve.cli import build_parser\n"
            "args = build_parser().parse_args(['generate', '--tp', '2', 'hello'])\n"
            "assert args.tp == 2 and args.prompt == 'hello'\n"
            "assert not [m for m in sys.modules if m.startswith('meshserve.v1')], 'stubs imported'\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(("flags", "want"), [
    (["--tp", "2", "--dcp", "2"], {"prefill": (2, 2), "decode": (2, 2)}),  # --tp/--dcp: both pools
    (["--prefill-tp", "1", "--decode-tp", "2", "--decode-dcp", "2"], {"prefill": (1, 1), "decode": (2, 2)}),
    (["--tp", "4", "--dcp", "2", "--decode-dcp", "4"], {"prefill": (4, 2), "decode": (4, 4)}),
])
def test_per_pool_parallelism_reaches_the_coordinator(flags, want):
    from meshserve.api.serve import build_service, configs_of, pool_parallel_of

    args = build_parser().parse_args(["serve", "--pools", "disaggregated", *flags])
    engine, pools, _ = configs_of(args)
    per_pool = pool_parallel_of(args, pools)
    service = build_service(engine, pools, model_name=None, device="cpu", progress=False,
                            prefill_parallel=per_pool["prefill"], decode_parallel=per_pool["decode"])
    layouts = service.config.parallel_by_role()  # built, not started: no rank runs
    assert {role: (p.tp, p.dcp) for role, p in layouts.items()} == want


def test_gpus_per_rank_reaches_every_pool():
    """--gpus-per-rank is each pool's ParallelConfig.gpus_per_rank (what rank_bundle and the KV budget read)."""
    from meshserve.api.serve import build_service, configs_of, pool_parallel_of

    assert build_parser().parse_args(["serve"]).gpus_per_rank == 1.0
    args = build_parser().parse_args(["serve", "--pools", "disaggregated", "--decode-dcp", "1",
                                      "--gpus-per-rank", "0.5"])
    engine, pools, _ = configs_of(args)
    per_pool = pool_parallel_of(args, pools)
    service = build_service(engine, pools, model_name=None, device="cpu", progress=False,
                            prefill_parallel=per_pool["prefill"], decode_parallel=per_pool["decode"])
    assert {role: p.gpus_per_rank for role, p in service.config.parallel_by_role().items()} == {
        "prefill": 0.5, "decode": 0.5}


def test_a_shared_port_must_be_free_even_of_a_server_that_would_share_it():
    """--api-server-count binds with SO_REUSEPORT; a port another server holds that way is refused,
    not silently shared with it."""
    from meshserve.api.api_servers import check_port_free

    with socket.socket() as sharer:
        sharer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sharer.bind(("127.0.0.1", 0))
        sharer.listen()
        port = sharer.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^http_port={port} is not allowed: a free port on 127.0.0.1"):
            check_port_free("127.0.0.1", port, "http_port")
    check_port_free("127.0.0.1", port, "http_port")  # free again


@pytest.mark.parametrize(("flags", "want"), [([], None), (["--warmup"], True), (["--no-warmup"], False)])
def test_warmup_flag_reaches_the_engine_config(flags, want):
    """--warmup / --no-warmup: ModelConfig.warmup, which each replica's EngineCore reads at start
    (unset: on CUDA only; tests/unit/engine/test_warmup.py runs it)."""
    from meshserve.api.serve import configs_of

    engine, _, _ = configs_of(build_parser().parse_args(["serve", *flags]))
    assert engine.model.warmup is want
