"""CUDA IPC for KV hand-overs between two processes of one host (same or another GPU).

    exporter (KVExportServer.describe_direct, when it offers an export of CUDA frames):
        desc = IpcExporter().describe(export.frames)   # msgpack-able: handles + byte ranges
    importer (transport.CudaIpcPuller, through direct_offer.pull_direct):
        importer.copy_into(session, desc)              # device to device

`describe` shares the CUDA allocation behind each frame's cache tensor (torch's
`UntypedStorage._share_cuda_`: cudaIpcGetMemHandle plus torch's producer-side reference counter
and a CUDA event that orders the copy after the exporter's last write) and lists, per frame,
(storage index, byte offset, byte count). No bytes leave the GPU and nothing is pickled: the
description is a msgpack map in the offer's direct offer (direct_offer.py: MACed per capability,
carried with the offer's endpoint), so a pull asks the exporter nothing before it copies.

`copy_into` maps each allocation (`_new_shared_cuda`, i.e. cudaIpcOpenMemHandle; kept) and copies
every frame (a run of consecutive blocks of one layer) on a side stream of the importer
(`copy_described`): straight into the destination blocks where they form one run too (one batched
launch for a pull of up to BATCH_BYTES, a memcpy per frame above; as int64 words where the ranges
allow), else one index_copy_ per frame (ImportSession.accept). The host work per pull is a slice
per frame and side: an exporter's storages list is resolved once (`SharedSources`: each mapping's
byte and word views, kept while its mappings are open), our caches' views are made once
(`KVRankIO.word_views`), and the ranges and runs are checked and found in array passes.
Then it waits for an event recorded after its own copies (one host wait per pull, on the pull's
thread: the decode step thread never waits for it).

No checksum by default: the bytes go from one GPU allocation to another by the copy engine and
never leave device memory (no socket, no host buffer), so what a checksum guards against elsewhere
(a torn or truncated stream, a peer answering with other bytes) cannot happen here, and reading
every byte again would cost about a third of the copy. What is still checked: the layout
fingerprint, scales, frame sizes and order against the header, and that every frame lies inside
its shared allocation. `IpcImporter(verify=True)` (`CudaIpcPuller(verify=True)`, a deployment's
`kv_verify_checksum`, under which exporters put the checksum in their offers) verifies it all the
same; a header without one is then refused (docs/cluster.md, "KV transports").

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshserve.kvtransfer.pull_phases import UNTIMED, PullPhases
from meshserve.kvtransfer.rank_io import ImportSession
from meshserve.kvtransfer.wire import KVTransferError

MAX_OPEN = 512  # mapped allocations kept per importer (a cache tensor each, per exporting rank)
MAPPING_IDLE_S = 60.0  # an exporter process's mappings are closed after this long without a pull
# Random per process: two ranks in one process cannot open each other's CUDA IPC handles.
PROCESS_TOKEN = secrets.token_hex(8)
# A pull of at most this many bytes goes in one batched copy launch (`torch._foreach_copy_` over
# 8-byte words): its ~32 memcpy launches (a frame per layer) cost more host time than its copy
# takes on the device (128 MiB: ~0.1 ms). Above it the memcpys' launches hide behind the copying.
BATCH_BYTES = 256 << 20


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
    header's (off by default: see the module docstring). batch_bytes: a pull of at most this many
    bytes into runs of our blocks is copied by one batched launch, a larger one by a memcpy per
    frame (copy_described)."""

    def __init__(self, *, max_open: int = MAX_OPEN, verify: bool = False, batch_bytes: int = BATCH_BYTES) -> None:
        self.max_open = max_open
        self.verify = verify
        self.batch_bytes = batch_bytes
        self._opened: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # a mapping's bytes as a uint8 tensor
        # an exporter's storages list (process, handles) -> its mappings' keys and SharedSources: an
        # exporter shares each cache tensor once, so every pull from it lists the same allocations
        self._resolved: dict[tuple, tuple[list[tuple], SharedSources]] = {}
        self._last_use: dict[str, float] = {}  # exporter process -> monotonic time of its last pull
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}

    @property
    def num_open(self) -> int:
        return len(self._opened)

    def copy_into(self, session: ImportSession, desc: dict[str, Any], *, phases: PullPhases = UNTIMED) -> None:
        """Copy every frame `desc` (IpcExporter.describe) lists into the session's blocks and take
        them (the checksum, verified at the session's finish, when `verify`); KVTransferError "ipc"
        when a handle cannot be opened, "bad_header"/"truncated" for a description that does not
        match the header. The copies are complete when this returns; the caller finishes the
        session (direct_offer.pull_direct)."""
        try:
            process, storages, ranges = str(desc["process"]), desc["storages"], desc["frames"]
            self._close_idle(process)
            sources = self._sources(process, storages)
        except KVTransferError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise KVTransferError("bad_header", f"undecodable CUDA IPC description: {exc!r}") from exc
        if not self.verify:
            session.trust_frames()
        session.check_checksum_present()
        stream = self._stream(session.io.device)
        copied = torch.cuda.Event()
        with torch.cuda.stream(stream):
            copy_described(session, sources, ranges, batch_bytes=self.batch_bytes, phases=phases)
            copied.record(stream)
        phases.mark("launch")
        copied.synchronize()  # this pull's copies only (other pulls' later ones share the stream)
        phases.mark("wait")

    def _sources(self, process: str, storages: list) -> SharedSources:
        """The described allocations mapped (`_open`), as SharedSources: made once per exporter's
        storages list and kept while every mapping of it stays open (its views are then reused:
        making 32 of them, and their word views, cost ~0.1 ms a pull)."""
        key = (process, tuple(bytes(entry[1]) for entry in storages))
        with self._lock:
            known = self._resolved.get(key)
            if known is not None and all(k in self._opened for k in known[0]):
                for k in known[0]:
                    self._opened.move_to_end(k)
                return known[1]
        keys = [(process, bytes(entry[1]), int(entry[3])) for entry in storages]
        sources = SharedSources.of([self._open(process, entry) for entry in storages])
        with self._lock:
            if all(k in self._opened for k in keys):  # not kept if another pull closed one meanwhile
                if len(self._resolved) >= self.max_open:
                    self._resolved.clear()
                self._resolved[key] = (keys, sources)
        return sources

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
                        gone, _ = self._opened.popitem(last=False)  # closes the mapping once no copy uses it
                        for k in [k for k, (keys, _) in self._resolved.items() if gone in keys]:
                            del self._resolved[k]  # its views would hold the mapping open
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
            for key in [k for k in self._resolved if k[0] == process]:
                del self._resolved[key]  # its views hold the mappings open
            self._last_use.pop(process, None)


@dataclass(frozen=True)
class SharedSources:
    """The exporter's allocations a pull copies from: each as flat bytes (uint8), as int64 words
    where it is 8-byte aligned and sized (else None), its size and its device. Made once per
    exporter's storages list (IpcImporter keeps it), or per call from plain tensors (the tests)."""

    flat: tuple[torch.Tensor, ...]
    words: tuple[torch.Tensor | None, ...]
    nbytes: np.ndarray  # [S] int64
    devices: frozenset

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> SharedSources:
        flat = tuple(tensors)
        words = tuple(None if t.numel() % 8 or t.data_ptr() % 8 else t.view(torch.int64) for t in flat)
        return cls(flat, words, np.array([t.numel() for t in flat], dtype=np.int64), frozenset(t.device for t in flat))


def check_ranges(ranges: object, source_nbytes: Sequence[int], frame_nbytes: Sequence[int]) -> list[list[int]]:
    """The description's [storage index, byte offset, byte count] of each frame, checked in array
    passes against the shared allocations' sizes and the header's frame sizes: KVTransferError
    "bad_header" (undecodable, or a range outside its allocation) or "truncated" (another number of
    frames, or a frame of another size) before any copy is queued, so none writes freed blocks."""
    return _range_table(ranges, source_nbytes, frame_nbytes).tolist()


def _range_table(ranges: object, source_nbytes: Sequence[int] | np.ndarray,
                 frame_nbytes: Sequence[int]) -> np.ndarray:  # fmt: skip
    """check_ranges' table as an [F, 3] int64 array."""
    try:
        table = np.array(ranges, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise KVTransferError("bad_header", "CUDA IPC frames are not [storage, offset, bytes] each") from exc
    table = table.reshape(0, 3) if table.size == 0 else table
    if table.ndim != 2 or table.shape[1] != 3:
        raise KVTransferError("bad_header", "CUDA IPC frames are not [storage, offset, bytes] each")
    if len(table) != len(frame_nbytes):
        raise KVTransferError("truncated", f"{len(table)} frames described, header lists {len(frame_nbytes)}")
    storage, offset, nbytes = table.T
    sizes = np.array(source_nbytes, dtype=np.int64)
    known = (storage >= 0) & (storage < len(sizes))
    # offset <= size - nbytes, not offset + nbytes <= size: a sum near 2**63 would wrap around
    inside = known & (offset >= 0) & (nbytes >= 0) & (offset <= sizes[np.where(known, storage, 0)] - nbytes)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise KVTransferError("bad_header", f"frame {i} lies outside its shared allocation")
    wrong = nbytes != np.array(frame_nbytes, dtype=np.int64)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise KVTransferError("truncated", f"frame {i} has {int(nbytes[i])} bytes, expected {frame_nbytes[i]}")
    return table


def copy_described(session: ImportSession, sources: SharedSources | Sequence[torch.Tensor], ranges: object, *,
                   batch_bytes: int = BATCH_BYTES, phases: PullPhases = UNTIMED) -> None:  # fmt: skip
    """Queue the copies of every described frame (check_ranges; sources: each shared allocation's
    bytes, flat uint8, or their SharedSources) into the session's blocks, on the current stream,
    and take the frames. Where our blocks of every frame form one run (a fresh reservation), the
    frames are copied straight into them (one batched launch up to batch_bytes in all, else a
    memcpy each; as int64 words where every range allows) and taken at once; else frame by frame,
    scattered ones by one index_copy_ each (ImportSession.accept). One view a frame on each side,
    sliced from views made once (SharedSources, KVRankIO.word_views); the checks are array passes.
    Device independent: CUDA IPC runs it on its side stream, the tests on CPU tensors."""
    if not isinstance(sources, SharedSources):
        sources = SharedSources.of(sources)
    table = _range_table(ranges, sources.nbytes, session.frame_nbytes)
    in_place, dst_start = session.destination_runs
    if in_place.all():
        _copy_in_place(session, sources, table, dst_start, batch_bytes=batch_bytes, phases=phases)
        session.accept_written()
        return
    srcs = [sources.flat[s][offset : offset + n] for s, offset, n in table.tolist()]
    dsts = session.destinations()
    phases.mark("map")
    direct = [d is not None for d in dsts]
    _copy_all([d for d, ok in zip(dsts, direct) if ok], [s for s, ok in zip(srcs, direct) if ok],
              batch_bytes=batch_bytes)
    for i, src in enumerate(srcs):  # in order: checksums after the copies on this stream
        session.accept(i, None if direct[i] else src)  # scattered blocks: one index_copy_ each


def _copy_in_place(session: ImportSession, sources: SharedSources, table: np.ndarray, dst_start: np.ndarray, *,
                   batch_bytes: int, phases: PullPhases) -> None:  # fmt: skip
    """Every frame straight into its run of our blocks: one slice of a kept view per frame and
    side (words where every range and view allows), then `_copy_pairs`."""
    storage, offset, nbytes = table.T
    layers = session.frame_table[:, 0]
    ours, theirs = session.io.word_views, sources.words
    words = (not ((offset | nbytes | dst_start) % 8).any()
             and all(theirs[s] is not None for s in set(storage.tolist()))
             and all(ours[layer] is not None for layer in set(layers.tolist())))  # fmt: skip
    if words:
        src_views, dst_views, unit = theirs, ours, 8
    else:
        src_views, dst_views, unit = sources.flat, session.io.byte_views, 1
    rows = zip(storage.tolist(), (offset // unit).tolist(), layers.tolist(), (dst_start // unit).tolist(),
               (nbytes // unit).tolist())  # fmt: skip
    srcs, dsts = [], []
    for s, a, layer, d, n in rows:
        srcs.append(src_views[s][a : a + n])
        dsts.append(dst_views[layer][d : d + n])
    phases.mark("map")
    same_device = sources.devices <= {session.io.device}
    _copy_pairs(dsts, srcs, batched=same_device and int(nbytes.sum()) <= batch_bytes)


def _copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, batched: bool) -> None:
    """dst.copy_(src) for every pair, in one `torch._foreach_copy_` launch when `batched` (one
    device), else one by one (each a plain memcpy)."""
    if batched and dsts:
        try:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            return
        except (RuntimeError, TypeError):  # an unsupported combination: copy one by one
            pass
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, batch_bytes: int) -> None:
    """dst.copy_(src) for every pair: in one batched launch when they total at most batch_bytes
    (as 8-byte words where every frame allows it: an element per byte would move a byte per
    thread), else one by one (each a plain device-to-device memcpy at the copy engine's speed;
    torch's batched `_foreach_copy_` runs an elementwise kernel)."""
    if not dsts:
        return
    total = sum(d.numel() for d in dsts)
    batched = total <= batch_bytes and all(d.device == s.device for d, s in zip(dsts, srcs))
    if batched and all(t.numel() % 8 == 0 and t.data_ptr() % 8 == 0 for t in (*dsts, *srcs)):
        dsts, srcs = [d.view(torch.int64) for d in dsts], [s.view(torch.int64) for s in srcs]
    _copy_pairs(dsts, srcs, batched=batched)
