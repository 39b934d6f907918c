"""The receiving end of the zmq KV export protocol (export_server.py describes the messages):
`pull_kv`, and the message tags both ends use."""

from __future__ import annotations

import struct
import threading
import time

import msgpack
import zmq

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.pull_sockets import PullSockets
from meshserve.kvtransfer.rank_io import ImportSession, ImportTarget
from meshserve.kvtransfer.wire import KVTransferError


def pull_kv(
    target: ImportTarget,
    address: str,
    capability: str,
    *,
    secret: ClusterSecret,
    timeout_s: float = 30.0,
    context: zmq.Context | None = None,
    cancel: threading.Event | None = None,
    sockets: PullSockets | None = None,
    phases: PullPhases = UNTIMED,
) -> tuple[list[int], ...]:
    """Pull the export offered under `capability` from a KVExportServer into `target`'s blocks.

    Returns the blocks, per group (with a KVConnector the request now holds them in its
    manager); raises KVTransferError when refused, after the target let go of its blocks.
    cancel: once set, the pull stops at its next wait (KVTransferError "cancelled").
    sockets: take the socket from (and give it back to) this pool of connected sockets
    (pull_sockets.py) instead of connecting one for this pull only.
    phases: marks the end of each step (pull_phases.py).
    """
    if sockets is None:
        sockets = PullSockets(context, max_idle=0)  # nothing kept: the socket closes after this pull
    sock = sockets.take(address)
    complete = False  # every message of the answer was read: the socket may serve another pull
    deadline = time.monotonic() + timeout_s
    answers = _Answers(sock, secret, capability, deadline, address, cancel)
    try:
        body = msgpack.packb({"op": "pull", "capability": capability})
        sock.send_multipart([body, secret.sign(_PULL, body)])
        tag = answers.next_tag()
        phases.mark("request")
        if tag == _ERROR:
            _raise_error(answers.part(tag))
        if tag != _HEADER:
            raise KVTransferError("bad_header", f"the answer starts with {tag!r}, not a header")
        with target.begin_import(answers.part(tag)) as session:
            session.check_checksum_present()  # a zmq pull always verifies: the exporter's answer carries one
            phases.mark("header")
            tag = answers.next_tag() if session.num_frames else _END
            for i in range(session.num_frames):
                tag = tag if i == 0 else answers.next_tag()
                if tag != _FRAME:
                    raise KVTransferError("truncated", f"{i} of {session.num_frames} frames arrived")
                _receive_frame(answers, session, i)
            tag = answers.next_tag() if session.num_frames else tag
            if tag != _END:
                raise KVTransferError("truncated", f"more frames than the {session.num_frames} listed")
            answers.part(tag)
            complete = True
            phases.mark("frames")
            blocks = session.finish()
            phases.mark("finish")
            return blocks
    finally:
        if complete:
            sockets.give_back(address, sock)
        else:
            sock.close(linger=0)


def send_done(address: str, capability: str, *, secret: ClusterSecret, sockets: PullSockets) -> None:
    """Tell the export server at `address` that this pull of `capability`, made without asking it
    (a NIXL READ, a CUDA IPC copy: direct_offer.py), has ended: it spends the capability and lets
    go of the export. Nothing is answered; the message leaves from zmq's I/O thread, on the pool's
    notice socket for that exporter, which still delivers it if the pool is closed at once
    (PullSockets.notify). Not queued (the exporter is gone or not reading): it lets go at the
    offer's TTL."""
    body = msgpack.packb({"op": "done", "capability": capability})
    sockets.notify(address, [body, secret.sign(_DONE, body)])


MIN_CAPABILITY_CHARS = 16
_HEADER, _ERROR, _FRAME, _END = b"H", b"X", b"F", b"E"
_CANCEL_POLL_MS = 50  # how often a waiting pull looks at its cancel event
_PULL, _ANSWER, _DONE = b"kv-pull", b"kv-answer", b"kv-done"


def _index(i: int) -> bytes:
    return struct.pack("<Q", i)


class _Answers:
    """The receiver's view of one pull's answers: each message's tag, payload and MAC, in order."""

    def __init__(self, sock: zmq.Socket, secret: ClusterSecret, capability: str, deadline: float,
                 address: str, cancel: threading.Event | None = None) -> None:  # fmt: skip
        self.sock, self.secret, self.cap = sock, secret, capability.encode()
        self.deadline, self.address, self.cancel = deadline, address, cancel
        self.index = 0

    def next_tag(self) -> bytes:
        """The tag part of the next message, waiting until the deadline at most."""
        while True:
            left_ms = max(0, int((self.deadline - time.monotonic()) * 1000))
            wait_ms = left_ms if self.cancel is None else min(left_ms, _CANCEL_POLL_MS)
            if self.sock.poll(wait_ms, zmq.POLLIN):
                break
            if self.cancel is not None and self.cancel.is_set():
                raise KVTransferError("cancelled", f"the pull from {self.address} was cancelled")
            if wait_ms >= left_ms:
                raise KVTransferError("timeout", f"no complete answer from {self.address} in time")
        tag = self.sock.recv()
        if not self.sock.getsockopt(zmq.RCVMORE):
            raise KVTransferError("bad_header", f"a {tag!r} message without its payload and MAC")
        return tag

    def verify(self, tag: bytes, payload) -> None:
        """Check the message's MAC (its last part) over `payload`; refuse the transfer if wrong."""
        mac = self.sock.recv() if self.sock.getsockopt(zmq.RCVMORE) else b""
        ok = self.secret.verify(mac, _ANSWER, self.cap, _index(self.index), tag, payload)
        self.index += 1
        if not ok:
            raise KVTransferError("auth", f"answer {self.index - 1} from {self.address} fails authentication")

    def part(self, tag: bytes) -> bytes:
        """The payload of a message whose tag was read, verified."""
        payload = self.sock.recv()
        self.verify(tag, payload)
        return payload


def _receive_frame(answers: _Answers, session: ImportSession, index: int) -> None:
    sock = answers.sock
    dst = session.destination(index)
    expected = session.frame_nbytes[index]
    try:
        if dst is not None and dst.device.type == "cpu":
            view = dst.numpy()
            nbytes = sock.recv_into(view)
            if nbytes != expected:
                raise KVTransferError("truncated", f"frame {index} has {nbytes} bytes, expected {expected}")
            answers.verify(_FRAME, view)
            session.accept(index)
        else:
            data = sock.recv(copy=False).buffer
            answers.verify(_FRAME, data)
            session.accept(index, data)
    except KVTransferError:
        session.abort()
        raise


def _raise_error(body: bytes) -> None:
    try:
        obj = msgpack.unpackb(body, raw=False)
        reason, message = obj["error"], str(obj.get("message", ""))
    except (msgpack.UnpackException, ValueError, KeyError, TypeError):
        raise KVTransferError("bad_header", "the sender answered with an undecodable error") from None
    raise KVTransferError(reason if reason in KVTransferError.REASONS else "bad_header", message)
