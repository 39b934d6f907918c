"""One rank's NIXL agent (UCX backend): its registered cache memory, the peers it READs from, and
the READ itself, over descriptor lists prepared once.

    agent = NixlAgent(host=node_ip)       # once per rank, at start-up
    agent.register(block_tensors)         # the KV caches, once: [num_blocks, ...] each
    desc = agent.describe(frames)         # exporter: what a puller READs frames by (msgpack-able)
    peer = agent.peer(desc)               # importer: the exporter's metadata loaded and its regions'
                                          # descriptor list prepared, once per (agent, generation)
    agent.read(local, ours, peer, theirs, ...)  # one READ into our blocks, polled until done

Regions: every registered tensor is indexed by block along dim 0, so a region is (address, bytes
of one block, number of blocks, device). NIXL's prepared descriptor lists name one descriptor per
block of every region (a strided list: NIXL expands it itself, in no measurable time); a READ is
then two index arrays (our blocks, theirs), which NIXL merges where consecutive. The importer
prepares its own regions' list once (again only when its registration changes) and a peer's list
once per peer generation: the description carries the exporter's agent name and `generation`
(bumped whenever its registered memory changes), so a peer that re-registered or restarted (a
new name) is loaded afresh, and its metadata (about 50 bytes per region) rides along with every
description, so a first contact costs no round trip either.

Progress: on one host UCX READs host memory by CMA (the kernel copies from the exporter's pages;
the exporter does nothing) and VRAM by CUDA IPC, so no progress thread is needed: the importer's
polls progress its READ, and the exporter's export server progresses its agent while a NIXL offer
is pending (every millisecond in a rank's loop), which a new pair of agents needs once, to set up
their connection. NIXL's notifications are not used: a notification sent after a READ made the
next READ on that connection wait for the exporter's next progress (about 1 ms here), so the
importer's notice that it is done goes by zmq (export_server.py). NIXL's progress thread spins (about
half a core per agent when idle, measured on the 2-core CPU machine), so an agent on a loopback
address runs without it. A rank on a routable address may have peers on other hosts, where a
READ over TCP needs the exporter's side to progress: it keeps the thread.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.read_indices import RegionTable
from meshserve.kvtransfer.wire import KVTransferError

log = logging.getLogger("meshserve.kvtransfer")

# The NIXL Python API ships per CUDA major version as its own module; the `nixl` meta package
# adds a `nixl` alias of one of them. meshserve depends on nixl-cu13 (the CUDA of its torch).
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_SPIN_S = 200e-6  # a READ in flight is polled back to back this long (most end within it), then
_POLL_SLEEP_S = (20e-6, 1e-3)  # with sleeps between these (the pull's own thread: the step is not held),
_POLL_FRACTION = 1 / 16  # each this share of the time waited so far: a READ is seen done at most ~6 % late
_CANCEL_BOUND_S = 10.0  # how long a cancelled READ that NIXL could not release is waited for


def poll_pause_s(waited_s: float) -> float:
    """How long a READ's poll sleeps after `waited_s` seconds in flight: not at all for the first
    _SPIN_S (most READs end within it), then a share of the time waited so far, within
    _POLL_SLEEP_S. A fixed doubling step (50 us, 100 us, ... 1 ms, as before) saw a READ of 1-3 ms
    done up to 0.4-0.8 ms late; this sees it at most ~1/16 late (plus the OS's wake-up)."""
    if waited_s <= _SPIN_S:
        return 0.0
    return min(_POLL_SLEEP_S[1], max(_POLL_SLEEP_S[0], waited_s * _POLL_FRACTION))


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


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


def _interface_of(host: str) -> str:
    """The network interface that carries `host` ("lo" for loopback; "" when none does)."""
    if is_loopback(host):
        return "lo"
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == host for a in addresses):
            return name
    return ""


@dataclass(frozen=True)
class Region:
    """A registered block tensor: `num_blocks` blocks of `block_nbytes` from `address`."""

    address: int
    block_nbytes: int
    num_blocks: int
    device: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Region:
        if tensor.dim() < 1 or tensor.shape[0] == 0 or not tensor.is_contiguous():
            raise KVTransferError("nixl", f"a registered region is a contiguous [num_blocks, ...] tensor, not "
                                  f"{tuple(tensor.shape)}")  # fmt: skip
        # stride(0): the bytes of one block of a contiguous tensor, without making a view of it
        block = tensor.stride(0) * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
        return cls(tensor.data_ptr(), block, tensor.shape[0], _device_id(tensor))

    @property
    def nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    def blocks_at(self, start: int, nbytes: int) -> tuple[int, int] | None:
        """(first block, count) when bytes [start, start + nbytes) of this region are whole blocks."""
        if start < 0 or start + nbytes > self.nbytes or start % self.block_nbytes or nbytes % self.block_nbytes:
            return None
        return start // self.block_nbytes, nbytes // self.block_nbytes


def _strided(regions: Sequence[Region]) -> np.ndarray:
    """NIXL's compressed descriptor list: one descriptor per block of every region, in order."""
    return np.array([[r.address, r.block_nbytes, r.device, r.block_nbytes, r.num_blocks] for r in regions],
                    dtype=np.int64).reshape(-1, 5)


def _offsets(regions: Sequence[Region]) -> list[int]:
    """The index of each region's block 0 in a list made by `_strided`."""
    out, n = [], 0
    for r in regions:
        out.append(n)
        n += r.num_blocks
    return out


@dataclass
class Peer:
    """An exporter we READ from: its agent, its regions and their prepared descriptor list."""

    name: str
    generation: int
    regions: tuple[Region, ...]
    offsets: list[int]
    dlist: Any  # NIXL's prepared list handle
    described: list = field(default_factory=list, repr=False)  # the regions as the description listed them

    @functools.cached_property
    def region_table(self) -> RegionTable:
        """The regions as arrays (read_indices.py checks a pull's frames against them), made once."""
        return RegionTable.of(self.offsets, [r.block_nbytes for r in self.regions],
                              [r.num_blocks for r in self.regions])


@dataclass
class LocalList:
    """Our side of READs into some tensors: their prepared list, and where each tensor's block 0
    is in it (by the tensor's Region)."""

    dlist: Any
    offsets: dict[Region, int]
    _by_tensors: dict[int, tuple[tuple[Region, ...], np.ndarray]] = field(default_factory=dict, repr=False)

    def offsets_of(self, regions: tuple[Region, ...]) -> np.ndarray | None:
        """offsets[r] for each of `regions` as an array, or None when one of them is not in this
        list; remembered per tuple (a rank's KVRankIO asks with the same tuple at every pull: its
        regions are not hashed each time)."""
        known = self._by_tensors.get(id(regions))
        if known is None or known[0] is not regions:
            found = [self.offsets.get(r) for r in regions]
            known = (regions, None if None in found else np.array(found, dtype=np.int64))
            if len(self._by_tensors) >= 64:
                self._by_tensors.clear()
            self._by_tensors[id(regions)] = known  # holds the tuple: its id is not reused meanwhile
        return known[1]


class NixlAgent:
    """One rank's NIXL agent (module docstring).

    host: the address the rank's peers reach it at; UCX is kept to the interface that carries it
    (UCX_NET_DEVICES, unless the environment says otherwise: "lo" on loopback) so that its
    listening sockets bind there only. progress_thread: run NIXL's progress thread (None: only
    when `host` is not loopback; the module docstring says why). Calls may come from several
    threads (the export server's loop, background pulls): the agent is thread-safe (NIXL's strict
    sync mode) and our own maps take a lock.
    """

    def __init__(self, name: str | None = None, *, host: str = "127.0.0.1",
                 progress_thread: bool | None = None) -> None:  # fmt: skip
        module = nixl_module()
        if module is None:
            raise KVTransferError("nixl", f"no NIXL build is installed (pip install one of {list(_MODULES[:2])})")
        device = _interface_of(host)
        if device:  # UCX's sockets on the rank's own interface only (a deployment may say otherwise)
            os.environ.setdefault("UCX_NET_DEVICES", device)
        # UCX turns CUDA IPC READs (get zcopy) off unless it sees NVLink, so a READ of VRAM within
        # one GPU or across PCIe went by TCP through host memory: 243 ms for 128 MiB on one H100
        # (0.55 GB/s), 2.5 ms with this on (docs/performance.md, 2026-12-05).
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        self.name = name or f"meshserve-{os.getpid()}-{secrets.token_hex(6)}"
        sync = module.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        progress = not is_loopback(host) if progress_thread is None else progress_thread
        config = module.nixl_agent_config(enable_prog_thread=progress, backends=["UCX"], sync_mode=sync)
        self._agent = module.nixl_agent(self.name, config)
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], tuple[Region, Any]] = {}  # (address, bytes) -> region, reg descs
        self._kind = ""  # DRAM or VRAM: one kind per agent (a rank's caches share a device)
        self._local: LocalList | None = None  # our registered regions' prepared list (made at the first READ)
        self._peers: dict[str, Peer] = {}  # by agent name
        self._metadata: bytes | None = None
        self._by_address: tuple[list[int], list[tuple[int, Region]]] | None = None  # _region_of's index
        self.generation = 0  # bumped whenever the registered memory changes: peers need new metadata

    # -- memory -----------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each block tensor ([num_blocks, ...], contiguous) once; one registered already is skipped."""
        with self._lock:
            for t in tensors:
                key = (t.data_ptr(), t.numel() * t.element_size())
                if key in self._registered or key[1] == 0:
                    continue
                kind = memory_kind(t.device)
                if self._kind and kind != self._kind:
                    raise KVTransferError("nixl", f"{kind} memory beside the agent's {self._kind} memory")
                region = Region.of(t)
                descs = self._agent.register_memory([(region.address, region.nbytes, region.device, "")], kind)
                self._registered[key] = (region, descs)
                self._kind = kind
                self._changed()

    def deregister(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                entry = self._registered.pop((t.data_ptr(), t.numel() * t.element_size()), None)
                if entry is not None:
                    self._agent.deregister_memory(entry[1])
                    self._changed()

    def _changed(self) -> None:
        """(Under the lock) the registered memory changed: new metadata, a new local list."""
        self._metadata = None
        self._by_address = None
        if self._local is not None:
            self._agent.release_dlist_handle(self._local.dlist)
            self._local = None
        self.generation += 1

    def _region_of(self, frame: torch.Tensor) -> list[int] | None:
        """(Under the lock) [region index, first block, count] of `frame` (whole blocks of one
        registered region), or None. The region is found by address (a bisection over the regions
        sorted by address, made once per generation): trying every region with tensor calls cost
        ~15 us a frame with 32 regions, on the prefill side of every hand-over."""
        if self._by_address is None:
            entries = sorted((region.address, i, region) for i, (region, _) in enumerate(self._registered.values()))
            self._by_address = ([a for a, _, _ in entries], [(i, r) for _, i, r in entries])
        starts, entries = self._by_address
        address = frame.data_ptr()
        j = bisect.bisect_right(starts, address) - 1
        if j < 0:
            return None
        i, region = entries[j]
        found = region.blocks_at(address - region.address, frame.numel() * frame.element_size())
        return None if found is None else [i, *found]

    @property
    def metadata(self) -> bytes:
        with self._lock:
            return self._own_metadata()

    def _own_metadata(self) -> bytes:
        """(Under the lock) this agent's metadata, fetched again only after the memory changed."""
        if self._metadata is None:
            self._metadata = self._agent.get_agent_metadata()
        return self._metadata

    def close(self) -> None:
        """Deregister every region and drop the agent (before the registered memory is freed)."""
        with self._lock:
            for peer in self._peers.values():
                self._agent.release_dlist_handle(peer.dlist)
            self._peers.clear()
            if self._local is not None:
                self._agent.release_dlist_handle(self._local.dlist)
                self._local = None
            for _, descs in self._registered.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:  # shutting down: say it, go on
                    log.warning("NIXL: deregistering at close failed: %s", exc)
            self._registered.clear()
            self._agent = None

    # -- exporter ---------------------------------------------------------------------------
    def describe(self, frames: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        """What a puller READs `frames` by (msgpack-able): this agent, its generation, metadata and
        regions, and each frame as [region, first block, count]; None when a frame is not whole
        blocks of registered memory (the exporter then sends the bytes)."""
        with self._lock:
            where = [self._region_of(f) for f in frames]
            if not frames or any(w is None for w in where):
                return None
            metadata = self._own_metadata()
            regions = [[r.address, r.block_nbytes, r.num_blocks, r.device] for r, _ in self._registered.values()]
            return {"agent": self.name, "generation": self.generation, "metadata": metadata, "mem": self._kind,
                    "regions": regions, "frames": where}

    def progress(self) -> None:
        """Progress the agent's UCX worker (an exporter without a progress thread, while an offer
        is pending). NIXL's notifications are not used: an importer's notice goes by zmq."""
        with self._lock:
            self._agent.get_new_notifs()

    # -- importer ---------------------------------------------------------------------------
    def peer(self, desc: dict[str, Any]) -> Peer:
        """The exporter a description names, loaded (its metadata) and its regions' list prepared
        the first time this (agent, generation) is met; KVTransferError on a bad description."""
        with self._lock:  # the common case first: a peer met before, its regions listed as then
            known = self._peers.get(desc.get("agent")) if isinstance(desc, dict) else None
            if (known is not None and desc.get("generation") == known.generation
                    and desc.get("regions") == known.described):  # fmt: skip
                return known
        try:
            name, generation, mem = str(desc["agent"]), int(desc["generation"]), str(desc["mem"])
            regions = tuple(Region(int(a), int(b), int(n), int(d)) for a, b, n, d in desc["regions"])
            metadata = bytes(desc["metadata"])
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError("bad_header", "an undecodable NIXL description") from exc
        if mem not in ("DRAM", "VRAM") or any(min(r.block_nbytes, r.num_blocks) < 1 for r in regions):
            raise KVTransferError("bad_header", f"NIXL memory kind {mem!r} (DRAM or VRAM) or an empty region")
        with self._lock:
            known = self._peers.get(name)
            if known is not None and (known.generation, known.regions) == (generation, regions):
                return known
            try:
                if known is not None:  # it registered other memory since: load it afresh
                    del self._peers[name]
                    self._agent.release_dlist_handle(known.dlist)
                    self._agent.remove_remote_agent(name)
                loaded = self._agent.add_remote_agent(metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded != name:
                    self._agent.remove_remote_agent(loaded)
                    raise KVTransferError("nixl", f"agent metadata names {loaded!r}, the description {name!r}")
                dlist = self._agent.prep_xfer_dlist(name, _strided(regions), mem)
            except KVTransferError:
                raise
            except Exception as exc:  # nixl's binding errors: metadata it cannot load, regions it refuses
                raise KVTransferError("nixl", f"cannot load the NIXL agent {name!r}: {exc}") from exc
            peer = Peer(name, generation, regions, _offsets(regions), dlist, list(desc["regions"]))
            self._peers[name] = peer
            return peer

    def local_list(self) -> LocalList:
        """The prepared list of our registered regions (made at the first READ, again after the
        registered memory changed); `offsets_of` says whether it covers a pull's tensors (a
        re-sharding pull's staging caches are not registered: `temporary`)."""
        with self._lock:
            if self._local is None:
                ours = [r for r, _ in self._registered.values()]
                self._local = LocalList(self._agent.prep_xfer_dlist("", _strided(ours), self._kind or "DRAM"),
                                        dict(zip(ours, _offsets(ours))))
            return self._local

    def temporary(self, tensors: Sequence[torch.Tensor]) -> Temporary:
        """Register `tensors` (block tensors) for one READ and prepare their list (a context
        manager: deregistered after). Peers never READ these: the generation stays."""
        return Temporary(self, tensors)

    def read(self, local: LocalList, ours: np.ndarray, peer: Peer, theirs: np.ndarray, *, deadline: float,
             cancel: threading.Event | None, phases: PullPhases = UNTIMED) -> None:  # fmt: skip
        """READ the peer's descriptors `theirs` into our `ours` (indices into the two prepared
        lists; one transfer), polling until it is done; KVTransferError on failure, timeout or
        cancel, after the READ has stopped."""
        agent = self._agent
        try:
            handle = agent.make_prepped_xfer("READ", local.dlist, ours, peer.dlist, theirs)
        except Exception as exc:  # nixl raises its own errors (bindings): a refused descriptor list
            raise KVTransferError("nixl", f"cannot prepare the READ from {peer.name}: {exc}") from exc
        phases.mark("prep")
        done = False
        try:
            state = agent.transfer(handle)
            phases.mark("post")
            posted = time.monotonic()
            while state == "PROC":
                if cancel is not None and cancel.is_set():
                    raise KVTransferError("cancelled", f"the NIXL READ from {peer.name} was cancelled")
                now = time.monotonic()
                if now > deadline:
                    raise KVTransferError("timeout", f"the NIXL READ from {peer.name} did not finish in time")
                pause = poll_pause_s(now - posted)
                if pause:
                    time.sleep(pause)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError("nixl", f"the NIXL READ from {peer.name} failed ({state})")
            done = True
            phases.mark("wait")
        except KVTransferError:
            raise
        except Exception as exc:  # nixl's binding errors (a peer gone, a stale handle)
            raise KVTransferError("nixl", f"the NIXL READ from {peer.name} failed: {exc}") from exc
        finally:
            self._release(handle, settled=done)
            phases.mark("release")

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


class Temporary:
    """Tensors registered for one READ, with their prepared list (NixlAgent.temporary)."""

    def __init__(self, owner: NixlAgent, tensors: Sequence[torch.Tensor]) -> None:
        self.owner, self.tensors = owner, list({t.data_ptr(): t for t in tensors}.values())
        self._descs: list[Any] = []
        self.list: LocalList | None = None

    def __enter__(self) -> LocalList:
        agent = self.owner._agent
        regions = [Region.of(t) for t in self.tensors]
        try:
            for t, r in zip(self.tensors, regions):
                self._descs.append(agent.register_memory([(r.address, r.nbytes, r.device, "")],
                                                         memory_kind(t.device)))
            kind = memory_kind(self.tensors[0].device) if self.tensors else "DRAM"
            self.list = LocalList(agent.prep_xfer_dlist("", _strided(regions), kind),
                                  dict(zip(regions, _offsets(regions))))
        except Exception:
            self.__exit__()
            raise
        return self.list

    def __exit__(self, *exc: object) -> None:
        agent = self.owner._agent
        if self.list is not None:
            agent.release_dlist_handle(self.list.dlist)
            self.list = None
        for descs in self._descs:
            agent.deregister_memory(descs)
        self._descs = []
