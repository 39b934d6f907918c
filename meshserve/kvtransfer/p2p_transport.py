"""The `nccl` KV transport: torch.distributed point-to-point between one exporting and one
importing rank (NCCL between CUDA caches, gloo between CPU caches), over a two-rank process group
made for the pull and torn down after it.

    importer (P2PPuller, on a decode rank's pull thread):
        binds a TCPStore on its host (a free port) and sends its address in the pull request over
        the zmq export channel (MACed like every message there); the exporter answers the header
        and one [b"P"] message, then sends every frame with send() while the importer receives
        each straight into its blocks (or into scratch memory, then index_copy_, where its blocks
        are scattered), checks the checksum and commits.
    exporter (KVExportServer): the sends run on a thread of their own (its rank's loop must not
        wait for the importer); the export is released when they are done.

Every wait is bounded by the pull's timeout (and the importer's cancel event); a group whose
transfer failed is aborted. NCCL's own watchdog timeout is set to twice the pull's plus a
margin, so that torch never reaches it (its default reaction ends the process).

Costs and limits: a group per pull pays a communicator set-up each time (NCCL: tens to hundreds
of ms), so this is for large requests between hosts; a group kept per pair of ranks is not
built. torch's TCPStore does not authenticate: a process that joins the short-lived rendezvous in
the exporter's place can only send bytes that the header's checksum (which came over the MACed
channel) will refuse, or stall the pull until its timeout.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time

import torch
import torch.distributed as dist

from meshserve.kvtransfer.rank_io import ImportSession
from meshserve.kvtransfer.wire import KVTransferError

log = logging.getLogger("meshserve.kvtransfer")

_WATCHDOG_MARGIN_S = 30.0


def _group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """A two-rank group over `store`: NCCL on CUDA (on this thread's `device`), else gloo."""
    timeout = datetime.timedelta(seconds=2 * timeout_s + _WATCHDOG_MARGIN_S)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _finish(work, device: torch.device, deadline: float, cancel: threading.Event | None, what: str) -> None:
    """Wait for one send/recv until the deadline (KVTransferError "timeout" / "cancelled").

    NCCL work reports completion as it happens (its CUDA event), so the wait polls and can be
    cancelled; gloo work completes only inside wait(), so it is one wait bounded by the deadline."""
    if device.type != "cuda":
        left = deadline - time.monotonic()
        if left <= 0 or not work.wait(datetime.timedelta(seconds=left)):
            raise KVTransferError("timeout", f"{what} did not complete in time")
        return
    while not work.is_completed():
        if cancel is not None and cancel.is_set():
            raise KVTransferError("cancelled", f"{what} was cancelled")
        if time.monotonic() > deadline:
            raise KVTransferError("timeout", f"{what} did not complete in time")
        time.sleep(0.0005)
    work.wait()  # raises the op's own error; orders this thread's stream after it


def _close(group: dist.ProcessGroup | None, *, failed: bool) -> None:
    if group is None:
        return
    end = getattr(group, "abort" if failed else "shutdown", None)
    if end is not None:
        try:
            end()
        except RuntimeError as exc:  # tearing down a failed group: nothing more to do
            log.debug("closing a KV p2p group: %s", exc)


class P2PReceiver:
    """The importing end of one pull: the TCPStore the exporter joins, then the receives."""

    def __init__(self, exporter_address: str, device: torch.device, timeout_s: float,
                 cancel: threading.Event | None = None) -> None:  # fmt: skip
        self.device, self.timeout_s, self.cancel = device, timeout_s, cancel
        host = _local_host_towards(exporter_address)
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.rendezvous = f"{host}:{self.store.port}"

    def receive(self, session: ImportSession) -> None:
        """Receive every frame of `session` from rank 0 and finish it (checksum)."""
        deadline = time.monotonic() + self.timeout_s
        group, failed = None, True
        try:
            group = _group(self.store, 1, self.device, self.timeout_s)
            for i, nbytes in enumerate(session.frame_nbytes):
                dst = session.destination(i)
                direct = dst is not None and dst.numel() == nbytes
                buf = dst if direct else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                _finish(group.recv([buf], 0, 0), self.device, deadline, self.cancel, f"frame {i} of the p2p pull")
                session.accept(i) if direct else session.accept(i, buf)
            session.finish()
            failed = False
        except RuntimeError as exc:  # the group's own errors (peer gone, gloo timeout)
            session.abort()
            raise KVTransferError("truncated", f"p2p receive failed: {exc}") from exc
        finally:
            _close(group, failed=failed)
            del self.store


def send_frames(rendezvous: str, frames: list[torch.Tensor], timeout_s: float) -> None:
    """(Exporter, on its own thread) Join the importer's rendezvous as rank 0 and send `frames`."""
    host, port = rendezvous.rsplit(":", 1)
    device = frames[0].device if frames else torch.device("cpu")
    deadline = time.monotonic() + timeout_s
    group, failed = None, True
    try:
        store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        group = _group(store, 0, device, timeout_s)
        for i, frame in enumerate(frames):
            _finish(group.send([frame], 1, 0), device, deadline, None, f"frame {i} of the p2p send to {rendezvous}")
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        failed = False
    except (RuntimeError, KVTransferError) as exc:
        log.warning("KV p2p send to %s failed: %s", rendezvous, exc)
    finally:
        _close(group, failed=failed)


def _local_host_towards(address: str) -> str:
    """This host's address on the route to `address` ("tcp://HOST:PORT"): where the exporter can
    reach the rendezvous (no packet is sent)."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]
