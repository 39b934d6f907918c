"""KV by NIXL: the decode rank READs the prefill rank's cache blocks straight out of its registered
memory (DRAM or VRAM), one READ per pull, with no round trip to the exporter before it.

    exporter: server.offer(export, capability=key)               # the zmq export server, as ever
              blob = server.describe_direct(export, [key, ...])  # the direct offer (direct_offer.py)
              ... the blob travels with the offer's endpoint (transport.Endpoint.direct_offer)
    importer: NixlPuller(agent).pull(target, endpoint, key, ...)  (transport.py's KVPuller)

The direct offer's "nixl" part is the exporter agent's description (nixl_agent.NixlAgent.describe:
its name, generation, metadata, regions, and each frame as whole blocks of one region). The pull
(direct_offer.pull_direct: MAC, one-use capability, header check and blocks, the done notice)
loads the exporter's agent and its regions' prepared descriptor list (once per agent generation:
nixl_agent.py), checks the description's frames and computes the two index arrays of every block
they move (read_indices.py: array passes, no Python per frame or per block), and posts one READ,
polled until done, cancelled or past the deadline; a cancelled or timed-out READ is released
(NIXL cancels it) and, if it cannot be, waited for before the session frees its blocks, so no
late write lands in a block that was given back. An importer
without NIXL, or an offer without a NIXL part (frames outside registered memory), pulls the
bytes over zmq (export_server.py) by the same capability.

Integrity: the header and description are authenticated (MAC of the cluster secret); the bytes
themselves move over UCX (CMA on one host; TCP or RDMA between hosts; CUDA IPC or GPUDirect for
VRAM), unauthenticated and unencrypted. The frames' checksum is checked only when asked
(`NixlPuller(verify=True)`, a deployment's `kv_verify_checksum`, under which exporters put it in
their direct offers; a verifying pull of a header without one is refused, "checksum"): as with
CUDA IPC, the transport's own integrity is relied on (docs/cluster.md, "KV transports").

Security note: a peer holding an agent's metadata can READ any memory that agent registered (the
KV caches) without a capability: NIXL has no per-transfer authorisation. The capability gates the
descriptions only; the network between the ranks must be isolated (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.direct_offer import SpentCapabilities, pull_direct
from meshserve.kvtransfer.nixl_agent import (  # noqa: F401  (nixl_available, nixl_module: re-exported)
    LocalList,
    NixlAgent,
    Peer,
    nixl_available,
    nixl_module,
)
from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.read_indices import read_indices
from meshserve.kvtransfer.wire import KVTransferError


class NixlPuller:
    """Pulls by NIXL READ (transport.py's KVPuller) when the endpoint's direct offer describes the
    frames for NIXL, else the bytes over zmq (the pull then reports "zmq").

    agent: this rank's NixlAgent (made at the first pull when None). verify: check the frames'
    checksum after the READ (off by default; the module docstring says why)."""

    name = "nixl"

    def __init__(self, agent: NixlAgent | None = None, *, verify: bool = False) -> None:
        from meshserve.kvtransfer.pull_sockets import PullSockets

        self.agent = agent
        self.verify = verify
        self.sockets = PullSockets()  # connected sockets kept per exporter: zmq pulls and done notices
        self.spent = SpentCapabilities()
        self._lock = threading.Lock()

    def pull(self, target, endpoint, capability: str, *, secret: ClusterSecret, timeout_s: float,
             cancel: threading.Event | None = None, phases: PullPhases = UNTIMED) -> str:  # fmt: skip
        from meshserve.kvtransfer.pull_client import pull_kv

        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self.agent is None and endpoint.direct_offer:
                self.agent = NixlAgent()

        def move(session, desc: dict[str, Any]) -> None:
            self._read(session, desc, deadline, cancel, phases)

        if pull_direct(target, endpoint, capability, "nixl", move, secret=secret, spent=self.spent,
                       sockets=self.sockets, phases=phases):  # fmt: skip
            return self.name
        pull_kv(target, endpoint.address, capability, secret=secret, timeout_s=timeout_s, cancel=cancel,
                sockets=self.sockets, phases=phases)
        return "zmq"

    def _read(self, session, desc: dict[str, Any], deadline: float, cancel: threading.Event | None,
              phases: PullPhases) -> None:  # fmt: skip
        """READ the described frames into the session's blocks and accept them (ImportSession)."""
        peer = self.agent.peer(desc)
        phases.mark("peer")
        frames = desc.get("frames")
        if not isinstance(frames, list) or len(frames) != session.num_frames:
            raise KVTransferError("bad_header", "the NIXL description does not list the header's frames")
        regions = session.io.regions  # our Region of each cache tensor, made once per KVRankIO
        local = self.agent.local_list()
        covered = local.offsets_of(regions) is not None
        with contextlib.nullcontext(local) if covered else self.agent.temporary(
                [c.data for c in session.io.caches]) as local:  # fmt: skip
            ours, theirs = _indices(session, frames, local.offsets_of(regions), peer)
            if not self.verify:
                session.trust_frames()
            session.check_checksum_present()
            phases.mark("indices")
            self.agent.read(local, ours, peer, theirs, deadline=deadline, cancel=cancel, phases=phases)
        session.accept_written()
        phases.mark("accept")


def _indices(session, frames: list, layer_offsets: np.ndarray, peer: Peer) -> tuple[np.ndarray, np.ndarray]:
    """Our and the peer's descriptor indices of every block the frames move, in the same order.
    frames: the description's [region, first block, count] per frame; layer_offsets: where each of
    our cache tensors' block 0 is in our prepared list. Checked and built in array passes
    (read_indices.py): no Python per frame or per block."""
    return read_indices(session.frame_table, frames, session.flat_blocks, layer_offsets,
                        session.io.block_nbytes_array, peer.region_table)
