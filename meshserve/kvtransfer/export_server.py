"""KV hand-over over pyzmq, between processes or hosts: the receiver pulls, by capability.

Sender (prefill replica):
    server = KVExportServer(secret)                   # ROUTER socket, tcp://127.0.0.1 random port
    server.offer(export, capability=cap, release=...) # hand (server.address, cap) to the puller
    ... server.poll(timeout_ms) from the owner's own loop: serves pulls, lets go of sent exports
Receiver (decode replica):
    blocks = pull_kv(target, address, cap, secret=secret, timeout_s=30)   # or KVTransferError
target: an ImportTarget (rank_io.py): a KVConnector (driver and rank in one process) or a rank's
`io.into(blocks)` (blocks the driver reserved). cap: an unguessable token (`new_capability`)
that the coordinator hands to the importing replica with the hand-over; an export is never
found by its request id, and a capability is good for one pull.

Messages, each with a last part `tag` (HMAC-SHA256 of the cluster secret, core/secret.py): the
receiver's DEALER sends [msgpack {"op": "pull", "capability": cap}, tag]; the answer is
[b"H", header, tag] (see wire.py) or [b"X", msgpack {"error": reason, "message": text}, tag],
then one message [b"F", bytes, tag] per frame and a last [b"E", b"", tag]. A NIXL or CUDA IPC
puller asks nothing: what it reads the frames by travelled with the endpoint (`describe_direct`,
direct_offer.py); its [msgpack {"op": "done", "capability": cap}, tag of b"kv-done"] afterwards
spends the capability here and lets go of the export, and gets no answer. Answer tags cover
the capability and the message's index, so answers cannot be replayed into another pull or
reordered. A pull whose tag does not verify (a peer without the secret) gets no answer: it is
dropped and counted (`rejected`); a verified pull of an unknown capability gets "unknown_request".
A receiver that meets a bad answer tag refuses the transfer (reason "auth"; the prompt is
recomputed). One message per frame (not one multipart message for all) lets the receiver copy
and check frame i while frame i + 1 is on the wire; the end marker turns a short stream into a
clear "truncated". The header always carries the frames' checksum: an export made without one
(a rank's offer where direct pullers do not verify, KVRankAgent.offer) gets it when its first zmq
pull is answered, computed over the cache's own bytes, which its pin still holds. Frames leave
the sender without a copy (zmq reads the cache memory; the export stays pinned until zmq has let
go of every frame) and, where the receiver's new blocks form one run, go from zmq's buffer
straight into the receiving cache (`recv_into`).

The server is single-threaded on purpose: its owner calls `poll`, on the thread that owns the
exports' pins (the KVCacheManager, when `release` drops a pin there), so nothing needs locks.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import msgpack
import zmq

from meshserve.core.secret import ClusterSecret, RejectedFrames
from meshserve.errors import check
from meshserve.kvtransfer.direct_offer import pack_offer
from meshserve.kvtransfer.nixl_agent import NixlAgent
from meshserve.kvtransfer.pull_client import (  # noqa: F401  (the receiving end, re-exported)
    _ANSWER,
    _DONE,
    _END,
    _ERROR,
    _FRAME,
    _HEADER,
    _PULL,
    MIN_CAPABILITY_CHARS,
    _index,
    pull_kv,
)
from meshserve.kvtransfer.rank_io import KVExport
from meshserve.kvtransfer.wire import KVTransferError

Release = Callable[[KVExport], None]
MAX_PULL_REQUEST_BYTES = 64 << 10  # a pull request's parts (msgpack map, MAC): a few hundred bytes
log = logging.getLogger("meshserve.kvtransfer")


class KVExportServer:
    """Serves offered exports to pulling receivers that hold the cluster `secret`.

    address: a zmq endpoint; "tcp://HOST" without a port binds a random free port. The bound
    endpoint is `self.address`. Bind it where the pullers are (the node IP), not 0.0.0.0.
    """

    def __init__(self, secret: ClusterSecret, *, address: str = "tcp://127.0.0.1",
                 context: zmq.Context | None = None, nixl: NixlAgent | None = None) -> None:  # fmt: skip
        self._secret = secret
        self._nixl = nixl  # describes exports in registered memory for NIXL READs (describe_direct)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # a multipart reply of hundreds of frames never blocks
        self._sock.setsockopt(zmq.LINGER, 0)
        # A pull request is a small msgpack map: a bigger message is dropped by zmq before it is
        # buffered (anyone who reaches the port could otherwise make us allocate what it sends).
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_PULL_REQUEST_BYTES)
        if address.startswith("tcp://") and address.count(":") == 1:
            self._sock.bind_to_random_port(address)
        else:
            self._sock.bind(address)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._offers: dict[str, tuple[KVExport, float, Release | None]] = {}  # by capability
        self.rejected = RejectedFrames(f"KV export server {self.address}")
        self._sending: list[tuple[KVExport, list[zmq.MessageTracker], Release | None]] = []
        self._ipc = None  # cuda_ipc.IpcExporter, made at the first export of CUDA frames (describe_direct)
        self._described: set[str] = set()  # capabilities offered for NIXL READs (describe_direct)

    def offer(self, export: KVExport, *, capability: str, ttl_s: float = 60.0,
              release: Release | None = None) -> str:  # fmt: skip
        """Offer an export for one pull by `capability` within `ttl_s`; returns the address to
        pull from. release(export) is called once zmq has let go of its frames or the offer
        expired (e.g. KVConnector.release, which drops the pin); without it the owner keeps the
        blocks alive. A direct pull (describe_direct) releases at the importer's done notice."""
        check(ttl_s > 0, "ttl_s", ttl_s, "a number of seconds > 0")
        check(isinstance(capability, str) and len(capability) >= MIN_CAPABILITY_CHARS, "capability",
              "<hidden>", f"an unguessable token of at least {MIN_CAPABILITY_CHARS} characters (new_capability())")
        check(capability not in self._offers, "capability", "<hidden>", "a capability not already on offer")
        self._offers[capability] = (export, time.monotonic() + ttl_s, release)
        return self.address

    def describe_direct(self, export: KVExport, capabilities: list[str]) -> bytes:
        """The direct offer of `export` (offered under each of `capabilities`) that travels with
        the endpoint (direct_offer.py): a NIXL description where this server has a NIXL agent and
        every frame is whole blocks of its registered memory, a CUDA IPC one where every frame is
        on CUDA; b"" when neither applies (pullers then take the bytes over zmq). A puller's notice
        that it is done (`send_done`) spends that capability here and lets go of its export; until
        then `poll` progresses the NIXL agent (a first READ from a new peer waits for it)."""
        for cap in capabilities:
            check(cap in self._offers, "capability", "<hidden>", "a capability on offer (offer() first)")
        descriptions = {}
        nixl = None if self._nixl is None else self._nixl.describe(export.frames)
        if nixl is not None:
            descriptions["nixl"] = nixl
            self._described.update(capabilities)
        if export.frames and all(f.device.type == "cuda" for f in export.frames):
            from meshserve.kvtransfer.cuda_ipc import IpcExporter

            if self._ipc is None:
                self._ipc = IpcExporter()
            try:
                descriptions["ipc"] = self._ipc.describe(export.frames)
            except (RuntimeError, KVTransferError) as exc:  # cannot share: IPC pullers take the bytes
                log.warning("KV export server %s: CUDA IPC share failed, IPC pulls get bytes: %s", self.address, exc)
        if not descriptions:
            return b""
        return pack_offer(self._secret, capabilities, export.header_bytes, descriptions)

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
                    parts = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) == 3 and self._secret.verify(parts[2], _PULL, parts[1]):
                    self._answer(parts[0], parts[1])
                    served += 1
                elif len(parts) == 3 and self._secret.verify(parts[2], _DONE, parts[1]):
                    self._done(parts[1])
                else:
                    self.rejected.add("malformed" if len(parts) != 3 else "bad tag")
        self._reap()
        return served

    def _done(self, body: bytes) -> None:
        """A puller's notice that its direct pull of an offer ended: the capability is spent, the
        export let go of."""
        try:
            cap = msgpack.unpackb(body, raw=False)["capability"]
            offer = self._offers.pop(cap, None)
        except (msgpack.UnpackException, KeyError, TypeError, ValueError):
            self.rejected.add("malformed notice")
            return
        self._described.discard(cap)
        if offer is not None:
            _let_go(offer[0], offer[2])

    def _answer(self, ident: bytes, body: bytes) -> None:
        try:
            request = msgpack.unpackb(body, raw=False)
            cap = request["capability"]
            offer = self._offers.pop(cap, None)
        except (msgpack.UnpackException, KeyError, TypeError, ValueError):
            self._send_error(ident, b"", "bad_header", "the pull request is not a msgpack map with a capability")
            return
        cap = str(cap).encode()
        if offer is None:  # the capability is not echoed: the asker knows it
            self._send_error(ident, cap, "unknown_request", f"nothing on offer for that capability at {self.address}")
            return
        export, _, release = offer
        export.ensure_checksum()  # a zmq pull always verifies: computed here, at its first pull, if not at export
        sock, sign = self._sock, self._secret.sign
        sock.send_multipart([ident, _HEADER, export.header_bytes, sign(_ANSWER, cap, _index(0), _HEADER,
                                                                        export.header_bytes)])
        trackers = []
        for i, tensor in enumerate(export.frames, 1):
            host = tensor if tensor.device.type == "cpu" else tensor.cpu()
            data = host.numpy()
            frame = zmq.Frame(data, copy=False, track=True)
            sock.send_multipart([ident, _FRAME, frame, sign(_ANSWER, cap, _index(i), _FRAME, data)], copy=False)
            trackers.append(frame.tracker)
        end = len(export.frames) + 1
        sock.send_multipart([ident, _END, b"", sign(_ANSWER, cap, _index(end), _END, b"")])
        self._sending.append((export, trackers, release))

    def _send_error(self, ident: bytes, cap: bytes, reason: str, message: str) -> None:
        body = msgpack.packb({"error": reason, "message": message})
        self._sock.send_multipart([ident, _ERROR, body, self._secret.sign(_ANSWER, cap, _index(0), _ERROR, body)])

    def _reap(self) -> None:
        if self._described:
            self._progress_nixl()
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

    def _progress_nixl(self) -> None:
        """While NIXL offers are pending, progress our agent: a new peer's first READ waits for
        the two agents' connection set-up, which needs both sides to progress (nixl_agent.py)."""
        self._described &= self._offers.keys()  # spent, pulled over zmq or expired
        if self._described:
            self._nixl.progress()

    def close(self) -> None:
        """Release every export and close the socket."""
        for export, _, release in self._offers.values():
            _let_go(export, release)
        self._offers.clear()
        self._described.clear()
        self._sock.close(linger=0)
        for export, _, release in self._sending:  # zmq dropped the frames with the socket
            _let_go(export, release)
        self._sending.clear()


def _let_go(export: KVExport, release: Release | None) -> None:
    if release is not None:
        release(export)


def new_capability() -> str:
    """An unguessable name for one offer (256 random bits)."""
    return secrets.token_urlsafe(32)
