"""EngineClient: the InferenceService of a front-end process, over the channel to the engine's
process (cluster/service_wire.py, cluster/service_endpoint.py).

The gRPC and HTTP front-ends call it exactly as they call a Coordinator. What needs no engine is
answered here: tokenize and detokenize with the checkpoint's own tokenizer, loaded in this
process; models, health and stats from the engine's latest state (carried by every step's BATCH,
and sent every STATE_PERIOD_S).
Streams: `generate` sends one OPEN frame and reads its deltas from a queue that the reader task
fills from the engine's per-step BATCH frames; leaving a stream early sends CANCEL (the engine
aborts the request and frees its blocks). The reader task only routes a BATCH's items to their
queues, streams getting their first delta first; each stream's reader decodes its own and writes
its chunk (SSE or gRPC, ~0.1 ms of this process a stream) in that order, so a new request's time
to first token does not wait for every running stream's decode and write (a running stream's
next token moves by as much, once).

If the engine's process exits, or stops reporting for STALE_S, health says so (serving False,
with the reason: readiness NOT_SERVING, /health 503), every open stream ends with
ReplicaFailedError and new requests get UnavailableError, instead of hanging.

    client = EngineClient(address, key, model_dir=DIR, process=EngineProcess(...))
    await client.start()       # starts the process (if any), waits until its service serves
    async for delta in client.generate(ids, params, request_id="r1"): ...
    await client.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

import msgpack
import zmq
import zmq.asyncio

from meshserve.cluster import service_wire as wire
from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats
from meshserve.core import hop_trace
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.checkpoint_files import encode_ids, load_tokenizer
from meshserve.core.delta_coalescing import coalesce
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.secret import RejectedFrames
from meshserve.core.tasks import cancel_and_wait
from meshserve.errors import ConfigError, ReplicaFailedError, UnavailableError, check

log = logging.getLogger("meshserve.api")
STALE_S = 10.0  # no report from a live engine process for this long: it is hung
SHUTDOWN_TIMEOUT_S = 60.0
WATCH_PERIOD_S = 0.1
MAX_BATCH_BYTES = 256 << 20  # one step's deltas, prompt logprobs of long prompts included


def _decoded(item: list | BaseException, request_id: str) -> CompletionDelta | BaseException:
    """A stream's queue entry as its reader hands it on: a BATCH item decoded (a delta, or the
    error that ends the stream), or an exception put there when the engine went away."""
    if isinstance(item, BaseException):
        return item
    return wire.decode_error(*item[2:]) if item[1] is None else wire.decode_delta(item, request_id)


class EngineClient:
    """An InferenceService whose engine runs in another process.

    process: the engine's process (api/engine_process.py: start(), exit_code(), wait(), kill()),
    started by `start`; None when the endpoint runs elsewhere (tests: a thread of this process).
    max_queue: the engine's scheduler max_queue (what the gRPC ServerInfo reports).
    owns_engine: `shutdown` stops the engine's service; False for the other front-end processes of
    --api-server-count, whose shutdown only leaves (the first process stops the engine, last).
    """

    def __init__(self, address: str, key: wire.ChannelKey, *, model_dir: str, max_queue: int = 1024,
                 process=None, owns_engine: bool = True) -> None:
        self.address = address
        self.owns_engine = owns_engine
        self.key = key
        self.max_queue = max_queue
        self.process = process
        self.tokenizer = load_tokenizer(model_dir)
        self._sock: zmq.asyncio.Socket | None = None
        self._seq = 0
        self._last_seq = 0
        self._streams: dict[int, tuple[asyncio.Queue, str]] = {}
        self._awaiting_first: set[int] = set()  # streams that have not been handed a delta yet
        self._numbers = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._health = ServiceHealth(False, 0, 0, "starting: the engine process is loading the model",
                                     unserving_s=None, degraded_s=None)
        self._stats = ServiceStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self._models: list[ModelCard] | None = None
        self._reported_at = time.monotonic()
        self._serving_at: float | None = None
        self._gone: str | None = None  # why the engine is gone (None while it is there)
        self._failed: str | None = None  # the engine's service failed to start
        self._changed = asyncio.Event()
        self._bye = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.rejected = RejectedFrames(f"front-end channel {address}")

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> EngineClient:
        """Start the engine process (if any), connect, and wait until the service serves; a
        process that exits or a service that fails to start raises UnavailableError with why."""
        if self.process is not None:
            self.process.start()
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        sock.connect(self.address)
        self._sock = sock
        self._send(wire.HELLO, b"")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]
        while True:
            if self._failed is not None:  # before _gone: the process exits right after saying why
                raise UnavailableError(f"the engine failed to start: {self._failed}")
            if self._gone is not None:
                raise UnavailableError(self._gone)
            if self._models is not None:
                return self
            self._changed.clear()
            await self._changed.wait()

    async def shutdown(self, *, drain: bool = True) -> None:
        """Stop the engine's service and process (streams still open end with the engine); a
        client that does not own the engine only disconnects."""
        if self._sock is not None and self._gone is None and self.owns_engine:
            self._send(wire.SHUTDOWN, b"")
            if self.process is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                        await self._bye.wait()
        if self.process is not None:
            await asyncio.to_thread(self.process.wait, SHUTDOWN_TIMEOUT_S)
        self._end("the engine is shut down", expected=True)
        await cancel_and_wait(*self._tasks)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> EngineClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown(drain=False)

    # -- InferenceService ------------------------------------------------------------------------
    def models(self) -> list[ModelCard]:
        if self._models is None:
            raise UnavailableError(self._gone or "the service is starting: the model is not loaded yet")
        return self._models

    def tokenize(self, text: str) -> list[int]:
        check(self.tokenizer is not None, "text", text[:20], "token ids: the model has no tokenizer.json")
        return encode_ids(self.tokenizer, text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        check(self.tokenizer is not None, "token_ids", list(token_ids[:5]), "text: the model has no tokenizer")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def health(self) -> ServiceHealth:
        now = time.monotonic()
        if self._gone is None and self._models is not None and now - self._reported_at > STALE_S:
            why = f"the engine process has not reported for {now - self._reported_at:.0f} s"
            return ServiceHealth(False, 0, self._health.total_replicas, why, unserving_s=self._since(now),
                                 degraded_s=self._since(now))
        if self._gone is not None:
            return ServiceHealth(False, 0, self._health.total_replicas, self._gone, unserving_s=self._since(now),
                                 degraded_s=self._since(now), num_rebuilds=self._health.num_rebuilds,
                                 num_rebuild_failures=self._health.num_rebuild_failures)
        return self._health

    def _since(self, now: float) -> float | None:
        return None if self._serving_at is None else now - self._serving_at

    def stats(self) -> ServiceStats:
        return self._stats

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str, beam: BeamSearchParams | None = None, caller: str = "",
                       priority: int = 0) -> AsyncIterator[CompletionDelta]:
        if self._gone is not None:
            raise UnavailableError(self._gone)
        if self._models is None:
            raise UnavailableError("the service is starting")
        check(isinstance(request_id, str) and request_id != "", "request_id", request_id, "a non-empty string")
        number = next(self._numbers)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[number] = (queue, request_id)
        self._awaiting_first.add(number)
        hop_trace.mark("frontend.open", request_id)  # (before the send: the peer may well run first)
        self._send(wire.OPEN, msgpack.packb(wire.encode_open(number, prompt, params, beam, request_id, caller,
                                                             priority)))
        finished = False
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                items = [_decoded(item, request_id) for item in items]  # here: each stream decodes its own
                for item in coalesce(items) if len(items) > 1 else items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    hop_trace.mark("frontend.delta_out", request_id)
                    yield item
                    if item.finished:
                        finished = True
                        return
        finally:
            self._streams.pop(number, None)
            self._awaiting_first.discard(number)
            if not finished and self._gone is None:
                self._send(wire.CANCEL, msgpack.packb([number]))

    async def abort(self, request_id: str) -> bool:
        if self._gone is not None:
            return False
        call = next(self._numbers)
        future = self._calls[call] = asyncio.get_running_loop().create_future()
        self._send(wire.CALL, msgpack.packb([call, "abort", [request_id]]))
        try:
            return await future
        finally:
            self._calls.pop(call, None)

    async def embed(self, inputs, *, truncate: bool = False):
        name = self._models[0].name if self._models else "model"
        raise ConfigError("model", name, "an embed model for Embed; this model's task is 'generate' (use Generate)")

    # -- the channel -----------------------------------------------------------------------------
    def _send(self, kind: bytes, payload: bytes) -> None:
        self._seq += 1
        seq = wire.seq_bytes(self._seq)
        self._sock.send_multipart([kind, seq, payload, self.key.sign(wire.TO_ENGINE, kind, seq, payload)])

    async def _read(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) != 4:
                self.rejected.add("malformed")
                continue
            kind, seq, payload, tag = parts
            n = wire.seq_of(seq)
            if n is None or not self.key.verify(tag, wire.TO_FRONTEND, kind, seq, payload):
                self.rejected.add("bad tag")
                continue
            if n <= self._last_seq:
                self.rejected.add(f"replayed seq {n}")
                continue
            self._last_seq = n
            try:
                self._handle(kind, payload)
            except Exception:
                log.exception("engine message %r failed", kind)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == wire.BATCH:
            items, state = msgpack.unpackb(payload)
            streams, fresh = self._streams, self._awaiting_first
            if hop_trace.enabled():  # keyed by the requests whose first token it carries (item: [number, token ids...])
                hop_trace.mark("frontend.batch_received", *(streams[item[0]][1] for item in items
                                                            if item[0] in fresh and item[1] and item[0] in streams))
            if fresh:  # first deltas first: stable, the rest keep their order
                items = sorted(items, key=lambda item: item[0] not in fresh)
            for item in items:
                fresh.discard(item[0])
                entry = streams.get(item[0])
                if entry is not None:  # else its reader left
                    entry[0].put_nowait(item)  # as it came: its reader decodes it
            if state is not None:  # before any stream's reader runs: the stats as of its deltas
                self._take_state(state)
        elif kind == wire.STATE:
            self._take_state(payload)
        elif kind == wire.RET:
            call, ok, result = msgpack.unpackb(payload)
            future = self._calls.get(call)
            if future is not None and not future.done():
                future.set_result(result) if ok else future.set_exception(wire.decode_error(*result))
        elif kind == wire.BYE:
            self._bye.set()
            self._end("the engine is shut down", expected=True)

    def _take_state(self, payload: bytes) -> None:
        self._health, self._stats, models, self._failed = wire.decode_state(msgpack.unpackb(payload))
        if models is not None:
            self._models = models
        now = self._reported_at = time.monotonic()
        if self._health.serving:
            self._serving_at = now
        self._changed.set()

    async def _watch(self) -> None:
        """The engine's process exiting ends every stream (there is nobody to finish them)."""
        while self.process is not None:
            code = self.process.exit_code()
            if code is not None:
                await asyncio.sleep(WATCH_PERIOD_S)  # its last frames (why it failed to start) are read first
                self._end(f"the engine process exited with code {code}")
                return
            await asyncio.sleep(WATCH_PERIOD_S)

    def _end(self, why: str, *, expected: bool = False) -> None:
        if self._gone is not None:
            return
        self._gone = why
        if not expected and self._models is not None:
            log.error("%s: %d open stream(s) fail", why, len(self._streams))
        for queue, _ in self._streams.values():
            queue.put_nowait(ReplicaFailedError(why))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(UnavailableError(why))
        self._changed.set()
