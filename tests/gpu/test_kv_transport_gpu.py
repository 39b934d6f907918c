"""The CUDA IPC KV transport on one GPU, two processes; skipped without CUDA.

1. A peer process (tests/integration/kv_handover_peer.py ipc) offers a request whose blocks lie
   in its CUDA caches, with a direct offer (the CUDA IPC handles, direct_offer.py) per export;
   this process pulls it by CUDA IPC, asking the exporter nothing first, into scattered blocks
   of its own CUDA caches and compares the bytes of every layer's blocks with the sender's (rebuilt here from
   the same seed): with the default puller (no checksum over device-to-device copies) and with
   one that verifies it. A corrupted copy is refused by the verifying puller's checksum, a
   truncated one by the default puller's frame count; neither leaves anything reserved.
2. Disaggregated serving, 1 prefill + 1 decode replica as two processes on the one GPU, with
   kv_transport cuda_ipc: greedy tokens identical to a unified replica on the same GPU, every
   hand-over imported by cuda_ipc (none recomputed), no block left held.
3. The checksum's one-kernel digest over many frames (kvtransfer/digest_kernel.py, what exports on
   a GPU use) gives the frame-by-frame values on the GPU.
"""

import base64
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from meshserve.core.secret import ENV_SECRET, ClusterSecret
from meshserve.kvtransfer.transport import CUDA_IPC, CudaIpcPuller, Endpoint
from meshserve.kvtransfer.wire import KVTransferError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = ClusterSecret(b"test secret of the cuda ipc peer")


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.kv_handover_peer", "ipc"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, ENV_SECRET: SECRET.key.decode()})
    try:
        line = proc.stdout.readline()
        assert line, "the peer process did not start"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def offered(started: dict, endpoint: Endpoint, name: str) -> Endpoint:
    """The endpoint as the offer of export `name` comes: with its direct offer (the CUDA IPC handles)."""
    return replace(endpoint, direct_offer=base64.b64decode(started["direct_offers"][name]))


def test_cuda_ipc_moves_a_requests_kv_bit_exactly(peer):
    from tests.integration.kv_handover_peer import sender_replica
    from tests.unit.kvtransfer.replicas import Replica

    proc, started = peer
    endpoint, caps = Endpoint.from_wire(started["endpoint"]), started["capabilities"]
    assert endpoint.device == "cuda"
    expected = sender_replica().request_bytes("ok")  # the same seed on the CPU: the same bytes
    puller, verifying = CudaIpcPuller(), CudaIpcPuller(verify=True)
    assert not puller.importer.verify

    for seed, pull_with, cap in ((2, puller, "ok"), (5, verifying, "ok_verified")):
        dst = Replica("gqa", seed=seed, device="cuda")
        dst.fragment(4)  # scattered receiving blocks: direct copies and index_copy_ both run
        used = pull_with.pull(dst.connector, offered(started, endpoint, cap), caps[cap], secret=SECRET, timeout_s=60)
        assert used == CUDA_IPC and pull_with.importer.num_open >= 1  # by CUDA IPC, not over the socket
        got = dst.request_bytes("ok")
        assert len(got) == len(expected) >= 2
        for ours, theirs in zip(got, expected, strict=True):  # every cached layer, every block
            assert torch.equal(ours, theirs)
        assert dst.kv.lookup_prefix(list(range(100, 137))).num_tokens == 36  # the sender's hashes committed
        dst.kv.check_invariants()

    for pull_with, cap in ((verifying, "checksum"), (puller, "truncated")):
        bad = Replica("gqa", seed=3, device="cuda")
        free = bad.kv.num_free_blocks
        with pytest.raises(KVTransferError) as info:
            pull_with.pull(bad.connector, offered(started, endpoint, cap), caps[cap], secret=SECRET, timeout_s=60)
        assert info.value.reason == cap
        assert bad.kv.num_free_blocks == free and bad.kv.num_requests == 0
        bad.kv.check_invariants()
    assert puller.sockets.num_created == 1  # its done notices went by one kept socket

    for pull_with in (puller, verifying):
        pull_with.importer.forget(endpoint.process)  # close the mappings while the exporter lives
    proc.stdin.close()
    summary = json.loads(proc.stdout.readline())
    assert summary["pending"] == 0 and summary["rejected"] == 0


GREEDY = dict(temperature=0, ignore_eos=True)


def test_disaggregated_on_one_gpu_matches_unified(tmp_path):
    from meshserve.cluster.coordinator import ClusterConfig
    from meshserve.config import PoolConfig
    from meshserve.core.sampling_params import SamplingParams
    from tests.tiny_models import prompts, write_checkpoint
    from tests.unit.cluster.cases import collect, engine_config, holds_no_blocks, serve, wait_until

    write_checkpoint(tmp_path / "llama", "llama", seed=4)
    engine = engine_config(tmp_path / "llama")
    engine = replace(engine, model=replace(engine.model, enforce_eager=True),
                     cache=replace(engine.cache, kv_transport=CUDA_IPC))
    requests = [(f"r{i}", p, SamplingParams(max_tokens=12, **GREEDY))
                for i, p in enumerate(prompts(4, seed=31, min_len=5, max_len=90))]

    async def one_at_a_time(c):  # the same batch shapes in both runs
        return {rid: (await collect(c, rid, p, sp)).token_ids for rid, p, sp in requests}

    async def disaggregated(c):
        got = await one_at_a_time(c)
        (decode,) = c.replicas("decode")
        stats = decode.stats()
        assert (stats.num_kv_imports, stats.num_recomputes) == (len(requests), 0), stats.handover
        assert stats.handover.transports == {CUDA_IPC: len(requests)}
        assert c.stats().kv_transport == CUDA_IPC
        await wait_until(lambda: holds_no_blocks(c), "every block to be freed", timeout_s=30)
        return got

    def config(mode):
        return ClusterConfig(engine=engine, pools=PoolConfig(mode=mode), runtime="processes", device="cuda")

    unified = serve(config("unified"), one_at_a_time)
    split = serve(config("disaggregated"), disaggregated)
    assert split == unified
    assert all(len(t) == 12 for t in unified.values())


def test_one_kernel_digest_on_the_gpu_equals_the_frame_by_frame_one():
    from meshserve.kvtransfer import digest_kernel
    from meshserve.kvtransfer.wire import FrameDigest

    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes = [4 << 20] * 8 + [4096 * 8 * 3 + 40, 12, 0, (1 << 20) + 5]  # layers' runs, odd sizes, a tail
    frames = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen) for n in sizes]
    assert digest_kernel.applies(frames, 4096)
    one, each = FrameDigest(), FrameDigest()
    one.update_many(frames)  # on CUDA: one launch
    for f in frames:
        each.update(f)
    assert not digest_kernel._FAILED, digest_kernel._FAILED  # the kernel built and ran
    assert one.value == each.value
    frames[3][12345] ^= 0x10
    again = FrameDigest()
    again.update_many(frames)
    assert again.value != one.value
