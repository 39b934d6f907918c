"""The engine process's end of the front-end channel (cluster/service_wire.py): a Coordinator
served to the API front-ends of other processes.

Requests come in as OPEN frames and are admitted with `Coordinator.open_stream`, their deltas
going to a sink of this endpoint instead of a per-stream queue: no task and no async generator
per stream here. What the replicas deliver during one pass of the event loop (a step's deltas
for every stream) leaves in one BATCH frame per front-end at the end of it. A stream that ends
(its last delta, or an error) is closed here; a CANCEL closes it early, which aborts the request
and frees its KV blocks at once.

Health, stats and models (the state) ride on every BATCH, as of its deltas: a front-end with
streams in a step has the stats of that step (/metrics, ServerInfo), as vLLM's engine core sends
its scheduler stats with each step's outputs. The others get the state in a STATE frame when a
stream started or ended in that pass (so a request is counted by whichever process a client asks
once it has seen the request start or end), and every front-end gets one every STATE_PERIOD_S.
The snapshot is taken once a pass whatever the number of front-ends (bench/state_push.py).

    endpoint = ServiceEndpoint(coordinator, "ipc:///run/x/engine.sock", key)
    await endpoint.run(start=True)     # until a front-end sends SHUTDOWN (or stop() is called)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgpack
import zmq
import zmq.asyncio

from meshserve.cluster import service_wire as wire
from meshserve.core import hop_trace
from meshserve.core.secret import RejectedFrames
from meshserve.core.tasks import cancel_and_wait
from meshserve.errors import UnavailableError

log = logging.getLogger("meshserve.endpoint")
HELLO_GRACE_S = 0.2


class _Sink:
    """Where one stream's deltas go (Ticket.sink): into its front-end's next BATCH."""

    __slots__ = ("endpoint", "route", "number", "request_id", "stream", "done", "started")

    def __init__(self, endpoint: ServiceEndpoint, route: bytes, number: int) -> None:
        self.endpoint, self.route, self.number = endpoint, route, number
        self.request_id = ""  # the service's id, once decoded (the key of its trace marks)
        self.stream = None  # the coordinator's OpenStream, once admitted
        self.done = False
        self.started = False

    def put_nowait(self, item) -> None:
        if self.done:  # cancelled by its reader: what still comes (its ABORT delta) has nobody to go to
            return
        if not self.started:  # its first delta: every front-end's stats should show it running
            self.started = True
            self.endpoint._streams_changed = True
            if hop_trace.enabled() and not isinstance(item, BaseException) and item.token_ids:
                self.endpoint._first_tokens.append(self.request_id)  # the key of this pass's engine.batch
        if isinstance(item, BaseException):
            self.endpoint._emit(self.route, [self.number, None, *wire.encode_error(item)])
            self.endpoint._close(self, finished=True)
        else:
            self.endpoint._emit(self.route, wire.encode_delta(self.number, item))
            if item.finished:
                self.endpoint._close(self, finished=True)


class ServiceEndpoint:
    """Serves `service` (a Coordinator: open_stream/close_stream, abort, health, stats, models) on
    `address` to front-ends that sign with `key`."""

    def __init__(self, service, address: str, key: wire.ChannelKey, *,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.service = service
        self.address = address
        self.key = key
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a front-end's deltas
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        self._sock.bind(address)
        self._peers: dict[bytes, int] = {}  # route -> last seq taken from it
        self._seq = 0
        self._streams: dict[tuple[bytes, int], _Sink] = {}
        self._outbox: dict[bytes, list] = {}
        self._first_tokens: list[str] = []  # traced (core/hop_trace.py): requests whose first token this pass sends
        self._stop = asyncio.Event()
        self._failed: str | None = None
        self._models = None  # the service's models once it serves (they do not change after)
        self._streams_changed = False  # a stream started or ended in this pass
        self._flush_scheduled = False
        self.rejected = RejectedFrames(f"front-end channel {address}")

    # -- running -------------------------------------------------------------------------------
    async def run(self, *, start: bool = True) -> None:
        """Serve until SHUTDOWN or stop(); with start, start the service first (its failure is
        reported to the front-ends, then raised)."""
        reader = asyncio.create_task(self._read())
        state = asyncio.create_task(self._push_state())
        try:
            if start:
                starting = asyncio.create_task(self.service.start())
                stopping = asyncio.create_task(self._stop.wait())
                await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not starting.done():  # stopped while loading
                    await cancel_and_wait(starting)
                    return
                if (exc := starting.exception()) is not None:
                    self._failed = f"{type(exc).__name__}: {exc}"
                    # A start may block the loop (Ray's init runs on it): let the reader take the
                    # HELLOs that waited meanwhile (it answers them with this state), then tell all.
                    await asyncio.sleep(HELLO_GRACE_S)
                    self._send_state_to_all()
                    raise exc
                self._send_state_to_all()  # readiness flips now, not at the next period
            await self._stop.wait()
        finally:
            await cancel_and_wait(state, reader)

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Tell the front-ends the service is gone and close the socket."""
        for route in self._peers:
            self._send(route, wire.BYE, b"")
        await asyncio.sleep(0)
        self._sock.close(linger=200)

    # -- sending -------------------------------------------------------------------------------
    def _send(self, route: bytes, kind: bytes, payload: bytes) -> None:
        self._seq += 1
        seq = wire.seq_bytes(self._seq)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([route, kind, seq, payload, self.key.sign(wire.TO_FRONTEND, kind, seq, payload)])

    def _emit(self, route: bytes, item: list) -> None:
        """Queue an item for its front-end's BATCH, sent when this pass of the event loop ends."""
        box = self._outbox.get(route)
        if box is None:
            self._schedule_flush()
            box = self._outbox[route] = []
        box.append(item)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """The pass's deltas, one BATCH per front-end that has some, each carrying the state as of
        them (one snapshot); the other front-ends get it in a STATE when a stream started or ended
        in this pass, so that whichever process a client asks counts that stream."""
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        try:
            state = self._state()
        except Exception:  # the deltas go out all the same; the period's STATE tries again
            log.exception("engine state snapshot failed")
            state = None
        firsts = self._first_tokens  # (filled only while tracing)
        if firsts:
            self._first_tokens = []
        hop_trace.mark("engine.batch", *firsts)  # (before the sends: the front-end may well run first)
        for route, items in outbox.items():
            self._send(route, wire.BATCH, msgpack.packb([items, state]))
        if self._streams_changed and state is not None:
            self._streams_changed = False
            for route in self._peers:
                if route not in outbox:
                    self._send(route, wire.STATE, state)

    def _state(self) -> bytes:
        models = self._models
        if models is None:
            try:
                models = self._models = self.service.models()
            except UnavailableError:
                pass
        return msgpack.packb(wire.encode_state(self.service.health(), self.service.stats(), models, self._failed))

    def _send_state_to_all(self) -> None:
        if self._peers:
            payload = self._state()
            for route in self._peers:
                self._send(route, wire.STATE, payload)

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(wire.STATE_PERIOD_S)
            try:
                self._send_state_to_all()
            except Exception:  # a snapshot that fails once must not end the reports
                log.exception("engine state report failed")

    # -- receiving -----------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) != 5:
                self.rejected.add("malformed")
                continue
            route, kind, seq, payload, tag = parts
            n = wire.seq_of(seq)
            if n is None or not self.key.verify(tag, wire.TO_ENGINE, kind, seq, payload):
                self.rejected.add("bad tag")
                continue
            last = self._peers.get(route)
            if kind == wire.HELLO and last is None:
                self._peers[route] = n
                self._send(route, wire.STATE, self._state())
                continue
            if last is None or n <= last:
                self.rejected.add("unknown peer" if last is None else f"replayed seq {n}")
                continue
            self._peers[route] = n
            try:
                self._handle(route, kind, payload)
            except Exception:
                log.exception("front-end message %r failed", kind)

    def _handle(self, route: bytes, kind: bytes, payload: bytes) -> None:
        if kind == wire.OPEN:
            self._open(route, msgpack.unpackb(payload))
        elif kind == wire.CANCEL:
            for number in msgpack.unpackb(payload):
                sink = self._streams.get((route, number))
                if sink is not None:
                    self._close(sink, finished=False)
        elif kind == wire.CALL:
            call, method, args = msgpack.unpackb(payload)
            asyncio.get_running_loop().create_task(self._call(route, call, method, args))
        elif kind == wire.SHUTDOWN:
            self._stop.set()
        else:
            self.rejected.add(f"unknown kind {kind!r}")

    def _open(self, route: bytes, msg: list) -> None:
        number = msg[0]
        sink = _Sink(self, route, number)
        try:
            _, prompt, params, beam, request_id, caller, priority = wire.decode_open(msg)
            sink.request_id = request_id
            hop_trace.mark("engine.open_received", request_id)
            self._streams[(route, number)] = sink
            sink.stream = self.service.open_stream(prompt, params, request_id=request_id, sink=sink, beam=beam,
                                                   caller=caller, priority=priority)
            hop_trace.mark("engine.admitted", request_id)
        except Exception as exc:  # a refusal: nothing was queued
            self._streams.pop((route, number), None)
            sink.done = True
            self._emit(route, [number, None, *wire.encode_error(exc)])

    def _close(self, sink: _Sink, *, finished: bool) -> None:
        sink.done = True
        self._streams_changed = True
        self._schedule_flush()
        self._streams.pop((sink.route, sink.number), None)
        if sink.stream is not None:
            self.service.close_stream(sink.stream, finished=finished)

    async def _call(self, route: bytes, call: int, method: str, args: list) -> None:
        try:
            if method != "abort":
                raise UnavailableError(f"unknown engine call {method!r}")
            reply = [call, True, await self.service.abort(*args)]
        except Exception as exc:
            reply = [call, False, wire.encode_error(exc)]
        self._send(route, wire.RET, msgpack.packb(reply))
