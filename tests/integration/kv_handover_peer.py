"""The other process of the KV hand-over tests (run with `python -m tests.integration.kv_handover_peer`).

zmq:  serve a sender replica's exports (some of them broken on purpose; the cluster secret from
      MESHSERVE_CLUSTER_SECRET, each export under a fresh capability, printed with the address)
      until stdin closes, then print a JSON line with what is still pinned and how many pulls
      were dropped for failing authentication.
ipc:  as zmq, with the sender's caches on CUDA (the CUDA IPC transport, tests/gpu/test_kv_transport_gpu.py):
      "ok" (and the same export again as "ok_verified"), a corrupted copy "checksum" and a
      "truncated" one; the line also carries the export endpoint and, per export, its direct
      offer (base64: what a CUDA IPC pull copies by, direct_offer.py).
dist: one rank of a gloo pair; rank 1 sends exports, rank 0 receives them and prints results.
Everything the two sides exchange is msgpack/JSON/raw bytes, never pickle.
"""

from __future__ import annotations

import argparse
import base64
import json
import select
import sys

import torch

from tests.kv_connector import KVExport
from tests.unit.kvtransfer.replicas import Replica

TOKENS = list(range(100, 137))
SENDER_SEED = 1


def sender_replica(device: str = "cpu") -> Replica:
    """The sender's state, rebuilt identically by the checking side."""
    rep = Replica("gqa", seed=SENDER_SEED, device=device)
    rep.fragment(3)
    for rid in ("ok", "layout", "capacity", "truncated", "checksum"):
        rep.add_request(rid, TOKENS)
    return rep


def broken(export: KVExport, how: str) -> KVExport:
    frames = [f.clone() for f in export.frames]
    if how == "truncated":
        frames = frames[:-1]
    else:
        frames[0][5] ^= 0x40  # a copy: the sender's cache stays intact
    return KVExport(
        header=export.header, frames=frames, pin_id=export.pin_id, header_bytes=export.header_bytes
    )


def serve_zmq(device: str = "cpu") -> None:
    from meshserve.core.secret import ClusterSecret
    from meshserve.kvtransfer.export_server import KVExportServer, new_capability
    from meshserve.kvtransfer.transport import Endpoint

    rep = sender_replica(device)
    server = KVExportServer(ClusterSecret.resolve())
    capabilities, direct_offers = {}, {}
    offered = (("ok", "layout", "capacity", "truncated", "checksum") if device == "cpu"
               else ("ok", "ok_verified", "checksum", "truncated"))
    for rid in offered:
        export = rep.connector.export("ok" if rid == "ok_verified" else rid, max_frame_bytes=4096)
        capabilities[rid] = new_capability()
        export = broken(export, rid) if rid in ("truncated", "checksum") else export
        server.offer(export, capability=capabilities[rid], release=rep.connector.release)
        direct_offers[rid] = base64.b64encode(server.describe_direct(export, [capabilities[rid]])).decode()
    for rid in rep.kv.request_ids():
        rep.kv.free(rid)  # the exports keep what they need
    endpoint = Endpoint.local(server.address, torch.device(device)).to_wire()
    print(json.dumps({"address": server.address, "capabilities": capabilities, "endpoint": endpoint,
                      "direct_offers": direct_offers}), flush=True)
    while True:
        server.poll(50)
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
            break
    for _ in range(100):  # let zmq finish with frames still in flight
        if not server.num_pending:
            break
        server.poll(10)
    pinned = rep.kv.num_total_blocks - rep.kv.num_free_blocks
    print(json.dumps({"pending": server.num_pending, "pinned_blocks": pinned, "rejected": server.rejected.count}),
          flush=True)
    server.close()


def run_dist(rank: int, port: int) -> None:
    import torch.distributed as dist

    from meshserve.kvtransfer.wire import KVTransferError
    from tests.kv_dist_transport import recv_kv, send_kv

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    try:
        if rank == 1:
            rep = sender_replica()
            for rid in ("ok", "checksum", "layout"):
                export = rep.connector.export(rid, max_frame_bytes=4096)
                send_kv(broken(export, "checksum") if rid == "checksum" else export, 0)
                rep.connector.release(export)
            return
        results = {}
        dst = Replica("gqa", seed=2)
        dst.fragment(2)
        expected = sender_replica().request_bytes("ok")
        recv_kv(dst.connector, 1)
        results["ok"] = all(torch.equal(a, b) for a, b in zip(dst.request_bytes("ok"), expected))
        free = dst.kv.num_free_blocks
        try:
            recv_kv(dst.connector, 1)
        except KVTransferError as exc:
            results["checksum"] = exc.reason
        other = Replica("gqa", model_id="other")
        other_free = other.kv.num_free_blocks
        try:
            recv_kv(other.connector, 1)
        except KVTransferError as exc:
            results["layout"] = exc.reason
        results["leaked"] = (free - dst.kv.num_free_blocks) + (other_free - other.kv.num_free_blocks)
        dst.kv.check_invariants()
        print(json.dumps(results), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["zmq", "ipc", "dist"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode in ("zmq", "ipc"):
        serve_zmq("cuda" if args.mode == "ipc" else "cpu")
    else:
        run_dist(args.rank, args.port)


if __name__ == "__main__":
    main()
