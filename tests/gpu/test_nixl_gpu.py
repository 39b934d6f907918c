"""The NIXL KV data plane on CUDA caches (VRAM registered with UCX); skipped without CUDA or NIXL.

1. Two tiny replicas with CUDA caches, each with its own NIXL agent: a pull by NIXL READ moves a
   request's blocks into scattered blocks, bit for bit (the sender's bytes are the oracle), with
   and without the checksum; a spent capability is refused and reserves nothing.
2. Disaggregated serving on the GPU with kv_transport nixl (ranks on threads, one agent each):
   greedy and seeded tokens identical to the single-process engine, every hand-over by nixl.
"""


import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvtransfer.export_server import KVExportServer, new_capability
from meshserve.kvtransfer.nixl_transport import NixlAgent, NixlPuller, nixl_available
from meshserve.kvtransfer.transport import NIXL, Endpoint
from meshserve.kvtransfer.wire import KVTransferError
from tests.polling import polled

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not nixl_available(), reason="needs NIXL (nixl-cu13)")]

SECRET = ClusterSecret(b"test secret of the nixl gpu tests")


@pytest.mark.parametrize("verify", [False, True])
def test_a_nixl_read_moves_vram_blocks_bit_exactly(verify):
    from tests.unit.kvtransfer.replicas import Replica

    src, dst = Replica("gqa", seed=1, device="cuda"), Replica("gqa", seed=2, device="cuda")
    exporter, importer = NixlAgent(f"gpu-exporter-{verify}"), NixlAgent(f"gpu-importer-{verify}")
    exporter.register([c.data for c in src.connector.io.caches])
    importer.register([c.data for c in dst.connector.io.caches])
    dst.fragment(3)
    server = KVExportServer(SECRET, nixl=exporter)
    try:
        with polled(server):
            src.add_request("r", list(range(100, 137)))
            cap = new_capability()
            export = src.connector.export("r")
            server.offer(export, capability=cap, release=src.connector.release)
            endpoint = Endpoint(server.address, "h", "cuda", "p", "", nixl=True,
                                direct_offer=server.describe_direct(export, [cap]))  # as kv_offer's answer carries it
            puller = NixlPuller(importer, verify=verify)
            assert puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=60) == NIXL
            assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), src.request_bytes("r"), strict=True))
            free = dst.kv.num_free_blocks
            with pytest.raises(KVTransferError) as info:
                puller.pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30)
            assert info.value.reason == "unknown_request" and dst.kv.num_free_blocks == free
    finally:
        server.close()


def test_disaggregated_serving_on_the_gpu_hands_over_by_nixl(tmp_path):
    from dataclasses import replace

    from tests.tiny_models import write_checkpoint
    from tests.unit.cluster.cases import (
        assert_no_held_blocks,
        assert_same,
        mixed_requests,
        reference,
        run_all,
        serve,
        threads,
    )

    write_checkpoint(tmp_path / "llama", "llama", seed=3)
    requests = mixed_requests()
    want = reference(tmp_path / "llama", requests)  # the engine on the CPU: greedy/seeded tokens agree
    cfg = threads(tmp_path / "llama", "disaggregated")
    cfg = replace(cfg, device="cuda", engine=replace(cfg.engine, cache=replace(cfg.engine.cache, kv_transport="nixl")))

    async def body(c):
        got = await run_all(c, requests)
        (decode,) = c.replicas("decode")
        stats = decode.stats()
        assert stats.num_recomputes == 0 and set(stats.handover.transports) == {"nixl"}, stats
        assert_no_held_blocks(c)
        return got

    assert_same(serve(cfg, body), want)
