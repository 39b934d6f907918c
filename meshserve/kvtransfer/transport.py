"""Which transport moves a request's KV from a prefill rank to a decode rank, and the pullers.

    endpoint = Endpoint.local(address, device)          # the exporting rank describes itself (kv_offer)
    name = choose_transport(requested, mine, endpoint)   # the importing rank decides, per hand-over
    puller_for(name).pull(target, endpoint, capability, secret=..., timeout_s=..., cancel=...)

Transports (`--kv-transport`, CacheConfig.kv_transport, config.KVTransport):
  nixl      a NIXL READ (nixl_transport.py) of the exporter's registered cache memory, DRAM or
            VRAM, on one host or between hosts (UCX: CMA, TCP, RDMA, CUDA IPC); what the READ
            needs (header, descriptors, MACed per capability) travels with the offer's endpoint
            (`direct_offer`, direct_offer.py), so the importer READs with no round trip first.
  zmq       pyzmq over TCP (export_server.py): any two ends; host-staged when the caches are on a
            GPU. The only one between CPU caches, and the fallback.
  cuda_ipc  CUDA IPC (cuda_ipc.py): both ends CUDA, on one host, in two processes (same or another
            GPU), the exporter's GPU visible to the importer (not so for Ray actors, which each
            see only their own GPU). The importer maps the exporter's cache memory and copies
            device to device into its own blocks; the handles travel with the offer's endpoint
            (`direct_offer`, msgpack, MACed per capability), never pickle: no round trip first.
  auto      cuda_ipc where it applies (two CUDA processes of one host that see the exporter's GPU),
            else nixl where both ends have a NIXL agent (the `nixl-cu13` package imports), else zmq
            (the default). cuda_ipc first because it measured faster on one GPU (H100, two
            processes, Llama-3-8B KV, 2026-12-05: 1.35 / 2.91 / 6.41 ms per pull of 1k / 8k / 32k
            tokens, against NIXL's 2.54 / 5.18 ms at 1k / 8k; docs/performance.md); NIXL
            carries every other pair: DRAM caches, and GPUs on different hosts or in Ray actors
            that each see only their own GPU.
  "pkg.module:Class"  a puller of the caller's (tests, benches, a third-party transport): a class
            built without arguments with this module's `pull` signature.

A request whose transfer fails (a refused or failed cuda_ipc open included) is recomputed; a
host where a cuda_ipc open failed is pulled from over zmq afterwards (`CudaIpcPuller`).
"""

from __future__ import annotations

import functools
import importlib
import os
import socket
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from meshserve.config import KVTransport, check_kv_transport
from meshserve.core.secret import ClusterSecret
from meshserve.errors import ConfigError
from meshserve.kvtransfer.cuda_ipc import PROCESS_TOKEN, gpu_uuid
from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.rank_io import ImportTarget

AUTO, ZMQ, CUDA_IPC, NIXL = (t.value for t in (KVTransport.AUTO, KVTransport.ZMQ, KVTransport.CUDA_IPC,
                                               KVTransport.NIXL))


@functools.cache
def host_identity() -> str:
    """This machine as CUDA IPC sees it: host name and boot id (two containers of one pod share both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Endpoint:
    """What an exporting rank says about itself with its offer (msgpack-able via to_wire)."""

    address: str  # its KVExportServer
    host: str  # host_identity()
    device: str  # the caches' device type: "cuda" or "cpu"
    process: str  # PROCESS_TOKEN of its process
    gpu: str = ""  # the UUID of the caches' GPU (cuda_ipc.gpu_uuid)
    nixl: bool = False  # it has a NIXL agent (its caches are registered with it)
    # this offer for a NIXL READ or a CUDA IPC copy (direct_offer.py), or b""
    direct_offer: bytes = field(default=b"", repr=False)

    @classmethod
    def local(cls, address: str, device: torch.device, *, nixl: bool = False, direct_offer: bytes = b"") -> Endpoint:
        return cls(address, host_identity(), device.type, PROCESS_TOKEN, gpu_uuid(device), nixl, direct_offer)

    def to_wire(self) -> dict[str, str | bool | bytes]:
        wire = {"address": self.address, "host": self.host, "device": self.device, "process": self.process,
                "gpu": self.gpu, "nixl": self.nixl}
        return {**wire, "direct_offer": self.direct_offer} if self.direct_offer else wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any] | str) -> Endpoint:
        if isinstance(obj, str):  # an address alone: a peer that only speaks zmq
            return cls(obj, "", "cpu", "")
        offer = obj.get("direct_offer") or b""
        return cls(str(obj["address"]), str(obj["host"]), str(obj["device"]), str(obj["process"]),
                   str(obj.get("gpu", "")), obj.get("nixl") is True, offer if isinstance(offer, bytes) else b"")


def cuda_ipc_possible(mine: Endpoint, theirs: Endpoint, visible_gpus: Collection[str]) -> str | None:
    """Why CUDA IPC cannot join the two ends, or None when it can. visible_gpus: the UUIDs of the
    GPUs the importer's process sees (cuda_ipc.local_gpus)."""
    if (mine.device, theirs.device) != ("cuda", "cuda"):
        return f"caches on {theirs.device} (exporter) and {mine.device} (importer), CUDA IPC needs both on CUDA"
    if mine.host != theirs.host or not mine.host:
        return "the two ends are on different hosts"
    if mine.process == theirs.process:
        return "both ends are in one process (CUDA IPC handles cannot be opened by their own process)"
    if theirs.gpu not in visible_gpus:
        return "the exporter's GPU is not visible to the importer (CUDA_VISIBLE_DEVICES, e.g. per Ray actor)"
    return None


def choose_transport(requested: str, mine: Endpoint, theirs: Endpoint, *,
                     visible_gpus: Collection[str] = ()) -> tuple[str, str]:  # fmt: skip
    """(transport, why) for one hand-over: `requested` as configured; auto takes cuda_ipc where it
    joins the ends, else nixl where both ends have it, else zmq; nixl and cuda_ipc fall back to
    zmq where they cannot join the ends (why says the reason)."""
    if requested in (AUTO, CUDA_IPC):
        why = cuda_ipc_possible(mine, theirs, visible_gpus)
        if why is None:
            return CUDA_IPC, ""
        if requested == CUDA_IPC:
            return ZMQ, why
    if requested in (AUTO, NIXL) and mine.nixl and theirs.nixl:
        return NIXL, ""
    if requested == NIXL:
        return ZMQ, f"NIXL at the exporter: {theirs.nixl}, at the importer: {mine.nixl} (both need a NIXL agent)"
    if requested != AUTO:
        return requested, ""
    return ZMQ, why


class KVPuller(Protocol):
    """Pulls one offer into an import target (rank_io.ImportTarget); KVTransferError if refused.
    cancel: set when the pull should stop early (abort, shutdown); the pull then raises. Returns
    the transport that moved the bytes (None: the puller's name)."""

    name: str

    def pull(self, target: ImportTarget, endpoint: Endpoint, capability: str, *, secret: ClusterSecret,
             timeout_s: float, cancel: threading.Event | None = None) -> str | None: ...  # fmt: skip


class ZmqPuller:
    name = ZMQ

    def __init__(self) -> None:
        from meshserve.kvtransfer.pull_sockets import PullSockets

        self.sockets = PullSockets()  # connected sockets kept per exporter for its next pull

    def pull(self, target: ImportTarget, endpoint: Endpoint, capability: str, *, secret: ClusterSecret,
             timeout_s: float, cancel: threading.Event | None = None,
             phases: PullPhases = UNTIMED) -> str | None:  # fmt: skip
        from meshserve.kvtransfer.export_server import pull_kv

        pull_kv(target, endpoint.address, capability, secret=secret, timeout_s=timeout_s, cancel=cancel,
                sockets=self.sockets, phases=phases)
        return ZMQ


class CudaIpcPuller:
    """Copies by CUDA IPC (cuda_ipc.py) what the endpoint's direct offer describes (direct_offer.py:
    no round trip to the exporter first); the bytes over zmq where the offer has no IPC part (the
    exporter could not share its frames). verify: checksum the copied bytes (off by default: they
    never leave device memory)."""

    name = CUDA_IPC

    def __init__(self, *, verify: bool = False) -> None:
        from meshserve.kvtransfer.cuda_ipc import IpcImporter
        from meshserve.kvtransfer.direct_offer import SpentCapabilities
        from meshserve.kvtransfer.pull_sockets import PullSockets

        self.importer = IpcImporter(verify=verify)
        self.sockets = PullSockets()  # connected sockets kept per exporter: zmq pulls and done notices
        self.spent = SpentCapabilities()

    def pull(self, target: ImportTarget, endpoint: Endpoint, capability: str, *, secret: ClusterSecret,
             timeout_s: float, cancel: threading.Event | None = None,
             phases: PullPhases = UNTIMED) -> str | None:  # fmt: skip
        from meshserve.kvtransfer.direct_offer import pull_direct
        from meshserve.kvtransfer.export_server import pull_kv

        def move(session, desc: dict[str, Any]) -> None:
            self.importer.copy_into(session, desc, phases=phases)

        if pull_direct(target, endpoint, capability, "ipc", move, secret=secret, spent=self.spent,
                       sockets=self.sockets, phases=phases):  # fmt: skip
            return CUDA_IPC
        pull_kv(target, endpoint.address, capability, secret=secret, timeout_s=timeout_s, cancel=cancel,
                sockets=self.sockets, phases=phases)
        return ZMQ


def puller_for(name: str, *, nixl_agent: Any = None, verify: bool = False) -> KVPuller:
    """A fresh puller of transport `name` (a built-in name or "module:Class"); a nixl puller
    reads with `nixl_agent` (the rank's NixlAgent; one of its own when None). verify: the direct
    pullers (nixl, cuda_ipc) check the frames' checksum (CacheConfig.kv_verify_checksum); zmq
    always does; a puller of one's own is built without arguments."""
    if name == NIXL:
        from meshserve.kvtransfer.nixl_transport import NixlPuller

        return NixlPuller(nixl_agent, verify=verify)
    if name == CUDA_IPC:
        return CudaIpcPuller(verify=verify)
    if name == ZMQ:
        return ZmqPuller()
    module, _, cls = check_kv_transport(name).partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise ConfigError("kv_transport", name, f"a loadable puller class (cannot load it: {exc})") from exc


def describe_setting(requested: str, device: str, *, one_host: bool, shared_gpus: bool = False,
                     nixl: bool | None = None) -> str:
    """The transport hand-overs will use, as far as the configuration tells (the start-up log and
    the meshserve_kv_transport_info metric): the actual choice is made per hand-over (choose_transport,
    whose order this follows). one_host: the ends are processes of one host that see each other's
    GPUs; shared_gpus: Ray ranks that reserve a fraction of a GPU, so that two ends may share one
    (then each sees the other's); nixl: whether NIXL is installed (None: look)."""
    from meshserve.kvtransfer.nixl_agent import nixl_available

    if requested in (AUTO, CUDA_IPC) and device == "cuda" and one_host:
        return CUDA_IPC
    if requested in (AUTO, NIXL) and (nixl_available() if nixl is None else nixl):
        return f"{CUDA_IPC}|{NIXL}" if requested == AUTO and device == "cuda" and shared_gpus else NIXL
    if requested == NIXL:
        return ZMQ
    if requested not in (AUTO, CUDA_IPC):
        return requested
    if device != "cuda":
        return ZMQ
    return CUDA_IPC if one_host else f"{CUDA_IPC}|{ZMQ}"


def default_device() -> str:
    """The device type replicas get when none is configured (cuda when this host has a GPU)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
