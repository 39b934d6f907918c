"""The executor whose ranks serve a persistent step channel, and the group that launches them.

`ChannelExecutor` is the one used across processes: steps travel over a persistent zmq channel
(channel.py), never as one remote call per rank per step, and, with overlap scheduling
(`submit_step` / `collect_step`), the driver plans the next step while the ranks run this one;
a `RankGroup` launches and watches the ranks (threads here, subprocesses in multiproc.py, Ray
actors in ray_executor.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from meshserve.cluster.executors.channel import ChannelAuth, DriverChannel, serve_rank
from meshserve.cluster.executors.executor import (
    StepDeadline,
    WorkerDiedError,
    WorkerHungError,
    WorkerSpec,
    info_from_dict,
)
from meshserve.core.doorbell import Doorbell
from meshserve.core.secret import ClusterSecret
from meshserve.errors import check
from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import WorkerInfo

log = logging.getLogger("meshserve.executor")


class RankGroup(Protocol):
    """Launches the ranks of one replica and watches them.

    driver_host: the address ranks can reach the driver at (the channel binds there).
    launch(address, auth): start every rank's loop, connecting to the channel at `address`;
        `auth` (the cluster secret and the channel's session) goes with each rank's start-up
        config (stdin, actor arguments), never on a command line or in a log.
    check(): raise WorkerDiedError naming the rank and the cause if a rank is gone.
    stop(now=False): end every rank (after the channel said stop, or forcibly); now: a rank is
        hung and cannot hear a stop, so kill at once instead of giving the loops a grace period.
    """

    world: int
    driver_host: str

    def launch(self, address: str, auth: ChannelAuth) -> None: ...

    def check(self) -> None: ...

    def stop(self, *, now: bool = False) -> None: ...


class ChannelExecutor:
    """An Executor whose ranks serve a DriverChannel; `ranks` decides where they run.

    secret: the cluster's (the coordinator hands one to every replica, so that their ranks can
    exchange KV); default `ClusterSecret.resolve()`.
    deadline: how long a step (by its token count) or a rank call may go unanswered once the
    ranks have started; then WorkerHungError, and `shutdown` kills the ranks at once.
    """

    def __init__(self, ranks: RankGroup, *, name: str = "replica", start_timeout_s: float = 600.0,
                 secret: ClusterSecret | None = None, deadline: StepDeadline | None = None) -> None:  # fmt: skip
        self.ranks = ranks
        self.deadline = deadline or StepDeadline()
        self.hung = False
        self.secret = secret if secret is not None else ClusterSecret.resolve()
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.channel = None
        self.info: WorkerInfo | None = None
        self._submitted: deque[tuple[int, int, str]] = deque()  # (seq, tokens, name) of steps not collected

    def start(self) -> WorkerInfo:
        auth = ChannelAuth.new(self.secret)
        self.channel = DriverChannel(self.ranks.world, auth, host=self.ranks.driver_host)
        self.ranks.launch(self.channel.address, auth)
        self.channel.wait_ready(self.ranks.check, timeout_s=self.start_timeout_s)
        # Rank 0's host picks the torch.distributed rendezvous; all ranks start at once with it.
        init_method = self.channel.call("rendezvous", [{}] * self.ranks.world, self.ranks.check)[0]
        infos = self.channel.call("start", [{"init_method": init_method}] * self.ranks.world, self.ranks.check)
        self.info = info_from_dict(infos[0])
        log.info("%s: %d rank(s) started, %d KV blocks", self.name, self.ranks.world, self.info.num_kv_blocks)
        return self.info

    def execute_step(self, plan: StepPlan) -> StepOutput:
        tokens = plan.num_new_tokens
        with self._watch():
            return StepOutput.from_msgpack(self.channel.step(
                plan.to_msgpack(), self.ranks.check, timeout_s=self.deadline.seconds(tokens),
                what=f"step {plan.step_id} ({tokens} tokens)"))

    @property
    def runs_async(self) -> bool:
        """Whether a submitted step runs while the driver plans the next: the ranks run on CUDA
        (their start-up WorkerInfo says). On a CPU a rank computes a step whole when it arrives."""
        return self.info is not None and self.info.device == "cuda"

    def submit_step(self, plan: StepPlan) -> None:
        """Send a step and return at once (overlap scheduling): the ranks queue it behind the step
        before it and answer that one meanwhile; `collect_step` reads the outputs in order."""
        tokens = plan.num_new_tokens
        with self._watch():
            seq = self.channel.step_start(plan.to_msgpack(), self.ranks.check)
        self._submitted.append((seq, tokens, f"step {plan.step_id} ({tokens} tokens)"))

    def collect_step(self) -> StepOutput:
        """The oldest submitted step's output, waiting for it within the step's deadline; a rank
        that failed it: RankError (the replica then fails, as for execute_step)."""
        seq, tokens, what = self._submitted.popleft()
        with self._watch():
            return StepOutput.from_msgpack(self.channel.step_finish(
                seq, self.ranks.check, timeout_s=self.deadline.seconds(tokens), what=what))

    def call(self, method: str, args: Sequence[dict[str, Any]]) -> list[Any]:
        with self._watch():
            return self.channel.call(method, args, self.ranks.check, timeout_s=self.deadline.seconds())

    def start_call(self, method: str, args: Sequence[dict[str, Any]]) -> int:
        """Send `call(method, args)` to every rank and return at once; `finish_call` reads the
        answers. Steps and calls sent later run after it on every rank."""
        with self._watch():
            return self.channel.call_start(method, args, self.ranks.check)

    def finish_call(self, call_id: int) -> list[Any]:
        """The results of the call `start_call` returned `call_id` for (waiting for them, within a
        rank call's deadline), as `call` returns them."""
        with self._watch():
            return self.channel.call_finish(call_id, self.ranks.check, timeout_s=self.deadline.seconds())

    def take_kv_pulls(self) -> list[dict[str, Any]]:
        """Per rank, {transfer_id: result} of the KV pulls it finished since the last call: what
        the ranks pushed (channel.py PULLED), read locally; no round trip to the ranks."""
        return self.channel.take_pulls_done()

    def wait_kv_pulls(self, timeout_s: float, interrupt: Doorbell | None = None) -> bool:
        """Block until a rank pushes a finished KV pull (True), `interrupt` rings or timeout_s
        passes (False); a dead rank raises WorkerDiedError."""
        return self.channel.wait_pulls_done(timeout_s, self.ranks.check, interrupt)

    @contextlib.contextmanager
    def _watch(self):
        try:
            yield
        except WorkerHungError:
            self.hung = True
            raise

    def check_health(self) -> list[dict[str, Any]]:
        """Every rank alive (its launcher says) and answering over the channel within the deadline
        (a stopped process looks alive to its launcher)."""
        self.ranks.check()
        answers = self.call("check_health", [{}] * self.ranks.world)
        return [{**a, "rank": r, "alive": True} for r, a in enumerate(answers)]

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.ranks.stop(now=self.hung)


class ThreadRanks:
    """A tp=1 replica whose rank loop runs on a thread of this process (no Ray, no subprocess).

    The step still crosses the zmq channel, so tests exercise the path remote ranks use.
    """

    world = 1
    driver_host = "127.0.0.1"

    def __init__(self, spec: WorkerSpec) -> None:
        check(spec.parallel.tp == 1, "tp", spec.parallel.tp, "1 for ranks on threads (use processes or Ray)")
        self.spec = spec
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def launch(self, address: str, auth: ChannelAuth) -> None:
        from meshserve.cluster.executors.rank_host import RankHost  # the rank's side: loaded only when ranks run here

        host = RankHost(self.spec, rank=0)

        def run() -> None:
            try:
                serve_rank(host, address, auth, rank=0)
            except BaseException as exc:  # the driver learns it from check()
                self._error = exc

        self._thread = threading.Thread(target=run, name="meshserve-rank-0", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            raise WorkerDiedError(f"rank 0 thread ended: {self._error!r}")

    def stop(self, *, now: bool = False) -> None:
        if self._thread is not None:  # a hung thread cannot be killed: it is left behind (a daemon)
            self._thread.join(timeout=0 if now else 10)
            self._thread = None
