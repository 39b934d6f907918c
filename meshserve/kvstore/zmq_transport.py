"""KV hand-over over pyzmq, between processes or hosts: the receiver pulls.

Sender (prefill replica):
    server = KVExportServer()                         # ROUTER socket, tcp://127.0.0.1 random port
    server.offer(export, release=...)                 # hand (server.address, id) out
    ... server.poll(timeout_ms) from the owner's own loop: serves pulls, lets go of sent exports
Receiver (decode replica):
    blocks = pull_kv(target, address, request_id, timeout_s=30)   # or KVTransferError
target: an ImportTarget (rank_io.py): a KVConnector (driver and rank in one process) or a rank's
`io.into(blocks)` (blocks the driver reserved).

Messages: the receiver's DEALER sends msgpack {"op": "pull", "request_id": id}; the answer is
[b"H", header] (see wire.py) or [b"X", msgpack {"error": reason, "message": text}], then one
message [b"F", bytes] per frame and a last [b"E"]. One message per frame (not one multipart
message for all) lets the receiver copy and check frame i while frame i + 1 is on the wire; the
end marker turns a short stream into a clear "truncated". Frames leave the sender without a copy
(zmq reads the cache memory; the export stays pinned until zmq has let go of every frame) and,
where the receiver's new blocks form one run, go from zmq's buffer straight into the receiving
cache (`recv_into`).

The server is single-threaded on purpose: its owner calls `poll`, on the thread that owns the
exports' pins (the KVCacheManager, when `release` drops a pin there), so nothing needs locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import zmq

from meshserve.errors import check
from meshserve.kvstore.rank_io import ImportSession, ImportTarget, KVExport
from meshserve.kvstore.wire import KVTransferError

Release = Callable[[KVExport], None]


class KVExportServer:
    """Serves offered exports to pulling receivers.

    address: a zmq endpoint; "tcp://HOST" without a port binds a random free port. The bound
    endpoint is `self.address`.
    """

    def __init__(self, *, address: str = "tcp://127.0.0.1", context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # a multipart reply of hundreds of frames never blocks
        self._sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://") and address.count(":") == 1:
            self._sock.bind_to_random_port(address)
        else:
            self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._offers: dict[str | int, tuple[KVExport, float, Release | None]] = {}
        self._sending: list[tuple[KVExport, list[zmq.MessageTracker], Release | None]] = []

    def offer(self, export: KVExport, *, ttl_s: float = 60.0, release: Release | None = None) -> str:
        """Offer an export for one pull within `ttl_s`; returns the address to pull from.
        release(export) is called once zmq has let go of its frames or the offer expired (e.g.
        KVConnector.release, which drops the pin); without it the owner keeps the blocks alive."""
        check(ttl_s > 0, "ttl_s", ttl_s, "a number of seconds > 0")
        rid = export.header.request_id
        check(rid not in self._offers, "request_id", rid, "an id not already on offer")
        self._offers[rid] = (export, time.monotonic() + ttl_s, release)
        return self.address

    @property
    def num_pending(self) -> int:
        """Exports still pinned: offered and not pulled, or being sent."""
        return len(self._offers) + len(self._sending)

    def poll(self, timeout_ms: int = 0) -> int:
        """Serve the pulls that arrived (waiting up to timeout_ms for one); release exports that are
        sent or expired. Returns the number of pulls answered."""
        served = 0
        if self._sock.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    ident, body = self._sock.recv_multipart(zmq.NOBLOCK)[:2]
                except (zmq.Again, ValueError):
                    break
                self._answer(ident, body)
                served += 1
        self._reap()
        return served

    def _answer(self, ident: bytes, body: bytes) -> None:
        try:
            req = msgpack.unpackb(body, raw=False)
            rid = req["request_id"]
            offer = self._offers.pop(rid, None)
        except (msgpack.UnpackException, KeyError, TypeError, ValueError):
            self._send_error(ident, "bad_header", "the pull request is not a msgpack map with a request_id")
            return
        if offer is None:
            self._send_error(ident, "unknown_request", f"request {rid!r} is not on offer at {self.address}")
            return
        export, _, release = offer
        sock = self._sock
        sock.send_multipart([ident, _HEADER, export.header_bytes])
        trackers = []
        for tensor in export.frames:
            host = tensor if tensor.device.type == "cpu" else tensor.cpu()
            frame = zmq.Frame(host.numpy(), copy=False, track=True)
            sock.send_multipart([ident, _FRAME, frame], copy=False)
            trackers.append(frame.tracker)
        sock.send_multipart([ident, _END])
        self._sending.append((export, trackers, release))

    def _send_error(self, ident: bytes, reason: str, message: str) -> None:
        self._sock.send_multipart([ident, _ERROR, msgpack.packb({"error": reason, "message": message})])

    def _reap(self) -> None:
        still = []
        for export, trackers, release in self._sending:
            if all(t.done for t in trackers):
                _let_go(export, release)
            else:
                still.append((export, trackers, release))
        self._sending = still
        now = time.monotonic()
        for rid, (export, deadline, release) in list(self._offers.items()):
            if now > deadline:
                del self._offers[rid]
                _let_go(export, release)

    def close(self) -> None:
        """Release every export and close the socket."""
        for export, _, release in self._offers.values():
            _let_go(export, release)
        self._offers.clear()
        self._sock.close(linger=0)
        for export, _, release in self._sending:  # zmq dropped the frames with the socket
            _let_go(export, release)
        self._sending.clear()


def _let_go(export: KVExport, release: Release | None) -> None:
    if release is not None:
        release(export)


def pull_kv(
    target: ImportTarget,
    address: str,
    request_id: str | int,
    *,
    timeout_s: float = 30.0,
    context: zmq.Context | None = None,
) -> tuple[list[int], ...]:
    """Pull a request's KV from a KVExportServer into `target`'s blocks.

    Returns the blocks, per group (with a KVConnector the request now holds them in its
    manager); raises KVTransferError when refused, after the target let go of its blocks.
    """
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    deadline = time.monotonic() + timeout_s
    try:
        sock.send(msgpack.packb({"op": "pull", "request_id": request_id}))
        tag = _next_tag(sock, deadline, address, request_id)
        if tag == _ERROR:
            _raise_error(sock.recv())
        if tag != _HEADER or not sock.getsockopt(zmq.RCVMORE):
            raise KVTransferError("bad_header", f"the answer starts with {tag!r}, not a header")
        with target.begin_import(sock.recv()) as session:
            for i in range(session.num_frames):
                tag = _next_tag(sock, deadline, address, request_id)
                if tag != _FRAME or not sock.getsockopt(zmq.RCVMORE):
                    raise KVTransferError("truncated", f"{i} of {session.num_frames} frames arrived")
                _receive_frame(sock, session, i)
            if _next_tag(sock, deadline, address, request_id) != _END:
                raise KVTransferError("truncated", f"more frames than the {session.num_frames} listed")
            return session.finish()
    finally:
        sock.close(linger=0)


_HEADER, _ERROR, _FRAME, _END = b"H", b"X", b"F", b"E"


def _next_tag(sock: zmq.Socket, deadline: float, address: str, request_id: str | int) -> bytes:
    """The tag part of the next message, waiting until the deadline at most."""
    if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
        raise KVTransferError("timeout", f"no complete answer from {address} for {request_id!r} in time")
    return sock.recv()


def _receive_frame(sock: zmq.Socket, session: ImportSession, index: int) -> None:
    dst = session.destination(index)
    expected = session.frame_nbytes[index]
    if dst is not None and dst.device.type == "cpu":
        nbytes = sock.recv_into(dst.numpy())
        if nbytes != expected:
            session.abort()
            raise KVTransferError("truncated", f"frame {index} has {nbytes} bytes, expected {expected}")
        session.accept(index)
    else:
        session.accept(index, sock.recv(copy=False).buffer)


def _raise_error(body: bytes) -> None:
    try:
        obj = msgpack.unpackb(body, raw=False)
        reason, message = obj["error"], str(obj.get("message", ""))
    except (msgpack.UnpackException, ValueError, KeyError, TypeError):
        raise KVTransferError("bad_header", "the sender answered with an undecodable error") from None
    raise KVTransferError(reason if reason in KVTransferError.REASONS else "bad_header", message)
