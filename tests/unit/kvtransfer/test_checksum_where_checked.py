"""The frames' checksum is computed where it is checked (kvtransfer/rank_agent.py, export_server.py):
a rank's direct offer carries none unless the deployment verifies (`verify_checksum`,
CacheConfig.kv_verify_checksum); a zmq pull always verifies, its checksum computed when the
exporter answers it, over the cache's own bytes. Two real rank agents over tiny replicas' CPU
caches; the oracle is the sender's cache bytes and FrameDigest over them."""

import contextlib
from dataclasses import replace

import msgpack
import pytest
import torch

from meshserve.core.secret import ClusterSecret
from meshserve.kvstore.block_pool import NULL_BLOCK
from meshserve.kvtransfer.direct_offer import open_offer
from meshserve.kvtransfer.nixl_transport import nixl_available
from meshserve.kvtransfer.rank_agent import KVRankAgent, RankCaches
from meshserve.kvtransfer.transport import Endpoint
from meshserve.kvtransfer.wire import FrameDigest, KVHeader, KVTransferError, as_bytes
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the checksum placement tests")
TOKENS = list(range(100, 137))  # 37 tokens: 9 full blocks of 4 and one partial
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")


def rank(replica: Replica, *, transport: str, verify: bool) -> KVRankAgent:
    agent = KVRankAgent(RankCaches(replica.caches, tuple(replica.layout.retentions), 1, 1, 2), rank=0,
                        kv_transport=transport, secret=SECRET, verify_checksum=verify)
    agent.start_nixl()  # a no-op unless the transport may be nixl
    return agent


@contextlib.contextmanager
def ranks(*, transport: str, verify_exporter: bool, verify_importer: bool):
    """(source replica, its agent, destination replica, its agent); the exporter polled by a thread."""
    src, dst = Replica("gqa", seed=1), Replica("gqa", seed=2)
    dst.fragment(3)  # receiving blocks scattered
    exporter = rank(src, transport=transport, verify=verify_exporter)
    importer = rank(dst, transport=transport, verify=verify_importer)
    try:
        with polled(exporter):
            yield src, exporter, dst, importer
    finally:
        importer.close()
        exporter.close()


def hand_over(src: Replica, exporter: KVRankAgent, dst: Replica, importer: KVRankAgent, rid: str, *,
              fault: str | None = None, damage=None) -> tuple[dict, KVHeader | None]:
    """Offer `rid` from src (pinned) and pull it into blocks reserved at dst: (the pull's result, the
    header of the direct offer or None). damage(src): run between offer and pull."""
    src.add_request(rid, TOKENS)
    pin = src.connector.pins.pin(rid)
    cap = f"capability-of-{rid}-for-this-test"
    endpoint = exporter.offer(pin.blocks.to_wire(), cap, block_size=4, dcp_size=1, model_id="tiny", dst_tp=1,
                              fault=fault)
    direct = Endpoint.from_wire(endpoint).direct_offer
    header = KVHeader.unpack(open_offer(SECRET, cap, direct).header) if direct else None
    if damage is not None:
        damage(src)
    blocks = dst.connector.pins.reserve(rid, pin.blocks.num_tokens, pin.blocks.block_positions,
                                        extra_keys=pin.blocks.extra_keys)
    result = importer.pull(cap, [endpoint], 1, [list(b) for b in blocks], 4, 1, "tiny", timeout_s=30)
    if not result["ok"]:
        dst.connector.pins.abort(rid)
    return result, header


def same_bytes(src: Replica, dst: Replica, rid: str) -> bool:
    return all(torch.equal(a, b) for a, b in zip(dst.request_bytes(rid), src.request_bytes(rid), strict=True))


def cache_checksum(src: Replica, rid: str) -> int:
    """FrameDigest over the request's blocks as an export frames them (the oracle: one frame per
    cache tensor's run of blocks, the default frame size holds all 10 blocks)."""
    blocks = [b for t in src.kv.block_tables(rid) for b in t if b != NULL_BLOCK]
    assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))  # one run: one frame per tensor
    digest = FrameDigest()
    for cache in src.connector.io.caches:
        digest.update(as_bytes(cache.data[blocks[0] : blocks[-1] + 1]))
    return digest.value


@needs_nixl
def test_a_direct_offer_carries_no_checksum_and_a_nixl_pull_moves_identical_bytes():
    with ranks(transport="auto", verify_exporter=False, verify_importer=False) as (src, exporter, dst, importer):
        result, header = hand_over(src, exporter, dst, importer, "r")
        assert result["ok"] and result["transport"] == "nixl", result
        assert header is not None and header.checksum is None  # not computed at the offer
        assert same_bytes(src, dst, "r")
        # a fault-injected (corrupted, unregistered) copy has no NIXL description: its zmq pull
        # gets the checksum of the cache's own bytes and refuses the copy
        result, header = hand_over(src, exporter, dst, importer, "bad", fault="checksum")
        assert not result["ok"] and result["reason"] == "checksum" and "header says" in result["error"], result
        assert header is None and "bad" not in dst.kv
        dst.kv.check_invariants()


@needs_nixl
def test_a_verifying_deployment_computes_the_checksum_at_the_offer_and_checks_it():
    with ranks(transport="auto", verify_exporter=True, verify_importer=True) as (src, exporter, dst, importer):
        result, header = hand_over(src, exporter, dst, importer, "r")
        assert result["ok"] and result["transport"] == "nixl", result
        assert header.checksum == cache_checksum(src, "r")
        assert same_bytes(src, dst, "r")

        def flip(replica: Replica) -> None:  # the exporter's cache changes under the offer: the READ sees it
            block = replica.kv.block_tables("torn")[0][0]
            replica.connector.io.caches[0].data.view(torch.uint8)[block].view(-1)[0] ^= 0x5A

        result, header = hand_over(src, exporter, dst, importer, "torn", damage=flip)
        assert not result["ok"] and result["reason"] == "checksum" and "header says" in result["error"], result
        assert header.checksum is not None and "torn" not in dst.kv
        result, _ = hand_over(src, exporter, dst, importer, "bad", fault="checksum")
        assert not result["ok"] and result["reason"] == "checksum", result
        dst.kv.check_invariants()


@needs_nixl
def test_a_verifying_puller_refuses_a_direct_offer_without_a_checksum():
    with ranks(transport="auto", verify_exporter=False, verify_importer=True) as (src, exporter, dst, importer):
        free = dst.kv.num_free_blocks
        result, header = hand_over(src, exporter, dst, importer, "r")
        assert header.checksum is None
        assert not result["ok"] and result["reason"] == "checksum" and "carries no checksum" in result["error"]
        assert dst.kv.num_free_blocks == free and "r" not in dst.kv


def test_a_zmq_pull_of_a_lazily_digested_export_verifies_the_caches_own_bytes():
    with ranks(transport="zmq", verify_exporter=False, verify_importer=False) as (src, exporter, dst, importer):
        result, header = hand_over(src, exporter, dst, importer, "r")
        assert header is None  # no direct offer: a zmq pull asks the exporter
        assert result["ok"] and result["transport"] == "zmq", result  # its header carried the checksum
        assert same_bytes(src, dst, "r")
        result, _ = hand_over(src, exporter, dst, importer, "bad", fault="checksum")
        assert not result["ok"] and result["reason"] == "checksum" and "header says" in result["error"], result
        assert "bad" not in dst.kv
        dst.kv.check_invariants()


def test_an_export_computes_its_checksum_once_where_asked():
    src = Replica("gqa", seed=1)
    src.add_request("r", TOKENS)
    pin = src.connector.pins.pin("r")
    export = src.connector.io.export(pin.blocks, checksum=False)
    assert export.header.checksum is None and KVHeader.unpack(export.header_bytes).checksum is None
    corrupted = [f.clone() for f in export.frames]
    corrupted[0][0] ^= 1
    copy = export.with_frames(corrupted)
    assert copy.ensure_checksum().header.checksum == cache_checksum(src, "r")  # the cache's bytes, not the copy's
    assert export.ensure_checksum().header.checksum == cache_checksum(src, "r")
    assert KVHeader.unpack(export.header_bytes).checksum == export.header.checksum
    assert src.connector.io.export(pin.blocks).header.checksum == cache_checksum(src, "r")  # the default


def test_a_header_without_a_checksum_round_trips_and_a_forged_one_is_refused():
    src = Replica("gqa", seed=1)
    src.add_request("r", TOKENS)
    export = src.connector.io.export(src.connector.pins.pin("r").blocks, checksum=False)
    assert KVHeader.unpack(export.header.pack()) == export.header
    obj = msgpack.unpackb(export.header_bytes)
    assert obj["checksum"] is None and "checksum" in obj  # nil on the wire, not left out
    for forged in (-1, -(1 << 63), "0x1", True, 1.5, [1]):  # msgpack packs no int of 2**64 or more
        with pytest.raises(KVTransferError) as info:
            KVHeader.unpack(msgpack.packb({**obj, "checksum": forged}))
        assert info.value.reason == "bad_header" and "checksum" in str(info.value)
    without = dict(obj)
    del without["checksum"]
    with pytest.raises(KVTransferError) as info:
        KVHeader.unpack(msgpack.packb(without))
    assert info.value.reason == "bad_header"
    with pytest.raises(KVTransferError) as info:
        KVHeader.unpack(msgpack.packb({**obj, "version": 2}))  # a peer of the old wire format
    assert info.value.reason == "bad_header" and "wire version" in str(info.value)
    # a checksum of the right form but the wrong value is refused at the import, as ever
    export.ensure_checksum()
    dst = Replica("gqa", seed=2)
    forged = replace(export.header, checksum=export.header.checksum ^ 1).pack()
    with pytest.raises(KVTransferError) as info:
        dst.connector.import_(forged, [bytes(f.numpy()) for f in export.frames])
    assert info.value.reason == "checksum"
    assert dst.kv.num_requests == 0


def test_the_setting_is_validated_and_reaches_the_ranks_from_the_serve_flag():
    import argparse

    from meshserve.api.serve import add_serve_parser, configs_of
    from meshserve.cluster.executors.executor import WorkerSpec
    from meshserve.config import CacheConfig, ModelConfig
    from meshserve.errors import ConfigError

    assert CacheConfig().kv_verify_checksum is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="kv_verify_checksum"):
            CacheConfig(kv_verify_checksum=bad)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    for flags, want in (([], False), (["--kv-verify-checksum"], True)):
        engine, _, _ = configs_of(parser.parse_args(["serve", "--device", "cpu", *flags]))
        assert engine.cache.kv_verify_checksum is want
        spec = WorkerSpec(ModelConfig(), engine.cache)  # what a rank host builds its KV agent from
        assert WorkerSpec.from_msgpack(spec.to_msgpack()).cache.kv_verify_checksum is want
