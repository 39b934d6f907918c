"""KV by NIXL: the decode rank READs the prefill rank's cache blocks straight out of its
registered memory (DRAM or VRAM), one READ per pull, polled without blocking the step.

    agent = NixlAgent(name, host=bind_host)     # once per rank, at start-up
    agent.register(cache_tensors)               # the KV caches, once
    exporter: KVExportServer(secret, nixl=agent) answers a pull that asks for NIXL with a
              description of the export's frames (agent_descriptor) instead of their bytes
    importer: NixlPuller().pull(target, endpoint, capability, ...)  (transport.py)

The control plane stays the HMAC-tagged zmq export protocol (export_server.py): the pull names
the capability (one use, popped at the first pull), the answer carries the header, then one
[b"N", msgpack description, tag] and [b"E", b"", tag]. The description holds the exporter's agent
name, its agent metadata (only when the puller does not know that agent yet: sent once per pair
of agents), the memory kind, one (address, bytes, device) per frame, and a one-use `notify`
token. The importer splits every frame into runs of consecutive destination blocks
(ImportSession.frame_runs), builds the local and remote descriptor lists block-run by block-run
(no staging copy where our blocks are contiguous or not), posts one READ and polls it until done,
cancelled or past the deadline; a cancelled or timed-out READ is released (NIXL cancels it) and,
if it cannot be, waited for before the session frees its blocks, so no late write lands in a
block that was given back. It then sends the exporter a NIXL notification with the token: the
exporter lets go of the export then (or when the offer's TTL passes, if the importer died).

Integrity: the header and the description are authenticated (MAC of the cluster secret); the
bytes themselves move over UCX (shared memory on one host; TCP or RDMA between hosts, CUDA IPC or
GPUDirect for VRAM), unauthenticated and unencrypted. The frames' checksum is checked only when
asked (`NixlPuller(verify=True)`): as with CUDA IPC, the transport's own integrity is relied on
(docs/cluster.md, "KV transports").

Security note: a peer holding an agent's metadata can READ any memory that agent registered (the
KV caches) without a capability: NIXL has no per-transfer authorisation. The capability gates the
descriptions only; the network between the ranks must be isolated (docs/cluster.md).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from meshserve.kvtransfer.wire import KVTransferError

log = logging.getLogger("meshserve.kvtransfer")

# The NIXL Python API ships per CUDA major version as its own module; the `nixl` meta package
# adds a `nixl` alias of one of them. meshserve depends on nixl-cu13 (the CUDA of its torch).
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_POLL_SLEEP_S = 50e-6  # between polls of a READ in flight (the pull's own thread; the step is not held)
_CANCEL_BOUND_S = 10.0  # how long a cancelled READ that NIXL could not release is waited for


@functools.cache
def nixl_module() -> Any | None:
    """The NIXL Python API module, or None when no build of it is installed."""
    # NIXL logs every agent's start at INFO on stdout; quiet unless meshserve's own log tells the whole story.
    if os.environ.get("MESHSERVE_LOG", "").lower() != "debug":
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    return None


def nixl_available() -> bool:
    return nixl_module() is not None


def memory_kind(device: torch.device) -> str:
    """NIXL's memory segment for tensors on `device`."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def _device_id(tensor: torch.Tensor) -> int:
    return tensor.device.index or 0 if tensor.device.type == "cuda" else 0


def _interface_of(host: str) -> str:
    """The network interface that carries `host` ("lo" for loopback; "" when none does)."""
    if host.startswith("127.") or host in ("localhost", "::1"):
        return "lo"
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == host for a in addresses):
            return name
    return ""


class NixlAgent:
    """One rank's NIXL agent (UCX backend): its registered memory and the peers it knows.

    host: the address the rank's peers reach it at; UCX is kept to the interface that carries it
    (UCX_NET_DEVICES, unless the environment says otherwise: "lo" on loopback) so that its
    listening sockets bind there only. Calls may come from several threads (the export server's loop, background
    pulls): the agent is made thread-safe (NIXL's strict sync mode) and our own maps take a lock.
    """

    def __init__(self, name: str | None = None, *, host: str = "127.0.0.1") -> None:
        module = nixl_module()
        if module is None:
            raise KVTransferError("nixl", f"no NIXL build is installed (pip install one of {list(_MODULES[:2])})")
        device = _interface_of(host)
        if device:  # UCX's sockets on the rank's own interface only (a deployment may say otherwise)
            os.environ.setdefault("UCX_NET_DEVICES", device)
        self.name = name or f"meshserve-{os.getpid()}-{secrets.token_hex(6)}"
        sync = module.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        self._agent = module.nixl_agent(self.name, module.nixl_agent_config(backends=["UCX"], sync_mode=sync))
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], tuple[str, Any]] = {}  # (address, bytes) -> (kind, reg descs)
        self._peers: dict[str, bytes] = {}  # remote agent -> the metadata we loaded of it
        self._notified: set[bytes] = set()
        self._metadata: bytes | None = None
        self.generation = 0  # bumped whenever the registered memory changes: peers need new metadata

    # -- memory -----------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each (contiguous) tensor's memory once; a tensor registered already is skipped."""
        with self._lock:
            for t in tensors:
                key = (t.data_ptr(), t.numel() * t.element_size())
                if key in self._registered or key[1] == 0:
                    continue
                kind = memory_kind(t.device)
                descs = self._agent.register_memory([(key[0], key[1], _device_id(t), "")], kind)
                self._registered[key] = (kind, descs)
                self._metadata = None  # peers need the new regions
                self.generation += 1

    def deregister(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                entry = self._registered.pop((t.data_ptr(), t.numel() * t.element_size()), None)
                if entry is not None:
                    self._agent.deregister_memory(entry[1])
                    self._metadata = None
                    self.generation += 1

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie inside one registered region."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(a <= start and end <= a + n for a, n in self._registered)

    @property
    def metadata(self) -> bytes:
        with self._lock:
            if self._metadata is None:
                self._metadata = self._agent.get_agent_metadata()
            return self._metadata

    def close(self) -> None:
        """Deregister every region and drop the agent (before the registered memory is freed)."""
        with self._lock:
            for _, descs in self._registered.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:  # shutting down: say it, go on
                    log.warning("NIXL: deregistering at close failed: %s", exc)
            self._registered.clear()
            self._peers.clear()
            self._agent = None

    # -- exporter ---------------------------------------------------------------------------
    @property
    def identity(self) -> str:
        """This agent and its registrations as a puller names them: `name/generation`."""
        return f"{self.name}/{self.generation}"

    def describe(self, frames: Sequence[torch.Tensor], *, known: str) -> dict[str, Any] | None:
        """The description a puller READs `frames` by (msgpack-able), or None when a frame is
        outside the registered memory (the exporter then sends the bytes). known: the identity
        the puller holds metadata of ("" for none); the metadata goes along unless it is ours."""
        if not frames or not all(self.covers(f) for f in frames):
            return None
        identity = self.identity
        return {"agent": self.name, "identity": identity, "metadata": b"" if known == identity else self.metadata,
                "mem": memory_kind(frames[0].device), "notify": secrets.token_bytes(16),
                "descs": [[f.data_ptr(), f.numel() * f.element_size(), _device_id(f)] for f in frames]}

    def notified(self, token: bytes) -> bool:
        """Whether a puller sent `token` (it finished or gave up its READ); each token counts once."""
        with self._lock:
            for msgs in self._agent.get_new_notifs().values():
                self._notified.update(msgs)
            if token in self._notified:
                self._notified.discard(token)
                return True
        return False

    # -- importer ---------------------------------------------------------------------------
    def knows(self, agent: str) -> bool:
        with self._lock:
            return agent in self._peers

    def add_peer(self, agent: str, metadata: bytes) -> None:
        with self._lock:
            if metadata and self._peers.get(agent) != metadata:  # concurrent pulls may bring it twice
                if agent in self._peers:  # it registered more memory since: replace its metadata
                    self._agent.remove_remote_agent(agent)
                    del self._peers[agent]
                name = self._agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else str(name)
                if name != agent:
                    raise KVTransferError("nixl", f"agent metadata names {name!r}, the description {agent!r}")
                self._peers[agent] = metadata
            elif agent not in self._peers:
                raise KVTransferError("nixl", f"no metadata for the unknown NIXL agent {agent!r}")

    def forget_peer(self, agent: str) -> None:
        """Drop a peer (its metadata was stale: it re-registered, or restarted)."""
        with self._lock:
            if agent in self._peers:
                del self._peers[agent]
                self._agent.remove_remote_agent(agent)

    def read(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], *, local_mem: str,
             remote_mem: str, peer: str, deadline: float, cancel: threading.Event | None,
             notify: bytes) -> None:  # fmt: skip
        """READ remote[i] into local[i] for every i (one transfer), polling until it is done;
        KVTransferError on failure, timeout or cancel, after the READ has stopped."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, local_mem),
                                           agent.get_xfer_descs(remote, remote_mem), peer)
        except Exception as exc:  # nixl raises its own errors (bindings): a refused descriptor list
            self._notify(peer, notify)
            raise KVTransferError("nixl", f"cannot prepare the READ from {peer}: {exc}") from exc
        done = False
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                if cancel is not None and cancel.is_set():
                    raise KVTransferError("cancelled", f"the NIXL READ from {peer} was cancelled")
                if time.monotonic() > deadline:
                    raise KVTransferError("timeout", f"the NIXL READ from {peer} did not finish in time")
                time.sleep(_POLL_SLEEP_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError("nixl", f"the NIXL READ from {peer} failed ({state})")
            done = True
        except KVTransferError:
            raise
        except Exception as exc:  # nixl's binding errors (a peer gone, a stale handle)
            raise KVTransferError("nixl", f"the NIXL READ from {peer} failed: {exc}") from exc
        finally:
            self._release(handle, settled=done)
            self._notify(peer, notify)

    def _release(self, handle: Any, *, settled: bool) -> None:
        """Release a transfer handle; one still in flight is cancelled, or waited for (bounded)."""
        give_up = time.monotonic() + _CANCEL_BOUND_S
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as exc:  # still in flight and not cancellable yet
                if settled or time.monotonic() > give_up:
                    log.error("NIXL: a transfer handle could not be released: %s", exc)
                    return
                time.sleep(1e-3)

    def _notify(self, peer: str, token: bytes) -> None:
        try:
            self._agent.send_notif(peer, token)
        except Exception as exc:  # the exporter then lets go at the offer's TTL
            log.warning("NIXL: cannot notify %s that a READ ended: %s", peer, exc)


class NixlRead:
    """A NIXL answer in the export server's sending list: done once the puller notified the
    token, or the offer's TTL passed (a puller that died never notifies)."""

    def __init__(self, agent: NixlAgent, token: bytes, ttl_s: float) -> None:
        self.agent, self.token, self.deadline = agent, token, time.monotonic() + ttl_s

    @property
    def done(self) -> bool:
        return self.agent.notified(self.token) or time.monotonic() > self.deadline


def _block_nbytes(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


class NixlPuller:
    """Pulls by NIXL READ (transport.py's KVPuller): the zmq control exchange asks for a
    description instead of bytes; an exporter without NIXL (or whose frames are not registered
    memory) answers with the bytes, and the pull reports "zmq".

    agent: this rank's NixlAgent (made at the first pull when None). verify: check the frames'
    checksum after the READ (off by default; the module docstring says why)."""

    name = "nixl"

    def __init__(self, agent: NixlAgent | None = None, *, verify: bool = False) -> None:
        from meshserve.kvtransfer.pull_sockets import PullSockets

        self.agent = agent
        self.verify = verify
        self.sockets = PullSockets()  # connected sockets kept per exporter for its next pull
        self._agents: dict[str, str] = {}  # export address -> the identity of the NIXL agent behind it
        self._lock = threading.Lock()

    def pull(self, target, endpoint, capability: str, *, secret, timeout_s: float,
             cancel: threading.Event | None = None) -> str | None:  # fmt: skip
        from meshserve.kvtransfer.pull_client import pull_kv

        with self._lock:
            if self.agent is None:
                self.agent = NixlAgent()
        reader = _Reader(self, endpoint.address)
        pull_kv(target, endpoint.address, capability, secret=secret, timeout_s=timeout_s, cancel=cancel,
                nixl=reader, sockets=self.sockets)
        return self.name if reader.used else "zmq"


    def known_agent(self, address: str) -> str:
        """The identity (NixlAgent.identity) we hold metadata of for the exporter at `address`."""
        identity = self._agents.get(address, "")
        return identity if identity and self.agent.knows(identity.rpartition("/")[0]) else ""

    def remember(self, address: str, identity: str) -> None:
        self._agents[address] = identity


class _Reader:
    """One pull's NIXL side: which agent it knows behind the address, and the READ itself."""

    def __init__(self, puller: NixlPuller, address: str) -> None:
        self.puller, self.address, self.used = puller, address, False

    @property
    def known_agent(self) -> str:
        """The identity (NixlAgent.identity) we hold metadata of for this exporter ("" for none)."""
        return self.puller.known_agent(self.address)

    def read_into(self, session, desc: dict[str, Any], *, deadline: float, cancel: threading.Event | None) -> None:
        """READ the described frames into the session's blocks and accept them (ImportSession)."""
        agent = self.puller.agent
        try:
            mem, peer, notify = str(desc["mem"]), str(desc["agent"]), bytes(desc["notify"])
            remote_frames = [(int(a), int(n), int(d)) for a, n, d in desc["descs"]]
            metadata = bytes(desc.get("metadata") or b"")
            identity = str(desc["identity"])
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError("bad_header", f"an undecodable NIXL description from {self.address}") from exc
        if mem not in ("DRAM", "VRAM"):
            raise KVTransferError("bad_header", f"NIXL memory kind {mem!r}: DRAM or VRAM")
        sizes = [n for _, n, _ in remote_frames]
        if sizes != list(session.frame_nbytes):
            raise KVTransferError("bad_header", f"NIXL descriptors of {len(sizes)} frames do not match the header's")
        if metadata or not agent.knows(peer):
            agent.add_peer(peer, metadata)
        self.puller.remember(self.address, identity)
        local, remote = [], []
        for i, (address, _, device) in enumerate(remote_frames):
            cache = session.cache_of(i)
            block = _block_nbytes(cache)
            for offset, first, count in session.frame_runs(i):
                local.append((cache.data_ptr() + first * block, count * block, _device_id(cache)))
                remote.append((address + offset * block, count * block, device))
        ours = list({id(t): t for t in (session.cache_of(i) for i in range(session.num_frames))}.values())
        temporary = [t for t in ours if not agent.covers(t)]  # staging caches of a re-sharding pull
        agent.register(temporary)
        try:
            if not self.puller.verify:
                session.trust_frames()
            agent.read(local, remote, local_mem=memory_kind(session.io.device), remote_mem=mem, peer=peer,
                       deadline=deadline, cancel=cancel, notify=notify)
        finally:
            agent.deregister(temporary)
        self.used = True
        session.accept_written()
