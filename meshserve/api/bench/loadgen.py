"""Requests, their arrival, and the backends that send them (gRPC, OpenAI completions, OpenAI chat).

Prompts are random token ids (no special tokens) of a length drawn uniformly from
[input_len * (1 - range_ratio), input_len * (1 + range_ratio)] (range_ratio 0: fixed), sent as
token ids so that every prompt has exactly its length; each asks for an output length drawn
the same way with EOS ignored, so every request produces exactly what it asked for (as vLLM's
random dataset does). Arrivals are a Poisson process at `request_rate` (inf: all at once),
whatever the server is doing; at most `max_concurrency` are in flight, and an arrival that finds
every slot taken waits for one (its clock starts when it is sent). Warm-up requests run first
and are not counted. datasets.py makes requests from a ShareGPT file instead; the chat backend
sends text (random ids are detokenized by the server first) and counts the prompt tokens the
server reports, chat template included.

Per request the client records: when it was sent, when each piece of output arrived (one gRPC
response or one SSE chunk), how many tokens came back (the server's usage count), and an error
if it failed. TTFT, TPOT and inter-token latencies are derived from these in report.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshserve.errors import ConfigError, check


@dataclass(frozen=True)
class LoadSpec:
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_warmups: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.num_prompts >= 1, "num_prompts", self.num_prompts, "an integer >= 1")
        check(self.input_len >= 1, "input_len", self.input_len, "an integer >= 1")
        check(self.output_len >= 1, "output_len", self.output_len, "an integer >= 1")
        check(0 <= self.range_ratio < 1, "range_ratio", self.range_ratio, "a number in [0, 1)")
        check(self.request_rate > 0, "request_rate", self.request_rate, "a rate > 0 (inf: all at once)")
        check(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency", self.max_concurrency,
              "unset or an integer >= 1")
        check(self.num_warmups >= 0, "num_warmups", self.num_warmups, "an integer >= 0")


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids, or text (a dataset's, or for chat)
    max_tokens: int
    seed: int
    prompt_tokens: int | None = None  # a text prompt's length in tokens, when known

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt)


@dataclass
class Sample:
    """One request as the client saw it; times in seconds from the run's start."""

    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # each piece of output (response / chunk)
    output_tokens: int = 0
    error: str = ""


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return rng.randint(max(1, math.floor(n * (1 - ratio))), max(1, math.ceil(n * (1 + ratio))))


def make_requests(spec: LoadSpec, *, vocab_size: int, count: int, seed_offset: int = 0) -> list[BenchRequest]:
    rng = random.Random(spec.seed + seed_offset)
    low = min(100, vocab_size // 2)  # stay clear of the special tokens at the start of most vocabularies
    return [BenchRequest([rng.randrange(low, vocab_size) for _ in range(_length(rng, spec.input_len,
                                                                                spec.range_ratio))],
                         _length(rng, spec.output_len, spec.range_ratio), spec.seed * 1_000_003 + i + seed_offset)
            for i in range(count)]


class ServerUnreachable(Exception):
    """Nothing answered at the address (refused, or no answer within the connect timeout)."""


def _only_model(names: list[str], wanted: str, where: str) -> str:
    check(not wanted or wanted in names, "model", wanted, f"one of the models served at {where}: {names}")
    return wanted or names[0]


class GrpcBackend:
    """meshserve.v1.Inference/Generate through AsyncInferenceClient."""

    name = "grpc"

    def __init__(self, address: str, *, token: str | None, model: str) -> None:
        from meshserve.api.client import AsyncInferenceClient

        self.address = address
        self.client = AsyncInferenceClient(address, token=token, wait_for_ready=True)
        self.model = model

    async def model_info(self, *, timeout: float | None = None) -> tuple[str, int, int]:
        import grpc

        self.client.wait_for_ready = False  # a refused connection fails this probe at once, not at its deadline
        try:
            models = await self.client.list_models(timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                why = exc.details() if exc.code() is grpc.StatusCode.UNAVAILABLE else f"no answer within {timeout:g} s"
                raise ServerUnreachable(f"no gRPC server answers at {self.address} ({why})") from None
            raise
        finally:
            self.client.wait_for_ready = True  # the run's requests wait out a server's brief hiccups
        name = _only_model([m.name for m in models], self.model, self.address)
        card = next(m for m in models if m.name == name)
        return card.name, card.vocab_size, card.max_model_len

    async def tokenize(self, text: str) -> list[int]:
        return await self.client.tokenize(text, model=self.model)

    async def send(self, request: BenchRequest, sample: Sample, t0: float) -> None:
        async for r in self.client.stream(request.prompt, model=self.model, max_tokens=request.max_tokens,
                                          ignore_eos=True, temperature=1.0, seed=request.seed):
            if r.token_ids:
                sample.arrivals.append(time.perf_counter() - t0)
                sample.output_tokens += len(r.token_ids)

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """POST /v1/completions (or /v1/chat/completions with chat=True) with stream and include_usage,
    over aiohttp (the SSE parsed here)."""

    def __init__(self, base_url: str, *, token: str | None, model: str, chat: bool = False) -> None:
        try:
            import aiohttp
        except ImportError:
            raise ConfigError("backend", "openai-chat" if chat else "openai",
                              "usable once aiohttp is installed: pip install 'meshserve[bench]'") from None
        self.base = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))
        self.model = model
        self.chat = chat
        self.name = "openai-chat" if chat else "openai"

    async def model_info(self, *, timeout: float | None = None) -> tuple[str, int, int]:
        import aiohttp

        try:
            async with asyncio.timeout(timeout):
                async with self.session.get(f"{self.base}/v1/models") as response:
                    body = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            os_error = getattr(exc, "os_error", None)  # ClientConnectorError: the socket's own words
            why = (f"no answer within {timeout:g} s" if isinstance(exc, TimeoutError)
                   else os_error.strerror if os_error is not None and os_error.strerror else str(exc))
            raise ServerUnreachable(f"no OpenAI-compatible server answers at {self.base} ({why})") from None
        check(response.status == 200, "base_url", self.base, f"a server that answers /v1/models ({body})")
        name = _only_model([m["id"] for m in body["data"]], self.model, self.base)
        card = next(m for m in body["data"] if m["id"] == name)
        return card["id"], card["vocab_size"], card["max_model_len"]

    async def _post(self, path: str, body: dict) -> dict:
        async with self.session.post(f"{self.base}{path}", json=body) as response:
            reply = await response.json(content_type=None)
            check(response.status == 200, "base_url", self.base, f"a server that answers {path} ({reply})")
            return reply

    async def tokenize(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"model": self.model, "prompt": text}))["tokens"]

    async def detokenize(self, ids: list[int]) -> str:
        return (await self._post("/detokenize", {"model": self.model, "tokens": ids}))["prompt"]

    async def send(self, request: BenchRequest, sample: Sample, t0: float) -> None:
        body = {"model": self.model, "max_tokens": request.max_tokens, "ignore_eos": True, "temperature": 1.0,
                "seed": request.seed, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        async with self.session.post(f"{self.base}{path}", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error"))
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    sample.arrivals.append(time.perf_counter() - t0)
                if chunk.get("usage"):
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
                    sample.prompt_tokens = chunk["usage"]["prompt_tokens"]  # chat: the template's tokens too

    async def close(self) -> None:
        await self.session.close()


async def _one(backend, request: BenchRequest, slots: asyncio.Semaphore | None, t0: float) -> Sample:
    sample = Sample(request.num_prompt_tokens, request.max_tokens)
    async with slots if slots is not None else _NoLimit():
        sample.sent = time.perf_counter() - t0
        try:
            await backend.send(request, sample, t0)
        except Exception as exc:  # a failed request is a data point, not the end of the run
            sample.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return sample


class _NoLimit:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


async def run_load(backend, spec: LoadSpec, *, vocab_size: int, requests: list[BenchRequest] | None = None,
                   warmups: list[BenchRequest] | None = None,
                   on_done: Callable[[Sample], None] | None = None) -> tuple[list[Sample], float]:
    """Warm up, then send every request on the arrival schedule; the samples and the wall time.

    requests / warmups: given (a dataset's), else random ones from `spec`; on_done: called with
    each measured request's sample as it finishes (the progress bar)."""
    if warmups is None:
        warmups = make_requests(spec, vocab_size=vocab_size, count=spec.num_warmups, seed_offset=7_919)
    if requests is None:
        requests = make_requests(spec, vocab_size=vocab_size, count=spec.num_prompts)
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    await asyncio.gather(*(_one(backend, r, slots, time.perf_counter()) for r in warmups))
    rng = random.Random(spec.seed + 1)
    t0 = time.perf_counter()
    tasks = []
    for request in requests:
        task = asyncio.create_task(_one(backend, request, slots, t0))
        if on_done is not None:
            task.add_done_callback(lambda t: on_done(t.result()))
        tasks.append(task)
        if math.isfinite(spec.request_rate):
            await asyncio.sleep(rng.expovariate(spec.request_rate))
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - t0
