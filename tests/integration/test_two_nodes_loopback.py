"""Two Ray nodes for real on one machine, on loopback addresses of their own: the prefill pool (tp 2:
both ranks) on a node at 127.0.0.2, the decode pool (tp 1) on a node at 127.0.0.3, Ray token
authentication on. KV crosses between them by NIXL (kv_transport auto), re-sharded from two ranks
to one, and every request's tokens (greedy and seeded) equal the single-process engine's.

The cluster runs in a fresh process (`python -m tests.integration.test_two_nodes_loopback CKPT`):
Ray reads its token once per process, and this pytest process may have used Ray without one.
That process prints one JSON line: the tokens, each replica's rank placements and the decode
replica's hand-over counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.kvtransfer.nixl_transport import nixl_available

ROOT = Path(__file__).resolve().parents[2]
PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.3"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(not nixl_available(), reason="NIXL (nixl-cu13) is not installed")]


def requests():
    from tests.unit.cluster.cases import mixed_requests

    return [r for r in mixed_requests() if r[0] in ("ids-3", "ids-7", "seeded", "text-0", "long")]


def test_prefill_and_decode_nodes_on_two_loopback_addresses_hand_over_by_nixl(tmp_path):
    from tests.tiny_models import write_checkpoint
    from tests.unit.cluster.cases import reference

    ckpt = tmp_path / "llama"
    write_checkpoint(ckpt, "llama", seed=4)
    want = {rid: r.token_ids for rid, r in reference(ckpt, requests()).items()}
    # Ray reads the token at its first use in a process: it is in the cluster process's environment from the start
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_two_nodes_loopback", str(ckpt)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=360)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1])
    assert got["placed"] == {"prefill": [PREFILL_IP, PREFILL_IP], "decode": [DECODE_IP]}
    assert got["transports"] == {"nixl": got["imports"]} and got["recomputes"] == 0, got
    assert got["tokens"] == want


def main(ckpt: str) -> None:
    from meshserve.cluster.coordinator import ClusterConfig, Coordinator
    from meshserve.config import ParallelConfig, PoolConfig
    from tests.integration.ray_cluster import multi_node_ray
    from tests.unit.cluster.cases import assert_no_held_blocks, engine_config, run_all

    resources = [{"meshserve_prefill": 2}, {"meshserve_decode": 1}]
    ips = [PREFILL_IP, PREFILL_IP, DECODE_IP]  # the head, the prefill node, the decode node
    with multi_node_ray(resources, node_ips=ips, token=os.environ["RAY_AUTH_TOKEN"]) as at:
        async def body():
            config = ClusterConfig(engine=engine_config(ckpt), pools=PoolConfig(mode="disaggregated", ray_address=at),
                                   prefill_parallel=ParallelConfig(tp=2))
            async with Coordinator(config) as c:
                (prefill,), (decode,) = c.replicas("prefill"), c.replicas("decode")
                placed = {"prefill": [n["ip"] for n in prefill.executor.ranks.nodes()],
                          "decode": [n["ip"] for n in decode.executor.ranks.nodes()]}
                got = await run_all(c, requests())
                stats = decode.stats()
                assert_no_held_blocks(c)
                return {"placed": placed, "tokens": {rid: r.token_ids for rid, r in got.items()},
                        "transports": stats.handover.transports, "imports": stats.num_kv_imports,
                        "recomputes": stats.num_recomputes}

        print(json.dumps(asyncio.run(body())), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
