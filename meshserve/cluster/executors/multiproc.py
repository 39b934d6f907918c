"""Ranks as local subprocesses (no Ray): tp > 1 on one machine, `meshserve generate --tp 2`.

`MultiprocExecutor(config)` is a ChannelExecutor whose ranks are `python -m
meshserve.cluster.executors.multiproc ADDRESS RANK` processes; each reads its msgpack WorkerSpec and its
channel auth (the cluster secret: never argv or the environment) from stdin, serves the step
channel, and exits when the driver says stop or its parent is gone.
All ranks start their workers at once with one torch.distributed rendezvous picked by rank 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgpack

from meshserve.cluster.executors.channel import ChannelAuth
from meshserve.cluster.executors.channel_executor import ChannelExecutor
from meshserve.cluster.executors.executor import WorkerDiedError, WorkerSpec

STOP_GRACE_S = 10.0


class ProcessRanks:
    """`world` rank processes on this machine; the channel binds on loopback."""

    driver_host = "127.0.0.1"

    def __init__(self, spec: WorkerSpec, *, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.world = spec.parallel.tp
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def launch(self, address: str, auth: ChannelAuth) -> None:
        env = dict(os.environ if self.env is None else self.env)
        if "OMP_NUM_THREADS" not in env:  # ranks share the cores instead of each taking all of them
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (self.world + 1)))  # + the driver
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.getcwd(), env.get("PYTHONPATH", "")) if p)
        start = msgpack.packb({"spec": self.spec.to_msgpack(), "auth": auth.to_msgpack()})
        for rank in range(self.world):
            proc = subprocess.Popen([sys.executable, "-m", "meshserve.cluster.executors.multiproc", address, str(rank)],
                                    stdin=subprocess.PIPE, env=env)
            proc.stdin.write(start)
            proc.stdin.close()
            self.procs.append(proc)

    def check(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise WorkerDiedError(f"rank {rank} process (pid {proc.pid}) died: {cause}")

    def stop(self, *, now: bool = False) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=0 if now else STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


class MultiprocExecutor(ChannelExecutor):
    """An executor for `config` (an EngineConfig) with one subprocess per TP rank."""

    def __init__(self, config, *, device: str | None = None, worker_class: str | None = None,
                 name: str = "replica", secret=None, deadline=None) -> None:
        spec = WorkerSpec(config.model, config.cache, config.attention, config.parallel, device,
                          **({"worker_class": worker_class} if worker_class else {}))
        super().__init__(ProcessRanks(spec), name=name, secret=secret, deadline=deadline)


def _main(argv: list[str]) -> int:
    from meshserve.cluster.executors.channel import serve_rank
    from meshserve.cluster.executors.rank_host import RankHost
    from meshserve.cluster.logs import configure_logging

    configure_logging()
    address, rank = argv[0], int(argv[1])
    start = msgpack.unpackb(sys.stdin.buffer.read())
    spec, auth = WorkerSpec.from_msgpack(start["spec"]), ChannelAuth.from_msgpack(start["auth"])
    parent = os.getppid()
    serve_rank(RankHost(spec, rank=rank), address, auth, rank=rank, keep_going=lambda: os.getppid() == parent)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
