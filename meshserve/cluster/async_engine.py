"""Streaming on asyncio: `async for delta in engine.stream(prompt, params)`.

One background task owns the EngineCore. Model steps run in a worker thread so the event loop
stays free; requests arriving meanwhile wait in `_pending` and join between steps. Every
stream has its own queue of deltas. Leaving a stream early (break, cancellation) aborts its
request. An engine failure ends every open stream with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from meshserve.cluster.engine import EngineCore
from meshserve.cluster.request import Request
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError, MeshserveError


class EngineDeadError(MeshserveError):
    """The engine loop failed; the message carries the original error."""


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[str, asyncio.Queue[CompletionDelta | BaseException]] = {}
        self._pending: list[Request] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[CompletionDelta]:
        """Deltas of one request until its last (finished) one. Bad input raises before queuing."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        req = self.core.make_request(prompt, params, request_id=request_id)
        if req.request_id in self._queues:
            raise ConfigError("request_id", req.request_id, "an id not in use")
        queue: asyncio.Queue[CompletionDelta | BaseException] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self._pending.append(req)
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine loop failed: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished and self._error is None:
                self._aborts.append(req.request_id)
                self._wake()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with a finished delta (finish_reason ABORT)."""
        self._aborts.append(request_id)
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake()

    def _drain_requests(self) -> None:
        pending, self._pending = self._pending, []
        for req in pending:
            if req.request_id in self._queues:
                self.core.add(req)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            delta = self.core.abort(rid)
            if delta is not None:
                self._deliver([delta])

    def _deliver(self, deltas: Sequence[CompletionDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    async def _run(self) -> None:
        try:
            while True:
                self._drain_requests()
                if not self.core.has_unfinished():
                    self._wakeup.clear()
                    if self._pending or self._aborts:
                        continue
                    await self._wakeup.wait()
                    continue
                deltas = await asyncio.to_thread(self.core.step)
                self._deliver(deltas)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # every open stream learns about it
            self._error = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.core.shutdown()
