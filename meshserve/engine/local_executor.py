"""The executor of a tp=1 engine whose worker runs in this process: a method call per step.

It speaks the executor protocol of cluster/executors/executor.py (start, execute_step,
submit_step/collect_step, call, check_health, shutdown) without Ray, zmq or KV transfer: `call`
reaches only what the worker itself answers. A replica that hands KV over uses
cluster/executors/in_process.py, which adds the rank host's KV transfer methods.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.engine.engine_config import EngineConfig
from meshserve.errors import check
from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import Worker, WorkerInfo

WORKER_METHODS = frozenset({"check_health", "counters"})


class LocalExecutor:
    """Runs the single worker of a tp=1 replica in this process."""

    def __init__(self, config: EngineConfig, *, device: str | None = None, progress: bool = True) -> None:
        check(config.parallel.tp == 1, "tp", config.parallel.tp, "1 for an in-process executor")
        self.worker = Worker(config.model, config.cache, config.attention, config.parallel, rank=0,
                             device=device, progress=progress)

    def start(self) -> WorkerInfo:
        return self.worker.start()

    def execute_step(self, plan: StepPlan) -> StepOutput:
        self.submit_step(plan)
        return self.collect_step()

    @property
    def runs_async(self) -> bool:
        """Whether `submit_step` returns before the step's work is done: on CUDA it queues the
        kernels; on a CPU it computes the whole step (overlap scheduling then gains nothing)."""
        return self.worker.device.type == "cuda"

    def submit_step(self, plan: StepPlan) -> None:
        """Start a step (the plan object as it is: no process boundary to cross)."""
        self.worker.submit(plan)

    def collect_step(self) -> StepOutput:
        """The oldest submitted step's tokens."""
        return self.worker.collect()

    def call(self, method: str, args: Sequence[dict]) -> list:
        check(len(args) == 1, "args", len(args), "one argument map (one rank)")
        check(method in WORKER_METHODS, "method", method, f"one of {sorted(WORKER_METHODS)} (KV transfer "
              "needs cluster.executors.in_process.InProcessExecutor)")
        return [getattr(self.worker, method)(**args[0])]

    def check_health(self) -> list[dict]:
        return [self.worker.check_health()]

    def shutdown(self) -> None:
        self.worker.shutdown()
