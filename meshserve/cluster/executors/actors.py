"""`WorkerActor`: one rank of a replica as a Ray actor, serving the step channel.

Ray carries only the life cycle: the constructor (a msgpack WorkerSpec), `serve` (a long-running
call, given the channel's auth with the cluster secret, that runs the channel loop and returns
when the driver says stop; the driver watches its result to learn at once when the actor dies),
`check_health`, `node` and `shutdown`. Steps, and the start and KV hand-over calls, go over the
channel. The actor is threaded (max_concurrency) so that health and shutdown calls are answered
while `serve` runs.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray

from meshserve.cluster.executors.channel import ChannelAuth, serve_rank
from meshserve.cluster.executors.executor import WorkerSpec
from meshserve.cluster.executors.rank_host import RankHost
from meshserve.cluster.logs import configure_logging


class _WorkerActor:
    def __init__(self, spec: bytes, rank: int) -> None:
        configure_logging()
        self.rank = rank
        self.host = RankHost(WorkerSpec.from_msgpack(spec), rank=rank)
        self._stop = threading.Event()

    def node(self) -> dict[str, Any]:
        """Where this rank runs: Ray node id, IP address, process id."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def serve(self, address: str, auth: bytes) -> str:
        """Run the channel loop until the driver says stop (or shutdown() is called); `auth`: the
        msgpack ChannelAuth (cluster secret and session)."""
        serve_rank(self.host, address, ChannelAuth.from_msgpack(auth), rank=self.rank,
                   keep_going=lambda: not self._stop.is_set())
        return "stopped"

    def check_health(self) -> dict[str, Any]:
        return {"rank": self.rank, **self.host.check_health()}

    def shutdown(self) -> None:
        self._stop.set()


# num_cpus=0: an actor takes no CPU slot (its placement-group bundle reserves what the rank needs).
WorkerActor = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(_WorkerActor)
