"""With the default (local) configuration nothing meshserve starts listens beyond loopback.

`non_loopback_listeners()` lists every listening socket of the test process and its children
(psutil) off loopback. test_kv_reshard_handover.py asserts it is empty while disaggregated pools
of tp 2 and tp 4 ranks in processes (no Ray) run: the ranks' rendezvous (a FileStore), gloo, the
step channels, the KV export servers and NIXL/UCX (before UCX_NET_DEVICES=lo, UCX listened on
the node's address too: measured).

Ray's own servers (GCS, raylet, object manager, core workers) bind every interface in Ray 2.60
whatever node address it is given (checked: `ray.init(_node_ip_address="127.0.0.1")` still
listens on 0.0.0.0); test_embedded_ray_listens_on_loopback records that as an expected failure.
"""

import ipaddress
import os

import psutil
import pytest


def non_loopback_listeners() -> list[str]:
    """'process: address:port' of each listening inet socket of this process tree off loopback."""
    me = psutil.Process(os.getpid())
    out = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback:
                out.append(f"{name}[{proc.pid}]: {c.laddr.ip}:{c.laddr.port}")
    return out


@pytest.mark.xfail(strict=True, reason="Ray 2.60's GCS, raylet, object manager and core workers bind 0.0.0.0 "
                   "regardless of _node_ip_address (no bind-address option); they rely on Ray's token auth")
def test_embedded_ray_listens_on_loopback(tmp_path):
    import ray

    from meshserve.cluster.executors.ray_executor import ray_init

    assert ray_init(None, num_cpus=1, temp_dir=str(tmp_path))
    try:
        assert non_loopback_listeners() == []
    finally:
        ray.shutdown()
