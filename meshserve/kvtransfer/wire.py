"""Wire format of a KV hand-over: a msgpack header, then raw frames of cache bytes.

Header (msgpack map, `KVHeader.pack`):
  version, request_id (str | int), fingerprint (of the layout), layout (model id, block size,
  dcp size, per cache tensor: dtype name and the shape of one block, per KV layer group: its
  [sliding_window, num_sink_tokens]), num_tokens, block_positions (per group, the block-table
  indices that carry data, as packed little-endian uint32s; the rest are released window blocks),
  block_hashes (per group, prefix hashes of the first full blocks, 32 bytes each, concatenated),
  extra_keys, scales (per cached layer: [k_scale, v_scale], or
  [scale] for MLA), frames ([tensor, first, count] per frame), nbytes, checksum (an unsigned
  64-bit int, or nil where the exporter computed none: a direct offer's header unless the
  deployment asks pullers to verify, `CacheConfig.kv_verify_checksum`; a zmq answer always
  carries one).
Sent blocks: every group's held blocks, group after group, each in table order. A hybrid layout
  (kvstore/groups.py) shares its cache tensors between groups, so every sent block, whatever its
  group, is one row of each tensor.
Frames: frame i is the raw bytes of `count` consecutive sent blocks of one cache tensor
  (cache.data[blocks[first:first + count]] in storage order), tensors in order, so the receiver
  can write each frame straight into its own blocks.
Checksum: `FrameDigest` over the frames in order: 64-bit word sums per 32 KiB chunk, weighted by
  chunk index (catches flipped bits, truncation and reordering) at memory speed, on CPU or GPU.
  It guards against bugs and mismatched peers, not against an attacker. A puller that verifies
  refuses a header without one ("checksum"); it never accepts unchecked bytes it was asked to check.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from meshserve.errors import MeshserveError
from meshserve.kvtransfer.packed import HASH_BYTES, pack_hashes, pack_u32, unpack_hashes, unpack_u32

# 2: KV layer groups (per-group positions and hashes); 3: the checksum may be nil; 4: positions and
# hashes packed, one bin per group (a 32k-token header listed 2048 of each per group: decoding them
# as msgpack items and checking them one by one cost ~0.3 ms of every pull)
WIRE_VERSION = 4
_MASK = (1 << 64) - 1
_CHUNK_WORDS = 4096  # 32 KiB per weighted chunk


class KVTransferError(MeshserveError):
    """A KV hand-over was refused. `reason` is one of: layout, capacity, truncated, checksum,
    bad_header, unknown_request, timeout, auth (an answer's MAC did not verify), cancelled (the
    importer stopped it: abort, shutdown), ipc (a CUDA IPC handle could not be opened), nixl (a
    NIXL agent, its metadata or a READ failed). The
    receiver has freed everything it allocated."""

    REASONS = ("layout", "capacity", "truncated", "checksum", "bad_header", "unknown_request", "timeout", "auth",
               "cancelled", "ipc", "nixl")

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"KV hand-over refused ({reason}): {message}")


@dataclass(frozen=True)
class KVLayout:
    """What a receiver's caches must match, byte for byte, to take a sender's blocks.

    layers: per cache tensor, (dtype name, shape of one block).
    groups: per KV layer group, (sliding_window, num_sink_tokens) of its block table.
    """

    model_id: str
    block_size: int
    dcp_size: int
    layers: tuple[tuple[str, tuple[int, ...]], ...]
    groups: tuple[tuple[int | None, int], ...] = ((None, 0),)

    @classmethod
    def from_caches(
        cls,
        caches: Sequence[object],
        *,
        model_id: str,
        block_size: int,
        dcp_size: int,
        groups: Sequence[tuple[int | None, int]] = ((None, 0),),
    ) -> KVLayout:
        layers = tuple(
            (str(c.data.dtype).removeprefix("torch."), tuple(c.data.shape[1:])) for c in caches if c is not None
        )
        return cls(model_id, block_size, dcp_size, layers, tuple((w, s) for w, s in groups))

    def to_wire(self) -> list:
        return [self.model_id, self.block_size, self.dcp_size, [[d, list(s)] for d, s in self.layers],
                [list(g) for g in self.groups]]

    @classmethod
    def from_wire(cls, obj: list) -> KVLayout:
        """The layout (one object per distinct layout: its fingerprint and block sizes are
        computed once, not at every import; found by its packed bytes, one C call, rather than
        by its nested lists made hashable in Python)."""
        try:
            key = msgpack.packb(obj)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"an unpackable layout: {exc}") from exc
        layout = _LAYOUTS.get((cls, key))
        if layout is None:
            layout = cls._build(_tuplify(obj))
            if len(_LAYOUTS) >= 64:
                _LAYOUTS.clear()
            _LAYOUTS[cls, key] = layout
        return layout

    @classmethod
    def _build(cls, obj: tuple) -> KVLayout:
        model_id, block_size, dcp_size, layers, groups = obj
        return cls(
            str(model_id),
            int(block_size),
            int(dcp_size),
            tuple((str(d), tuple(int(x) for x in s)) for d, s in layers),
            tuple((None if w is None else int(w), int(s)) for w, s in groups),
        )

    @functools.cached_property
    def fingerprint(self) -> str:  # computed once per layout object (every import checks it twice)
        return hashlib.sha256(msgpack.packb(self.to_wire())).hexdigest()[:32]

    def block_nbytes(self) -> list[int]:
        """Bytes of one block of each cached layer."""
        return list(_block_nbytes(self.layers))

    def difference(self, other: KVLayout) -> str:
        """Human-readable first difference between two layouts (self = ours, other = theirs)."""
        for name in ("model_id", "block_size", "dcp_size"):
            if getattr(self, name) != getattr(other, name):
                return f"{name}: receiver {getattr(self, name)!r}, sender {getattr(other, name)!r}"
        if self.groups != other.groups:
            return (f"KV layer groups (sliding_window, num_sink_tokens): receiver {list(self.groups)}, "
                    f"sender {list(other.groups)}")
        if len(self.layers) != len(other.layers):
            return f"cached layers: receiver {len(self.layers)}, sender {len(other.layers)}"
        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers)):
            if mine != theirs:
                return f"layer {i} (dtype, block shape): receiver {mine}, sender {theirs}"
        return "none"


@dataclass(frozen=True)
class KVHeader:
    request_id: str | int
    layout: KVLayout
    num_tokens: int
    block_positions: tuple[tuple[int, ...], ...]  # per KV layer group
    block_hashes: tuple[tuple[bytes, ...], ...]  # per KV layer group
    extra_keys: tuple
    scales: tuple[tuple[float, ...], ...]
    frames: tuple[tuple[int, int, int], ...]  # (cached layer index, first sent block, count)
    nbytes: int
    checksum: int | None  # None: not computed (KVExport.ensure_checksum computes it where it is checked)
    fingerprint: str = ""
    version: int = WIRE_VERSION
    # True when every hash is HASH_BYTES by construction, split from a packed bin (`unpack`, or an
    # export of a HandoverBlocks.from_wire): KVRankIO.check then checks the counts only and `pack`
    # joins them unchecked; a header built from other hashes has them checked one by one
    hashes_sized: bool = field(default=False, compare=False, repr=False)

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "version": self.version,
                "request_id": self.request_id,
                "fingerprint": self.fingerprint or self.layout.fingerprint,
                "layout": self.layout.to_wire(),
                "num_tokens": self.num_tokens,
                "block_positions": [_pack_positions(p) for p in self.block_positions],
                "block_hashes": [_pack_hashes(h, sized=self.hashes_sized) for h in self.block_hashes],
                "extra_keys": list(self.extra_keys),
                "scales": [list(s) for s in self.scales],
                "frames": [list(f) for f in self.frames],
                "nbytes": self.nbytes,
                "checksum": self.checksum,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> KVHeader:
        try:
            obj = msgpack.unpackb(data, raw=False)
            if obj.get("version") != WIRE_VERSION:
                raise KVTransferError("bad_header", f"wire version {obj.get('version')!r}, expected {WIRE_VERSION}")
            return cls(
                request_id=obj["request_id"],
                layout=KVLayout.from_wire(obj["layout"]),
                num_tokens=int(obj["num_tokens"]),
                # one packed bin per group: a 32k-token header lists 2048 positions and hashes per group
                block_positions=tuple(map(_unpack_positions, obj["block_positions"])),
                block_hashes=tuple(map(_unpack_hashes, obj["block_hashes"])),
                extra_keys=_tuplify(obj["extra_keys"]),
                scales=tuple(tuple(map(float, s)) for s in obj["scales"]),
                frames=tuple((int(a), int(b), int(c)) for a, b, c in obj["frames"]),
                nbytes=int(obj["nbytes"]),
                checksum=_checksum(obj["checksum"]),
                fingerprint=str(obj["fingerprint"]),
                hashes_sized=True,
            )
        except KVTransferError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise KVTransferError("bad_header", f"cannot decode the header: {exc!r}") from exc

    @property
    def num_blocks(self) -> int:
        """Sent blocks (all groups)."""
        return sum(len(p) for p in self.block_positions)

    def frame_nbytes(self) -> list[int]:
        """Byte size of each frame, from the sender's layout."""
        per_block = self.layout.block_nbytes()
        return [per_block[layer] * count for layer, _, count in self.frames]


_LAYOUTS: dict[tuple[type, bytes], KVLayout] = {}  # KVLayout.from_wire's layouts by their packed bytes


@functools.lru_cache(maxsize=64)
def _block_nbytes(layers: tuple) -> tuple[int, ...]:
    """Bytes of one block of each cached layer (KVLayout.block_nbytes; layouts repeat at every import)."""
    out = []
    for dtype, shape in layers:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise KVTransferError("bad_header", f"unknown cache dtype {dtype!r}")
        out.append(torch_dtype.itemsize * int(torch.Size(shape).numel()))
    return tuple(out)


def _pack_positions(positions: Sequence[int]) -> bytes:
    """A group's block positions as packed little-endian uint32s."""
    try:
        return pack_u32(positions)
    except (OverflowError, TypeError, ValueError) as exc:
        raise KVTransferError("bad_header", f"block positions must be integers in [0, 2**32): {exc}") from exc


def _pack_hashes(hashes: Sequence[bytes], *, sized: bool = False) -> bytes:
    """A group's block hashes concatenated (each HASH_BYTES: a sender never packs another size).
    sized: each is HASH_BYTES by construction (KVHeader.hashes_sized): only their total is checked."""
    try:
        if not sized:
            return pack_hashes(hashes)
        packed = b"".join(hashes)
        if len(packed) != HASH_BYTES * len(hashes):
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes each")
        return packed
    except ValueError as exc:
        raise KVTransferError("bad_header", str(exc)) from exc


_unpack_positions, _unpack_hashes = unpack_u32, unpack_hashes  # TypeError: KVHeader.unpack says bad_header


def _checksum(value: object) -> int | None:
    """A header's checksum: nil, or an unsigned 64-bit int (FrameDigest.value)."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= _MASK:
        raise KVTransferError("bad_header", f"checksum {value!r}: nil or an integer in [0, 2**64)")
    return value


def _tuplify(obj: object) -> object:
    return tuple(_tuplify(x) for x in obj) if isinstance(obj, list) else obj


def plan_frames(blocks: Sequence[int], block_nbytes: Sequence[int], max_frame_bytes: int) -> list[tuple[int, int, int]]:
    """(layer, first, count) frames: runs of consecutive block ids, at most max_frame_bytes each
    (but at least one block). Array passes over the block ids (a 32k-token request sends 2048
    blocks in each of 32 layers): the runs are found once, split once per distinct frame cap."""
    if not len(blocks):
        return []
    ids = np.fromiter(blocks, np.int64, len(blocks))
    starts = np.flatnonzero(np.diff(ids) != 1) + 1
    run_first = np.concatenate(([0], starts))
    run_len = np.diff(np.append(run_first, len(ids)))
    splits: dict[int, list[tuple[int, int]]] = {}
    frames = []
    for layer, per_block in enumerate(block_nbytes):
        cap = max(1, max_frame_bytes // per_block)
        if cap not in splits:
            splits[cap] = _split_runs(run_first, run_len, cap)
        frames += [(layer, first, count) for first, count in splits[cap]]
    return frames


def _split_runs(run_first: np.ndarray, run_len: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """(first, count) pieces of at most `cap` blocks of each run, in order."""
    pieces = -(-run_len // cap)  # per run
    run = np.repeat(np.arange(len(run_len)), pieces)  # per piece, its run
    k = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index within its run
    first = run_first[run] + k * cap
    count = np.minimum(cap, run_len[run] - k * cap)
    return list(zip(first.tolist(), count.tolist()))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor seen as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class FrameDigest:
    """Running checksum over frames (uint8 tensors on any device), in order.

    Per frame, the 64-bit word sums of its 32 KiB chunks (one reduction on the frame's device,
    its last partial chunk one more); `value` then weighs and totals every frame's chunk sums in
    a handful of operations per device and reads them back at once: one synchronisation per
    hand-over, and per frame one or two launches instead of seven (a 32-layer hand-over has 32
    frames or more; `update_many` takes them all in one launch). Values: per frame total = sum of
    words, weighted = sum of (i + 1) * chunk i's sum, both mod 2**64, the trailing bytes as one
    little-endian word of each."""

    def __init__(self) -> None:
        self._value = 0
        self._pending: list[tuple[torch.Tensor, int, int]] = []  # chunk sums [c] int64 on device, tail, n

    def update(self, frame: torch.Tensor) -> None:
        n = frame.numel()
        n8 = n - n % 8
        if frame.storage_offset() % 8:
            frame = frame.clone()  # int64 views need 8-byte alignment
        words = frame[:n8].view(torch.int64)
        m = words.numel() // _CHUNK_WORDS
        if words.device.type == "cpu":  # numpy's int64 row sums: torch 2.13's CPU int64 sum runs ~1000x slower
            host = words.numpy()
            chunks = host[: m * _CHUNK_WORDS].reshape(m, _CHUNK_WORDS).sum(axis=1, dtype=np.int64)
            if host.size > m * _CHUNK_WORDS:
                chunks = np.append(chunks, host[m * _CHUNK_WORDS :].sum(dtype=np.int64))
            sums = torch.from_numpy(chunks)
        else:
            sums = words[: m * _CHUNK_WORDS].view(m, _CHUNK_WORDS).sum(1)
            if words.numel() > m * _CHUNK_WORDS:
                sums = torch.cat([sums, words[m * _CHUNK_WORDS :].sum().reshape(1)])
        tail = int.from_bytes(bytes(frame[n8:].cpu().tolist()), "little") if n8 < n else 0
        self._pending.append((sums, tail, n))

    def update_many(self, frames: Sequence[torch.Tensor], *, one_kernel: bool | None = None) -> None:
        """`update` for each frame in order, with the same values. On CUDA (one_kernel None) or when
        asked, every frame's chunk sums come from one kernel launch (digest_kernel.py) instead of
        a reduction per frame (or frame by frame where the kernel does not apply or build)."""
        from meshserve.kvtransfer import digest_kernel

        frames = list(frames)
        if one_kernel is None:
            one_kernel = len(frames) > 1 and frames[0].device.type == "cuda"
        if one_kernel and digest_kernel.applies(frames, _CHUNK_WORDS):
            try:
                flat, counts = digest_kernel.chunk_sums(frames, _CHUNK_WORDS)
            except Exception as exc:  # the kernel did not build here: the same values frame by frame
                digest_kernel.give_up(exc)
            else:
                self._add_chunk_sums(frames, flat, counts)
                return
        for frame in frames:
            self.update(frame)

    def _add_chunk_sums(self, frames: Sequence[torch.Tensor], flat: torch.Tensor, counts: Sequence[int]) -> None:
        at = 0
        for frame, count in zip(frames, counts):
            n = frame.numel()
            n8 = n - n % 8
            tail = int.from_bytes(bytes(frame[n8:].cpu().tolist()), "little") if n8 < n else 0
            self._pending.append((flat[at : at + count], tail, n))
            at += count

    def _totals(self) -> list[tuple[int, int]]:
        """(total, weighted) per pending frame, as Python ints (two's complement of the int64s)."""
        out: list[tuple[int, int] | None] = [None] * len(self._pending)
        by_device: dict[torch.device, list[int]] = {}
        for i, (sums, _, _) in enumerate(self._pending):
            by_device.setdefault(sums.device, []).append(i)
        for device, frames in by_device.items():
            lens = np.array([self._pending[i][0].numel() for i in frames], np.int64)
            flat = torch.cat([self._pending[i][0] for i in frames])
            segment = np.repeat(np.arange(len(frames)), lens)
            weight = np.arange(1, len(segment) + 1) - np.repeat(np.cumsum(lens) - lens, lens)  # 1.. per frame
            segment_t = torch.from_numpy(segment).to(device)
            pair = torch.zeros(2, len(frames), dtype=torch.int64, device=device)
            pair[0].index_add_(0, segment_t, flat)
            pair[1].index_add_(0, segment_t, flat * torch.from_numpy(weight).to(device))
            for i, (total, weighted) in zip(frames, zip(*pair.cpu().tolist())):
                out[i] = (total, weighted)
        return out

    @property
    def value(self) -> int:
        if self._pending:
            for (total, weighted), (sums, tail, n) in zip(self._totals(), self._pending):
                m = sums.numel() - (1 if (n // 8) % _CHUNK_WORDS else 0)  # whole chunks: the tail's weight is m + 1
                total = (total + tail) & _MASK
                weighted = (weighted + (m + 1) * tail) & _MASK
                self._value = ((self._value * 0x100000001B3) ^ total ^ (weighted * 0x9E3779B97F4A7C15) ^ n) & _MASK
            self._pending.clear()
        return self._value
