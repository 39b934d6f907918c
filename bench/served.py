"""`meshserve serve` in a subprocess for the serving benches: the engine settings it is started
with, the process, the greedy clients that keep each request's output, and a random-weight
Llama checkpoint to serve (bench/serve_vs_offline.py, bench/disagg_ttft.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from meshserve.api.bench.loadgen import (
    BenchRequest,
    GrpcBackend,
    LoadSpec,
    OpenAIBackend,
    Sample,
    make_requests,
    run_load,
)

try:
    import orjson
except ImportError:  # an older install: the standard parser
    orjson = json

FACES = ("http", "grpc")


class GreedyGrpc(GrpcBackend):
    """loadgen's gRPC client, greedy, keeping each request's token ids."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: dict[int, list[int]] = {}

    async def send(self, request: BenchRequest, sample: Sample, t0: float, *, request_id: str = "") -> None:
        """request_id: the request's id on the server ("": the server makes one)."""
        tokens = self.outputs.setdefault(request.seed, [])
        async for r in self.client.stream(request.prompt, model=self.model, max_tokens=request.max_tokens,
                                          ignore_eos=True, temperature=0.0, request_id=request_id):
            if r.token_ids:
                sample.arrivals.append(time.perf_counter() - t0)
                sample.output_tokens += len(r.token_ids)
                tokens.extend(r.token_ids)


class GreedyOpenAI(OpenAIBackend):
    """loadgen's HTTP/SSE client, greedy, keeping each request's text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: dict[int, str] = {}

    async def send(self, request: BenchRequest, sample: Sample, t0: float, *, request_id: str = "") -> None:
        """request_id: sent as x-request-id ("": none, the server makes one)."""
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"x-request-id": request_id} if request_id else None
        pieces: list[str] = []
        async with self.session.post(f"{self.base}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])  # the client shares the machine: parse cheaply
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error"))
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    sample.arrivals.append(time.perf_counter() - t0)
                    pieces.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
        self.outputs[request.seed] = "".join(pieces)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(*, grpc_port: int, http_port: int) -> list[str]:
    """Where `meshserve serve` listens (the one place that knows the port flags' names)."""
    return ["--port", str(http_port), "--grpc-port", str(grpc_port)]


@dataclass(frozen=True)
class EngineSettings:
    """What every side of a comparison is built with, so that they run the same engine.
    kv_cache_memory_bytes is per rank (serve's --kv-cache-memory-bytes)."""

    model: str
    device: str
    dtype: str
    max_num_seqs: int
    max_model_len: int
    kv_cache_memory_bytes: int
    max_num_batched_tokens: int = 8192

    def serve_flags(self) -> list[str]:
        return ["--model", self.model, "--device", self.device, "--dtype", self.dtype,
                "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len),
                "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--no-prefix-caching"]

    def llm_kwargs(self) -> dict:
        return dict(device=self.device, dtype=self.dtype, max_num_seqs=self.max_num_seqs,
                    max_model_len=self.max_model_len, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                    max_num_batched_tokens=self.max_num_batched_tokens, enable_prefix_caching=False)


class Server:
    """`python -m meshserve.cli serve` with `settings` and the extra `flags` in a subprocess, its
    log in a file; ready when /health says so. `name` tells servers of one bench apart; `env`:
    variables set for the server only (MESHSERVE_HOP_TRACE, bench/serve_latency.py)."""

    def __init__(self, settings: EngineSettings, *, log_path: Path, flags: list[str] | tuple[str, ...] = (),
                 name: str = "", start_timeout: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.grpc_address = f"127.0.0.1:{free_port()}"
        self.base_url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        ports = server_flags(grpc_port=int(self.grpc_address.rsplit(":", 1)[1]),
                             http_port=int(self.base_url.rsplit(":", 1)[1]))
        self.name = name
        self.command = [sys.executable, "-m", "meshserve.cli", "serve", *settings.serve_flags(), *ports, *flags]
        self.start_timeout = start_timeout
        self.env = env or {}  # set for the server's processes, besides this one's environment
        self.started_in_s: float | None = None  # launch to /health 200
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        log = open(self.log_path, "w")  # noqa: SIM115 (the child writes it until it exits)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env})
        log.close()
        deadline = t0 + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshserve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.started_in_s = time.monotonic() - t0
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"meshserve serve not ready in {self.start_timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics_text(self) -> str:
        """The server's Prometheus exposition (/metrics on the HTTP port)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            return response.read().decode()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


async def load_server(server: Server, face: str, spec: LoadSpec, *,
                      vocab_size: int) -> tuple[list[Sample], float, list]:
    """`spec`'s warm-ups, then its requests, greedy over `face` ("http" or "grpc"): the samples,
    the wall time, and each request's output in request order (token ids over gRPC, text over HTTP)."""
    if face == "http":  # made inside the loop: aiohttp's session belongs to it
        backend = GreedyOpenAI(server.base_url, token=None, model="")
    else:
        backend = GreedyGrpc(server.grpc_address, token=None, model="")
    try:
        backend.model, _, _ = await backend.model_info()
        samples, wall = await run_load(backend, spec, vocab_size=vocab_size)
        requests = make_requests(spec, vocab_size=vocab_size, count=spec.num_prompts)
        return samples, wall, [backend.outputs.get(r.seed) for r in requests]
    finally:
        await backend.close()


def random_llama_checkpoint(root: Path, shape_name: str) -> Path:
    """A random-weight Llama checkpoint of `shape_name` (llama3-8b: bf16; tiny-llama, a CPU check of
    the same path: fp32) with a WordLevel tokenizer over its whole vocabulary, in a new folder of `root`."""
    import torch

    from bench.e2e import LLAMA3_8B, TINY, write_checkpoint
    from bench.wordlevel_tokenizer import write_wordlevel_tokenizer

    shape, dtype = (LLAMA3_8B, torch.bfloat16) if shape_name == "llama3-8b" else (TINY, torch.float32)
    path = root / f"{shape_name}-random"
    path.mkdir()
    write_checkpoint(path, shape, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    config = json.loads((path / "config.json").read_text())
    write_wordlevel_tokenizer(path, shape["vocab_size"], bos_token_id=config["bos_token_id"],
                              eos_token_id=config["eos_token_id"])
    return path


def model_for_shape(root: Path, shape_name: str) -> str:
    """The checkpoint a bench's --shape names: the bundled demo model, or a random one written under `root`."""
    if shape_name == "demo":
        from meshserve.demo_model import DEMO_MODEL_DIR

        return str(DEMO_MODEL_DIR)
    return str(random_llama_checkpoint(root, shape_name))


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
