"""KV by NIXL: the decode rank READs the prefill rank's cache blocks straight out of its registered
memory (DRAM or VRAM), one READ per pull, with no round trip to the exporter before it.

    exporter: server.offer(export, capability=key)             # the zmq export server, as ever
              blob = server.describe_nixl(export, [key, ...])  # the NIXL offer (b"": cannot describe)
              ... the blob travels with the offer's endpoint (transport.Endpoint.nixl_offer) on
              the authenticated control path (kv_offer's answer, the coordinator, kv_pull_start)
    importer: NixlPuller(agent).pull(target, endpoint, key, ...)  (transport.py's KVPuller)

The NIXL offer is [header, description, MACs]: the hand-over's header (wire.py), the exporter
agent's description (nixl_agent.NixlAgent.describe: its name, generation, metadata, regions, and
each frame as whole blocks of one region) and, per capability it is offered under, the MAC of the
cluster secret over (capability, header, description). The importer checks the MAC for its
capability (a forged or altered offer, or one made for another capability, is refused: "auth"),
spends the capability (a second pull of it is refused: "unknown_request"), checks the header and
reserves or takes its blocks (`target.begin_import`), loads the exporter's agent and prepares its
regions' descriptor list (once per agent generation: nixl_agent.py), and posts one READ of the
frames' blocks into its own, polled until done, cancelled or past the deadline; a cancelled or
timed-out READ is released (NIXL cancels it) and, if it cannot be, waited for before the
session frees its blocks, so no late write lands in a block that was given back. It then tells
the exporter, by a MACed zmq message that needs no answer (pull_client.send_done): the export
server pops that offer, so the capability is spent there too, and lets go of the export (or at
the offer's TTL, if the importer died). An importer without NIXL, or an offer without a NIXL part (frames
outside registered memory), pulls the bytes over zmq (export_server.py) by the same capability.

Integrity: the header and description are authenticated (MAC of the cluster secret); the bytes
themselves move over UCX (CMA on one host; TCP or RDMA between hosts; CUDA IPC or GPUDirect for
VRAM), unauthenticated and unencrypted. The frames' checksum is checked only when asked
(`NixlPuller(verify=True)`): as with CUDA IPC, the transport's own integrity is relied on
(docs/cluster.md, "KV transports").

Security note: a peer holding an agent's metadata can READ any memory that agent registered (the
KV caches) without a capability: NIXL has no per-transfer authorisation. The capability gates the
descriptions only; the network between the ranks must be isolated (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.nixl_agent import (  # noqa: F401  (nixl_available, nixl_module: re-exported)
    LocalList,
    NixlAgent,
    Peer,
    Region,
    nixl_available,
    nixl_module,
)
from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.wire import KVTransferError

_OFFER = b"kv-nixl-offer"
SPENT_S = 600.0  # how long an importer remembers a spent capability (offers live 30 s at a rank)


def pack_offer(secret: ClusterSecret, capabilities: Sequence[str], header: bytes, desc: dict[str, Any]) -> bytes:
    """The NIXL offer of one export under each of `capabilities` (module docstring)."""
    body = msgpack.packb(desc, use_bin_type=True)
    macs = [secret.sign(_OFFER, cap.encode(), header, body) for cap in capabilities]
    return msgpack.packb([header, body, macs], use_bin_type=True)


def open_offer(secret: ClusterSecret, capability: str, blob: bytes) -> tuple[bytes, dict[str, Any]]:
    """(header, description) of a NIXL offer whose MAC for `capability` verifies; else KVTransferError."""
    try:
        header, body, macs = msgpack.unpackb(blob, raw=False)
        header, body = bytes(header), bytes(body)
        want = secret.sign(_OFFER, capability.encode(), header, body)
        ok = any(hmac.compare_digest(want, bytes(m)) for m in macs)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise KVTransferError("bad_header", "an undecodable NIXL offer") from exc
    if not ok:
        raise KVTransferError("auth", "the NIXL offer fails authentication for this capability")
    try:
        desc = msgpack.unpackb(body, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise KVTransferError("bad_header", "an undecodable NIXL description") from exc
    if not isinstance(desc, dict):
        raise KVTransferError("bad_header", "the NIXL description is not a map")
    return header, desc


class NixlPuller:
    """Pulls by NIXL READ (transport.py's KVPuller) when the endpoint carries a NIXL offer, else
    the bytes over zmq (the pull then reports "zmq").

    agent: this rank's NixlAgent (made at the first pull when None). verify: check the frames'
    checksum after the READ (off by default; the module docstring says why)."""

    name = "nixl"

    def __init__(self, agent: NixlAgent | None = None, *, verify: bool = False) -> None:
        from meshserve.kvtransfer.pull_sockets import PullSockets

        self.agent = agent
        self.verify = verify
        self.sockets = PullSockets()  # connected sockets kept per exporter for a zmq pull
        self._spent: dict[tuple[str, str], float] = {}  # (exporter, capability) -> when pulled (monotonic)
        self._lock = threading.Lock()

    def pull(self, target, endpoint, capability: str, *, secret: ClusterSecret, timeout_s: float,
             cancel: threading.Event | None = None, phases: PullPhases = UNTIMED) -> str:  # fmt: skip
        from meshserve.kvtransfer.pull_client import pull_kv, send_done

        if not endpoint.nixl_offer:
            pull_kv(target, endpoint.address, capability, secret=secret, timeout_s=timeout_s, cancel=cancel,
                    sockets=self.sockets)
            return "zmq"
        deadline = time.monotonic() + timeout_s
        header, desc = open_offer(secret, capability, endpoint.nixl_offer)
        self._spend(endpoint.address, capability)
        phases.mark("offer")
        with self._lock:
            if self.agent is None:
                self.agent = NixlAgent()
        done = False  # the exporter was told (as soon as the READ has ended, before our checks)
        try:
            peer = self.agent.peer(desc)
            phases.mark("peer")
            with target.begin_import(header) as session:
                phases.mark("header")
                self._read(session, desc, peer, deadline, cancel, phases)
                send_done(endpoint.address, capability, secret=secret, sockets=self.sockets)
                phases.mark("notify")
                done = True
                session.finish()
                phases.mark("finish")
        finally:
            if not done:  # refused or failed before or during the READ: the exporter lets go now
                send_done(endpoint.address, capability, secret=secret, sockets=self.sockets)
        return self.name

    def _spend(self, address: str, capability: str) -> None:
        """Mark `capability` of the exporter at `address` used (a re-sharding rank pulls one key
        from several exporters); KVTransferError if it was already (one use, as at the exporter)."""
        now = time.monotonic()
        with self._lock:
            if len(self._spent) > 1024:
                self._spent = {k: t for k, t in self._spent.items() if now - t < SPENT_S}
            if (address, capability) in self._spent:
                raise KVTransferError("unknown_request", "that capability was used already")
            self._spent[address, capability] = now

    def _read(self, session, desc: dict[str, Any], peer: Peer, deadline: float,
              cancel: threading.Event | None, phases: PullPhases) -> None:  # fmt: skip
        """READ the described frames into the session's blocks and accept them (ImportSession)."""
        frames = desc.get("frames")
        if not isinstance(frames, list) or len(frames) != session.num_frames:
            raise KVTransferError("bad_header", "the NIXL description does not list the header's frames")
        tensors = [session.cache_of(i) for i in range(session.num_frames)]
        mine = {id(t): Region.of(t) for t in tensors}  # one per cache tensor (a frame per run of blocks of each)
        regions = [mine[id(t)] for t in tensors]
        local = self.agent.local_list(list(mine.values()))
        with contextlib.nullcontext(local) if local is not None else self.agent.temporary(tensors) as local:
            ours, theirs = _indices(session, frames, regions, local, peer)
            if not self.verify:
                session.trust_frames()
            phases.mark("indices")
            self.agent.read(local, ours, peer, theirs, deadline=deadline, cancel=cancel, phases=phases)
        session.accept_written()
        phases.mark("accept")


def _indices(session, frames: list, regions: list[Region], local: LocalList,
             peer: Peer) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Our and the peer's descriptor indices of every block the frames move, in the same order
    (regions: our Region of each frame's cache tensor)."""
    ours, theirs = [], []
    for i, frame in enumerate(frames):
        try:
            region, first, count = (int(v) for v in frame)
            r = peer.regions[region] if 0 <= region else None
        except (TypeError, ValueError, IndexError) as exc:
            raise KVTransferError("bad_header", f"NIXL frame {i}: not [region, first block, count]") from exc
        mine = regions[i]
        if (r is None or first < 0 or count < 1 or first + count > r.num_blocks
                or r.block_nbytes != mine.block_nbytes or count * r.block_nbytes != session.frame_nbytes[i]):
            raise KVTransferError("bad_header", f"NIXL frame {i} does not match the header's frame or its region")
        offset = local.offsets[mine]
        ours += [offset + b for b in session.frame_blocks(i)]
        start = peer.offsets[region] + first
        theirs.append(np.arange(start, start + count, dtype=np.int32))
    return np.array(ours, dtype=np.int32), np.concatenate(theirs)
