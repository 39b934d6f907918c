"""Transport selection (kvtransfer/transport.py), the kv_transport setting, and the zmq protocol's
parts the device transports lean on: an IPC request of CPU frames gets the bytes, a cancelled
pull stops, and the background pulls of a rank."""

import contextlib
import select
import threading
import time

import pytest
import torch

from meshserve.config import CacheConfig
from meshserve.core.secret import ClusterSecret
from meshserve.errors import ConfigError
from meshserve.kvtransfer.export_server import KVExportServer, new_capability, pull_kv
from meshserve.kvtransfer.transfers import BackgroundPulls
from meshserve.kvtransfer.transport import (
    CUDA_IPC,
    ZMQ,
    CudaIpcPuller,
    Endpoint,
    ZmqPuller,
    choose_transport,
    describe_setting,
    puller_for,
)
from meshserve.kvtransfer.wire import KVTransferError
from tests.polling import polled
from tests.unit.kvtransfer.replicas import Replica

SECRET = ClusterSecret(b"test secret of the kv transport tests")
HOST = "node-a/boot-1"


def end(device="cuda", host=HOST, process="p1", gpu="GPU-0") -> Endpoint:
    return Endpoint("tcp://127.0.0.1:1", host, device, process, gpu if device == "cuda" else "")


@pytest.mark.parametrize(("requested", "theirs", "want", "why"), [
    ("auto", end(process="p2"), CUDA_IPC, ""),  # two CUDA processes of one host
    ("cuda_ipc", end(process="p2"), CUDA_IPC, ""),
    ("auto", end("cpu", process="p2"), ZMQ, "CUDA IPC needs both on CUDA"),
    ("auto", end(host="node-b/boot-7", process="p2"), ZMQ, "different hosts"),
    ("cuda_ipc", end(), ZMQ, "one process"),  # the same process cannot open its own handles
    ("auto", end(process="p2", gpu="GPU-9"), ZMQ, "not visible"),  # another Ray actor's GPU
    ("zmq", end(process="p2"), ZMQ, ""),
    ("pkg.mod:Puller", end("cpu"), "pkg.mod:Puller", ""),
])
def test_choose_transport(requested, theirs, want, why):
    name, reason = choose_transport(requested, end(), theirs, visible_gpus={"GPU-0", "GPU-1"})
    assert name == want and why in reason and bool(reason) == bool(why)


def test_ray_actors_sharing_one_gpu_join_by_cuda_ipc_before_nixl():
    """--gpus-per-rank 0.5 on one GPU: Ray gives the prefill and the decode actor the same GPU as
    their only visible device; both have NIXL agents, and auto still takes CUDA IPC (measured faster)."""
    exporter = Endpoint("tcp://127.0.0.1:1", HOST, "cuda", "prefill-actor", "GPU-0", nixl=True)
    importer = Endpoint("tcp://127.0.0.1:2", HOST, "cuda", "decode-actor", "GPU-0", nixl=True)
    assert choose_transport("auto", importer, exporter, visible_gpus={"GPU-0"}) == (CUDA_IPC, "")
    # whole-GPU actors: each sees only its own GPU, so the same pair goes by NIXL
    other = Endpoint("tcp://127.0.0.1:1", HOST, "cuda", "prefill-actor", "GPU-1", nixl=True)
    assert choose_transport("auto", importer, other, visible_gpus={"GPU-0"}) == ("nixl", "")


def test_a_peer_that_sends_an_address_only_is_a_zmq_peer():
    peer = Endpoint.from_wire("tcp://10.0.0.2:5555")
    assert choose_transport("auto", end(), peer) == (ZMQ, choose_transport("auto", end(), peer)[1])
    assert Endpoint.from_wire(end().to_wire()) == end()


def test_kv_transport_setting_is_validated_naming_the_field():
    assert CacheConfig().kv_transport == "auto"
    assert CacheConfig(kv_transport="cuda_ipc").kv_transport == CUDA_IPC
    assert CacheConfig(kv_transport="tests.unit.cluster.gated_puller:GatedPuller").kv_transport.endswith("Puller")
    for bad in ("tcp", "CUDA-IPC", "no colon.here", "mod:not valid", 3):
        with pytest.raises(ConfigError, match=r"kv_transport.*auto.*zmq.*cuda_ipc"):
            CacheConfig(kv_transport=bad)


def test_nccl_is_no_longer_a_transport():
    with pytest.raises(ConfigError, match=r"kv_transport.*nixl"):  # NIXL covers it (docs/cluster.md)
        CacheConfig(kv_transport="nccl")


def test_pullers_by_name():
    assert isinstance(puller_for("zmq"), ZmqPuller) and isinstance(puller_for("cuda_ipc"), CudaIpcPuller)
    assert type(puller_for("tests.unit.cluster.gated_puller:GatedPuller")).__name__ == "GatedPuller"
    with pytest.raises(ConfigError, match="cannot load"):
        puller_for("tests.no_such_module:Puller")


def test_the_setting_as_the_start_up_log_and_metric_say_it():
    assert describe_setting("auto", "cpu", one_host=True, nixl=True) == "nixl"
    assert describe_setting("nixl", "cuda", one_host=False, nixl=True) == "nixl"
    assert describe_setting("nixl", "cpu", one_host=True, nixl=False) == ZMQ
    assert describe_setting("auto", "cpu", one_host=True, nixl=False) == ZMQ
    assert describe_setting("auto", "cuda", one_host=True, nixl=False) == CUDA_IPC
    assert describe_setting("cuda_ipc", "cuda", one_host=False) == "cuda_ipc|zmq"
    assert describe_setting("zmq", "cuda", one_host=True) == ZMQ
    # choose_transport's order: CUDA IPC first where the ends see each other's GPU, NIXL is installed or not
    assert describe_setting("auto", "cuda", one_host=True, nixl=True) == CUDA_IPC
    # Ray ranks of --gpus-per-rank < 1 may share a GPU (then CUDA IPC), else they pull by NIXL
    assert describe_setting("auto", "cuda", one_host=False, shared_gpus=True, nixl=True) == "cuda_ipc|nixl"
    assert describe_setting("auto", "cuda", one_host=False, shared_gpus=False, nixl=True) == "nixl"
    assert describe_setting("auto", "cpu", one_host=False, shared_gpus=True, nixl=True) == "nixl"


def offered(rid="r", tokens=37):
    """A sender replica with one request offered on a fresh export server: (server, capability, bytes)."""
    src = Replica("gqa", seed=1)
    src.add_request(rid, list(range(100, 100 + tokens)))
    server = KVExportServer(SECRET)
    cap = new_capability()
    server.offer(src.connector.export(rid), capability=cap)
    return server, cap, src.request_bytes(rid)


@contextlib.contextmanager
def served():
    """An offer (offered()) whose server a thread polls until the block ends: (server, cap, bytes)."""
    server, cap, expected = offered()
    try:
        with polled(server):
            yield server, cap, expected
    finally:
        server.close()


def test_an_ipc_request_for_cpu_frames_gets_the_bytes():
    with served() as (server, cap, expected):
        dst = Replica("gqa", seed=2)
        dst.fragment(3)  # scattered receiving blocks
        endpoint = Endpoint(server.address, HOST, "cuda", "p2", "GPU-0")  # as if it could share
        used = CudaIpcPuller().pull(dst.connector, endpoint, cap, secret=SECRET, timeout_s=30)
        assert used == ZMQ  # the exporter's frames are on the CPU: it sent their bytes
        assert all(torch.equal(a, b) for a, b in zip(dst.request_bytes("r"), expected, strict=True))


def test_a_cancelled_pull_stops_and_frees_what_it_reserved():
    server, cap, _ = offered()  # nobody polls the server: no answer ever comes
    dst = Replica("gqa", seed=2)
    free = dst.kv.num_free_blocks
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(KVTransferError) as info:
        pull_kv(dst.connector, server.address, cap, secret=SECRET, timeout_s=30, cancel=cancel)
    assert info.value.reason == "cancelled"
    assert dst.kv.num_free_blocks == free
    server.close()


def test_background_pulls_report_results_errors_and_cancel():
    pulls = BackgroundPulls()
    go = threading.Event()

    def waits(cancel):
        while not go.wait(0.01):
            if cancel.is_set():
                raise KVTransferError("cancelled", "stopped")
        return {"ok": True, "bytes": 7}

    def until_cancelled(cancel):
        if cancel.wait(30):
            raise KVTransferError("cancelled", "stopped")
        return {"ok": True}

    pulls.start("a", waits)
    pulls.start("b", until_cancelled)
    pulls.start("c", lambda cancel: 1 / 0)
    with pytest.raises(ConfigError, match="transfer_id"):
        pulls.start("a", waits)
    pulls.cancel("b")
    go.set()
    assert pulls.close(timeout_s=30)
    done = pulls.take_done()
    assert (done["a"]["ok"], done["a"]["bytes"]) == (True, 7) and done["a"]["seconds"] >= 0
    assert (done["b"]["ok"], done["b"]["reason"]) == (False, "cancelled")
    assert done["c"]["ok"] is False and done["c"]["reason"] is None and "ZeroDivisionError" in done["c"]["error"]
    assert pulls.take_done() == {} and pulls.num_running == 0


def test_background_pulls_ring_their_doorbell_while_results_wait():
    """Whoever collects results can wait on `done_bell` beside its sockets instead of asking:
    readable from the moment a pull finished until take_done took its result."""
    pulls = BackgroundPulls()
    readable = lambda timeout: bool(select.select([pulls.done_bell], [], [], timeout)[0])  # noqa: E731
    go = threading.Event()
    pulls.start("a", lambda cancel: {"ok": go.wait(30)})
    assert not readable(0)
    go.set()
    assert readable(30)  # rung by the finished pull, no one asked
    assert readable(0)  # and stays rung until taken
    assert pulls.take_done()["a"]["ok"] is True
    assert not readable(0)
    assert pulls.close(timeout_s=30)


def test_trusted_frames_skip_only_the_checksum():
    src = Replica("gqa", seed=1)
    src.add_request("r", list(range(100, 137)))
    export = src.connector.export("r")
    frames = [f.clone() for f in export.frames]
    frames[0][3] ^= 0x11  # corrupted in "transit"
    checked = Replica("gqa", seed=2)
    with pytest.raises(KVTransferError) as info:
        checked.connector.import_(export.header, frames)
    assert info.value.reason == "checksum" and checked.kv.num_requests == 0
    trusting = Replica("gqa", seed=2)
    with trusting.connector.begin_import(export.header) as session:
        session.trust_frames()
        with pytest.raises(KVTransferError) as info:  # sizes are still checked
            session.accept(0, frames[0][:-1])
    assert info.value.reason == "truncated" and trusting.kv.num_requests == 0
    with trusting.connector.begin_import(export.header) as session:
        session.trust_frames()
        for i, frame in enumerate(frames):
            session.accept(i, frame)
        session.finish()
    got = trusting.request_bytes("r")
    assert not torch.equal(got[0], src.request_bytes("r")[0])  # what was sent, unverified
    assert all(torch.equal(a, b) for a, b in zip(got[1:], src.request_bytes("r")[1:]))


def test_mappings_of_an_idle_exporter_are_closed_at_the_next_pull():
    from meshserve.kvtransfer.cuda_ipc import MAPPING_IDLE_S, IpcImporter

    importer = IpcImporter()
    now = time.monotonic()
    for process, age in (("stopped", MAPPING_IDLE_S + 1), ("live", 1.0)):
        importer._opened[(process, b"handle", 0)] = torch.empty(0, dtype=torch.uint8)  # stands for a mapping
        importer._last_use[process] = now - age
    importer._close_idle("another")
    assert list(importer._opened) == [("live", b"handle", 0)] and importer.num_open == 1
    importer.forget("live")
    assert importer.num_open == 0


def test_background_pulls_reuse_their_threads_and_stop_them_at_close():
    """A pull runs on a thread kept from an earlier one (no OS thread started per pull); pulls that
    overlap each get a thread; close ends the waiting threads, and a pull started after close
    still runs."""
    pulls = BackgroundPulls(max_idle_workers=2)

    def on_thread(cancel):
        return {"ok": True, "thread": threading.get_ident()}

    def results(*ids):
        deadline = time.monotonic() + 30
        got = {}
        while len(got) < len(ids) and time.monotonic() < deadline:
            got.update(pulls.take_done())
            time.sleep(0.001)
        assert sorted(got) == sorted(ids)
        return got

    pulls.start("a", on_thread)
    first = results("a")["a"]["thread"]
    pulls.start("b", on_thread)
    assert results("b")["b"]["thread"] == first  # the same thread, kept waiting
    gate = threading.Event()
    pulls.start("held", lambda cancel: {"ok": gate.wait(30)})
    pulls.start("c", on_thread)  # the kept thread is busy with "held": another one runs "c" meanwhile
    results("c")
    gate.set()
    assert results("held")["held"]["ok"] is True
    ours = {f"meshserve-kv-pull-{i}" for i in ("b", "c", "held")}  # a thread is named after its last pull
    threads = [t for t in threading.enumerate() if t.name in ours]
    assert len(threads) == 2  # both kept: at most max_idle_workers wait
    assert pulls.close(timeout_s=30)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()  # close stopped the waiting threads
    pulls.start("late", on_thread)
    assert results("late")["late"]["ok"] and pulls.num_running == 0
