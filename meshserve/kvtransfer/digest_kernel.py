"""The checksum's chunk sums of many frames in one kernel (wire.FrameDigest.update_many).

FrameDigest sums each frame's 64-bit words per chunk of CHUNK_WORDS (32 KiB); one torch reduction
per frame is a launch per frame (32 or more per hand-over). Here one Triton launch covers every
frame: program (f, c) sums chunk c of frame f (the last chunk of a frame may be partial) and
writes it at out[first[f] + c], so `out` holds every frame's chunk sums, frame after frame, as
the per-frame reductions would. Frames are passed by address (int64 data pointers), so they may
live in different allocations; each must be 8-byte aligned. Sums wrap modulo 2**64 as torch's do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

TILE_WORDS = 1024
MAX_CHUNKS_PER_FRAME = 65535  # the grid's second dimension on CUDA


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_sums_kernel(addrs, words, firsts, out, CHUNK: tl.constexpr, TILE: tl.constexpr):
        f = tl.program_id(0)
        c = tl.program_id(1)
        n = tl.load(words + f)  # whole 8-byte words of frame f
        start = c * CHUNK
        if start < n:
            base = tl.load(addrs + f).to(tl.pointer_type(tl.int64))
            acc = tl.zeros([TILE], dtype=tl.int64)
            for t in range(0, CHUNK, TILE):
                offs = start + t + tl.arange(0, TILE)
                acc += tl.load(base + offs, mask=offs < n, other=0)
            tl.store(out + tl.load(firsts + f) + c, tl.sum(acc, axis=0))

    return chunk_sums_kernel


_KERNEL = None
_FAILED: list[str] = []  # why the kernel could not be used in this process (then it is not tried again)
log = logging.getLogger("meshserve.kvtransfer")


def give_up(exc: BaseException) -> None:
    """The kernel failed (e.g. it cannot be compiled here): log it once and stop using it."""
    if not _FAILED:
        log.warning("KV checksum: the one-kernel digest is not available, one reduction per frame instead: %r", exc)
    _FAILED.append(repr(exc))


def applies(frames: Sequence[torch.Tensor], chunk_words: int) -> bool:
    """Whether chunk_sums can take these frames: flat uint8 on one device, 8-byte aligned, and not
    more chunks per frame than the grid allows."""
    if not frames or _FAILED:
        return False
    device = frames[0].device
    return all(f.device == device and f.dtype == torch.uint8 and f.dim() == 1 and f.data_ptr() % 8 == 0
               and f.numel() // 8 <= chunk_words * MAX_CHUNKS_PER_FRAME for f in frames)


def chunk_sums(frames: Sequence[torch.Tensor], chunk_words: int) -> tuple[torch.Tensor, list[int]]:
    """(sums, counts): every frame's chunk sums as one int64 tensor on the frames' device, frame
    after frame, and how many chunks each frame has. Call only where `applies`."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    device = frames[0].device
    words = [f.numel() // 8 for f in frames]
    counts = [-(-w // chunk_words) for w in words]
    firsts = [0] * len(frames)
    for i in range(1, len(frames)):
        firsts[i] = firsts[i - 1] + counts[i - 1]
    out = torch.empty(firsts[-1] + counts[-1], dtype=torch.int64, device=device)
    if out.numel():
        meta = torch.tensor([[f.data_ptr() for f in frames], words, firsts], dtype=torch.int64)
        if device.type == "cuda":  # from pinned memory: a copy from pageable memory waits for the stream
            meta = meta.pin_memory().to(device, non_blocking=True)
        _KERNEL[(len(frames), max(counts))](meta[0], meta[1], meta[2], out, CHUNK=chunk_words,
                                            TILE=min(TILE_WORDS, chunk_words))
    return out, counts
