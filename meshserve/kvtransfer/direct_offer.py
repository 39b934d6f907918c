"""What a pull by NIXL READ or by CUDA IPC needs, sent with the offer: the bytes move with no round
trip to the exporter before them, and one message after them that gets no answer.

    exporter: server.offer(export, capability=key)               # export_server.py, as ever
              blob = server.describe_direct(export, [key, ...])  # b"": nothing to describe
              ... the blob travels with the offer's endpoint (transport.Endpoint.direct_offer) on the
              authenticated control path (kv_offer's answer, the coordinator, kv_pull_start)
    importer: pull_direct(target, endpoint, key, kind, move, ...)  # NixlPuller, CudaIpcPuller

The blob is [header, body, MACs]: the hand-over's header (wire.py); the body, a msgpack map of what
each direct transport reads the frames by — "nixl": the exporter agent's description
(nixl_agent.NixlAgent.describe: name, generation, metadata, regions, each frame as whole blocks of
one region), "ipc": the CUDA IPC handles of the frames' allocations and each frame's byte range
(cuda_ipc.IpcExporter.describe), each present where it applies; and, per capability the export is
offered under, the MAC of the cluster secret over (capability, header, body).

A pull (`pull_direct`) checks the MAC for its capability (a forged or altered offer, or one made
for another capability, is refused: "auth"), spends the capability here (a second pull of it is
refused: "unknown_request"; a re-sharding rank pulls one key from several exporters, so it is
spent per exporter address), checks the header and reserves or takes its blocks
(`target.begin_import`), moves the bytes (the transport's `move`), then tells the exporter by one
MACed zmq message that needs no answer (pull_client.send_done): the export server pops the offer,
so the capability is spent there too, and lets go of the export (or at the offer's TTL, if the
importer died). The notice goes as soon as the bytes have moved, before the import's own finish,
and also when the pull was refused or failed.

Before, a CUDA IPC pull asked the exporter for the handles over zmq (a request, three answers, each
MACed) and waited for the exporter's loop to answer it: a rank serves its export socket between
step-channel messages, every millisecond at best and after a whole step at worst.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.rank_io import ImportSession, ImportTarget
from meshserve.kvtransfer.wire import KVTransferError

_OFFER = b"kv-direct-offer"
KINDS = ("nixl", "ipc")  # the transports a direct offer describes frames for
SPENT_S = 600.0  # how long an importer remembers a spent capability (offers live 30 s at a rank)

Move = Callable[[ImportSession, dict[str, Any]], None]


@dataclass(frozen=True)
class DirectOffer:
    """An opened direct offer: the header, and per transport kind its description of the frames."""

    header: bytes
    descriptions: dict[str, dict[str, Any]]


def pack_offer(secret: ClusterSecret, capabilities: Sequence[str], header: bytes,
               descriptions: dict[str, dict[str, Any]]) -> bytes:  # fmt: skip
    """The direct offer of one export under each of `capabilities` (module docstring)."""
    body = msgpack.packb(descriptions, use_bin_type=True)
    macs = [secret.sign(_OFFER, cap.encode(), header, body) for cap in capabilities]
    return msgpack.packb([header, body, macs], use_bin_type=True)


def open_offer(secret: ClusterSecret, capability: str, blob: bytes) -> DirectOffer:
    """The offer whose MAC for `capability` verifies; else KVTransferError ("auth", "bad_header")."""
    try:
        header, body, macs = msgpack.unpackb(blob, raw=False)
        header, body = bytes(header), bytes(body)
        want = secret.sign(_OFFER, capability.encode(), header, body)
        ok = any(hmac.compare_digest(want, bytes(m)) for m in macs)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise KVTransferError("bad_header", "an undecodable direct offer") from exc
    if not ok:
        raise KVTransferError("auth", "the direct offer fails authentication for this capability")
    try:
        descriptions = msgpack.unpackb(body, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise KVTransferError("bad_header", "an undecodable direct offer body") from exc
    if not isinstance(descriptions, dict) or not all(
            k in KINDS and isinstance(v, dict) for k, v in descriptions.items()):  # fmt: skip
        raise KVTransferError("bad_header", f"a direct offer describes frames per transport, one map each of {KINDS}")
    return DirectOffer(header, descriptions)


class SpentCapabilities:
    """The capabilities this importer pulled, per exporter address (one use, as at the exporter)."""

    def __init__(self) -> None:
        self._spent: dict[tuple[str, str], float] = {}  # (exporter, capability) -> when pulled (monotonic)
        self._lock = threading.Lock()

    def spend(self, address: str, capability: str) -> None:
        """Mark `capability` of the exporter at `address` used; KVTransferError if it was already."""
        now = time.monotonic()
        with self._lock:
            if len(self._spent) > 1024:
                self._spent = {k: t for k, t in self._spent.items() if now - t < SPENT_S}
            if (address, capability) in self._spent:
                raise KVTransferError("unknown_request", "that capability was used already")
            self._spent[address, capability] = now


def pull_direct(target: ImportTarget, endpoint: Any, capability: str, kind: str, move: Move, *,
                secret: ClusterSecret, spent: SpentCapabilities, sockets: Any,
                phases: PullPhases = UNTIMED) -> bool:  # fmt: skip
    """Pull the export offered under `capability` by `move(session, description)` (the module
    docstring's steps). False, with nothing done, when the endpoint's offer has no description of
    kind `kind` (the caller pulls the bytes over zmq); KVTransferError when refused or failed,
    after the target let go of its blocks and the exporter was told."""
    from meshserve.kvtransfer.pull_client import send_done

    if not endpoint.direct_offer:
        return False
    offer = open_offer(secret, capability, endpoint.direct_offer)
    description = offer.descriptions.get(kind)
    if description is None:
        return False
    spent.spend(endpoint.address, capability)
    phases.mark("offer")
    told = False
    try:
        with target.begin_import(offer.header) as session:
            phases.mark("header")
            move(session, description)
            send_done(endpoint.address, capability, secret=secret, sockets=sockets)
            told = True
            phases.mark("notify")
            session.finish()
            phases.mark("finish")
    finally:
        if not told:  # refused or failed before or while the bytes moved: the exporter lets go now
            send_done(endpoint.address, capability, secret=secret, sockets=sockets)
    return True
