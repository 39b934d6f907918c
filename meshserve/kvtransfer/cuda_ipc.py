"""CUDA IPC for KV hand-overs between two processes of one host (same or another GPU).

    exporter (KVExportServer, answering a pull that asks for IPC):
        desc = IpcExporter().describe(export.frames)   # msgpack-able: handles + byte ranges
    importer (pull_kv with ipc=IpcImporter()):
        importer.copy_into(session, desc)              # device to device, checksum verified

`describe` shares the CUDA allocation behind each frame's cache tensor (torch's
`UntypedStorage._share_cuda_`: cudaIpcGetMemHandle plus torch's producer-side reference counter
and a CUDA event that orders the copy after the exporter's last write) and lists, per frame,
(storage index, byte offset, byte count). No bytes leave the GPU and nothing is pickled: the
description is a msgpack map that travels in one MACed message of the zmq export protocol.

`copy_into` maps each allocation (`_new_shared_cuda`, i.e. cudaIpcOpenMemHandle) and copies every
frame (a run of consecutive blocks of one layer) on a side stream of the importer: straight into
the destination blocks where they form one run too (a memcpy per frame of a MiB or more, smaller
ones in one batched `torch._foreach_copy_`), else one index_copy_ per frame (ImportSession.accept).
Then it waits for an event recorded after its own copies (one host wait per pull, on the pull's
thread: the decode step thread never waits for it).

No checksum by default: the bytes go from one GPU allocation to another by the copy engine and
never leave device memory (no socket, no host buffer), so what a checksum guards against elsewhere
(a torn or truncated stream, a peer answering with other bytes) cannot happen here, and reading
every byte again would cost about a third of the copy. What is still checked: the layout
fingerprint, scales, frame sizes and order against the header, and that every frame lies inside
its shared allocation. `IpcImporter(verify=True)` (`CudaIpcPuller(verify=True)`) verifies it all
the same (docs/cluster.md, "KV transports").

Mappings stay open for later hand-overs from the same exporter (opening one costs far more than a
small copy; the exporter's caches live as long as its rank), least recently used first out
beyond MAX_OPEN; every mapping of an exporter process unused for MAPPING_IDLE_S is closed at the
next pull (torch keeps a shared allocation alive until its last mapping closes: a stopped or
rebuilt exporter's cache must not stay held by importers). The blocks themselves stay pinned by
the prefill replica's driver until the decode replica reports the import finished, so the
exporter never reuses them while a copy may read them. The KV was written by steps the exporter
synchronised before offering it (its first token was read back), so the copy needs no wait on
the exporter's stream beyond the one torch does when a mapping is opened.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.rank_io import ImportSession
from meshserve.kvtransfer.wire import KVTransferError

MAX_OPEN = 512  # mapped allocations kept per importer (a cache tensor each, per exporting rank)
MAPPING_IDLE_S = 60.0  # an exporter process's mappings are closed after this long without a pull
# Random per process: two ranks in one process cannot open each other's CUDA IPC handles.
PROCESS_TOKEN = secrets.token_hex(8)
MEMCPY_FRAME_BYTES = 1 << 20  # frames this large (on average) are copied one memcpy each


@functools.cache
def local_gpus() -> dict[str, int]:
    """The GPUs this process sees: UUID -> its device index here (CUDA_VISIBLE_DEVICES renumbers
    them, so an exporter's index means nothing to an importer; its GPU's UUID does)."""
    if not torch.cuda.is_available():
        return {}
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def gpu_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device of this process ("" for any other device)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device.index or 0).uuid)


class IpcExporter:
    """Describes frames (uint8 views of CUDA caches) as CUDA IPC handles and byte ranges.

    Each cache tensor is shared once (the first time one of its frames is described) and the
    description reused: a share wraps the storage in torch's IPC bookkeeping (a CUDA event and
    a reference-counter slot), which must not grow with every hand-over. Importers map each
    share once per process and keep it (IpcImporter)."""

    def __init__(self) -> None:
        self.process = PROCESS_TOKEN
        self._shares: dict[tuple[int, int], list] = {}  # (data_ptr, nbytes) of a storage -> its share

    def describe(self, frames: list[torch.Tensor]) -> dict[str, Any]:
        index: dict[tuple[int, int], int] = {}
        storages, ranges = [], []
        for frame in frames:
            if frame.device.type != "cuda":
                raise KVTransferError("ipc", f"a frame on {frame.device} cannot be shared by CUDA IPC")
            storage = frame.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in index:
                index[key] = len(storages)
                storages.append(self._share(key, storage))
            ranges.append([index[key], frame.storage_offset() * frame.element_size(),
                           frame.numel() * frame.element_size()])
        return {"process": self.process, "storages": storages, "frames": ranges}

    def _share(self, key: tuple[int, int], storage: torch.UntypedStorage) -> list:
        if key not in self._shares:
            device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
            self._shares[key] = [gpu_uuid(storage.device), bytes(handle), int(size), int(offset), bytes(rc_handle),
                                 int(rc_offset), None if ev_handle is None else bytes(ev_handle), bool(ev_sync)]
        return self._shares[key]


class IpcImporter:
    """Maps exporters' allocations (kept, LRU) and copies described frames into an ImportSession.
    Safe to share between pull threads. verify: compare the checksum of the copied frames with the
    header's (off by default: see the module docstring)."""

    def __init__(self, *, max_open: int = MAX_OPEN, verify: bool = False) -> None:
        self.max_open = max_open
        self.verify = verify
        self._opened: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # a mapping's bytes as a uint8 tensor
        self._last_use: dict[str, float] = {}  # exporter process -> monotonic time of its last pull
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}

    @property
    def num_open(self) -> int:
        return len(self._opened)

    def copy_into(self, session: ImportSession, desc: dict[str, Any], *, phases: PullPhases = UNTIMED) -> None:
        """Copy every frame `desc` lists into the session's blocks (and verify the checksum when
        `verify`); KVTransferError "ipc" when a handle cannot be opened, "truncated"/"checksum" as
        any transport. The copies are complete when this returns."""
        try:
            process, storages, ranges = str(desc["process"]), desc["storages"], desc["frames"]
            self._close_idle(process)
            sources = [self._open(process, entry) for entry in storages]
            views = [(sources[int(s)], int(off), int(n)) for s, off, n in ranges]
        except KVTransferError:
            session.abort()
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            session.abort()
            raise KVTransferError("bad_header", f"undecodable CUDA IPC description: {exc!r}") from exc
        if len(views) != session.num_frames:
            session.abort()
            raise KVTransferError("truncated", f"{len(views)} frames described, header lists {session.num_frames}")
        if not self.verify:
            session.trust_frames()
        stream = self._stream(session.io.device)
        srcs = []
        for i, (source, offset, nbytes) in enumerate(views):
            if offset < 0 or offset + nbytes > source.numel():
                session.abort()
                raise KVTransferError("bad_header", f"frame {i} lies outside its shared allocation")
            if nbytes != session.frame_nbytes[i]:  # refused before any copy is queued (none writes freed blocks)
                session.abort()
                raise KVTransferError("truncated", f"frame {i} has {nbytes} bytes, expected {session.frame_nbytes[i]}")
            srcs.append(source[offset : offset + nbytes])
        dsts = session.destinations()
        direct = [d is not None for d in dsts]
        phases.mark("map")
        copied = torch.cuda.Event()
        with torch.cuda.stream(stream):
            # one launch for many small frames, a memcpy per large one
            _copy_all([d for d, ok in zip(dsts, direct) if ok], [s for s, ok in zip(srcs, direct) if ok])
            for i, src in enumerate(srcs):  # in order: checksums after the copies on this stream
                session.accept(i, None if direct[i] else src)  # scattered blocks: one index_copy_ each
            copied.record(stream)
        phases.mark("launch")
        copied.synchronize()  # this pull's copies only (other pulls' later ones share the stream)
        phases.mark("wait")
        session.finish()
        phases.mark("finish")

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream(device=index)
            return self._streams[index]

    def _open(self, process: str, entry: list) -> torch.Tensor:
        uuid, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = entry
        key = (process, bytes(handle), int(offset))
        device = local_gpus().get(str(uuid))
        if device is None:
            raise KVTransferError("ipc", f"the exporter's GPU {uuid} is not visible to this process")
        with self._lock:
            view = self._opened.get(key)
            try:
                if view is None:
                    torch.cuda._lazy_init()
                    storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, rc_handle,
                                                                     rc_offset, ev_handle, ev_sync)
                    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
                    view.set_(storage, 0, (storage.nbytes(),), (1,))  # made once per mapping, not per pull
                    self._opened[key] = view
                    while len(self._opened) > self.max_open:
                        self._opened.popitem(last=False)  # closes the mapping once no copy uses it
                else:  # mapped already (the exporter shares each tensor once: nothing to count)
                    self._opened.move_to_end(key)
            except RuntimeError as exc:
                raise KVTransferError("ipc", f"cannot open the exporter's CUDA IPC handle: {exc}") from exc
        return view

    def _close_idle(self, current: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._last_use[current] = now
            idle = [p for p, t in self._last_use.items() if now - t > MAPPING_IDLE_S]
        for process in idle:
            self.forget(process)

    def forget(self, process: str) -> None:
        """Drop every mapping of an exporter process (it failed or went away)."""
        with self._lock:
            for key in [k for k in self._opened if k[0] == process]:
                del self._opened[key]
            self._last_use.pop(process, None)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for every pair. Frames of a MiB or more go one by one: each is a plain
    device-to-device memcpy, at the copy engine's full speed (torch's batched `_foreach_copy_`
    runs an elementwise kernel); many small frames go in one batched launch, as 8-byte words where
    every frame allows it (an element per byte would move a byte per thread)."""
    if not dsts:
        return
    large = sum(d.numel() for d in dsts) >= len(dsts) * MEMCPY_FRAME_BYTES
    if not large and all(d.device == s.device for d, s in zip(dsts, srcs)):
        if all(t.numel() % 8 == 0 and t.data_ptr() % 8 == 0 for t in (*dsts, *srcs)):
            dsts, srcs = [d.view(torch.int64) for d in dsts], [s.view(torch.int64) for s in srcs]
        try:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            return
        except (RuntimeError, TypeError):  # an unsupported combination: copy one by one
            pass
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)
