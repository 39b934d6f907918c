"""SPMD execution of a tensor-parallel replica: every rank runs the same engine, in lock-step.

Each rank's process holds a full EngineCore: its scheduler is deterministic, so given the same
requests in the same order every rank plans the same steps. Only rank 0 samples; its StepOutput
(msgpack) is broadcast to the other ranks over the replica's process group, so every scheduler
sees the same tokens. Nothing but step outputs crosses between ranks per step.

This is how `meshserve generate --tp N` runs without Ray (one process per rank, started by
torch.multiprocessing), and how the TP/DCP equality tests drive a replica.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import Worker, WorkerInfo


class SpmdExecutor:
    """The executor of one rank of an SPMD replica (see the module docstring)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._group: dist.ProcessGroup | None = None

    def start(self) -> WorkerInfo:
        info = self.worker.start()
        if self.worker.parallel.tp > 1:
            # Step outputs travel on a CPU (gloo) group even when the model's collectives use NCCL.
            self._group = dist.new_group(backend="gloo")
        return info

    def execute_step(self, plan: StepPlan) -> StepOutput:
        out = self.worker.execute_step(plan.to_msgpack())
        if self._group is not None:
            out = self._broadcast(out if self.worker.rank == 0 else b"")
        return StepOutput.from_msgpack(out)

    def _broadcast(self, payload: bytes) -> bytes:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(
            int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._group)
        return buf.numpy().tobytes()

    def shutdown(self) -> None:
        self.worker.shutdown()
