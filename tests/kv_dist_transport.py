"""KV hand-over over torch.distributed point-to-point (NCCL between GPUs, gloo on CPU).

    sender rank:   send_kv(export, dst=receiver_rank, group=g)   # then the driver may release its pin
    receiver rank: blocks = recv_kv(target, src=sender_rank, group=g)   # an ImportTarget (rank_io.py)

Stream on the wire: [int64 header length] [uint8 header bytes] [frame 0] [frame 1] ..., every
tensor on the caches' device (NCCL needs device tensors; the frames are views of the cache, so
the sender copies nothing). The receiver receives straight into its cache where the new blocks
form one run. A refused import (layout, capacity) still receives the frames into scratch memory,
so the pair of ranks stays in step for the next hand-over; only an undecodable header leaves
the stream out of step (the process group should then be rebuilt).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshserve.kvtransfer.rank_io import ImportTarget, KVExport
from meshserve.kvtransfer.wire import KVHeader, KVTransferError


def send_kv(
    export: KVExport,
    dst: int,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Send one export to rank `dst`. device: where the header goes (default: the frames')."""
    dev = torch.device(device) if device is not None else (export.frames[0].device if export.frames else "cpu")
    header = torch.tensor(list(export.header_bytes), dtype=torch.uint8, device=dev)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=dev), dst, group=group)
    dist.send(header, dst, group=group)
    for frame in export.frames:
        dist.send(frame, dst, group=group)


def recv_kv(target: ImportTarget, src: int, *, group: dist.ProcessGroup | None = None) -> tuple[list[int], ...]:
    """Receive one hand-over from rank `src` into `target`'s blocks (returned per group);
    KVTransferError if refused (after the target let go of its blocks)."""
    dev = target.device
    length = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(length, src, group=group)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    dist.recv(raw, src, group=group)
    header = KVHeader.unpack(raw.cpu().numpy().tobytes())
    sizes = header.frame_nbytes()
    try:
        session = target.begin_import(header)
    except KVTransferError:
        for size in sizes:  # keep the stream in step
            dist.recv(torch.empty(size, dtype=torch.uint8, device=dev), src, group=group)
        raise
    with session:
        for i, size in enumerate(sizes):
            dst = session.destination(i)
            if dst is not None:
                dist.recv(dst, src, group=group)
                session.accept(i)
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=dev)
                dist.recv(buf, src, group=group)
                session.accept(i, buf)
        return session.finish()
