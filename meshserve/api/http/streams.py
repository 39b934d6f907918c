"""The service's streams under an HTTP request: opened before the response starts, merged, and
closed — which aborts their requests and frees their KV blocks — the moment the client leaves.

`open_jobs` starts every prompt of a request and waits for each one's first delta, so that a
refusal (a bad field, a full queue, a prompt that cannot fit) becomes the response's status
code instead of an error inside a 200 stream; if one prompt is refused, the others are closed.
`merged` yields (index, delta) from all of them as they come. `SSEResponse` watches the
connection while it streams: a disconnect cancels the body and closes every stream at once
(Starlette's own StreamingResponse notices only at its next write). `until_disconnect` does
the same for a response that is sent whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from meshserve.api.metrics import RequestTimer, ServerMetrics
from meshserve.api.status import outcome_of
from meshserve.cluster.service import InferenceService
from meshserve.core import hop_trace
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import CompletionDelta
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import UnavailableError


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


@dataclass
class Job:
    """One prompt of a request, and what came back for it."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | None  # None: beam search
    beam: BeamSearchParams | None = None
    timer: RequestTimer | None = None
    first: CompletionDelta | None = None
    stream: AsyncIterator[CompletionDelta] | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completed: bool = False
    code: str = "CANCELLED"  # until the job ends otherwise
    pieces: list[CompletionDelta] = field(default_factory=list)
    caller: str = ""  # who sent it (api/callers.py) and its priority: the fair queue's inputs
    priority: int = 0

    @property
    def n(self) -> int:
        """Choices of this prompt."""
        return self.beam.beam_width if self.beam is not None else self.params.n

    def choice_index(self, delta: CompletionDelta) -> int:
        """OpenAI's choice index: prompt index * n + the completion's index."""
        return self.index * self.n + delta.index

    @property
    def prompt_logprobs(self) -> list | None:
        """The prompt's logprobs (prompt_logprobs): the one delta of the request that carries them
        (its first: with n > 1 they come once per request, engine/sample_group.py)."""
        return next((d.prompt_logprobs for d in self.pieces if d.prompt_logprobs is not None), None)

    def choices(self) -> list[list[CompletionDelta]]:
        """job.pieces by completion, in index order (the finished request's whole output)."""
        by_index: dict[int, list[CompletionDelta]] = {}
        for delta in self.pieces:
            by_index.setdefault(delta.index, []).append(delta)
        return [by_index[i] for i in sorted(by_index)]

    def count(self, delta: CompletionDelta) -> None:
        self.num_tokens += len(delta.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if self.timer is not None:
            self.timer.tokens(len(delta.token_ids))
        if delta.finished:
            self.completed, self.code = True, "OK"


async def _first(service: InferenceService, job: Job) -> None:
    job.stream = service.generate(job.prompt_ids, job.params, request_id=job.request_id, beam=job.beam,
                                  caller=job.caller, priority=job.priority)
    try:
        job.first = await anext(job.stream)
    except StopAsyncIteration:  # a stream that ends without a last delta is the service's bug
        raise RuntimeError(f"the stream of {job.request_id} ended without a finished delta") from None
    except BaseException as exc:
        job.code = outcome_of(exc)[0].grpc_code.name if isinstance(exc, Exception) else "CANCELLED"
        raise
    job.count(job.first)


async def close_jobs(jobs: Sequence[Job]) -> None:
    """Close every stream (aborting what still runs) even while being cancelled; record metrics once."""
    with anyio.CancelScope(shield=True):
        for job in jobs:
            if job.stream is not None:
                with contextlib.suppress(Exception):
                    await job.stream.aclose()
                job.stream = None
            if job.timer is not None:
                job.timer.finish(job.code, completed=job.completed)
                job.timer = None


async def open_jobs(service: InferenceService, jobs: Sequence[Job], metrics: ServerMetrics | None) -> None:
    """Start every job and wait for its first delta; on any refusal close them all and raise it."""
    for job in jobs:
        job.timer = metrics.timer() if metrics is not None else None
    try:  # one job (the common case) in this task: see Drain.unless_expired for why no task
        results = ([await _outcome(_first(service, jobs[0]))] if len(jobs) == 1
                   else await asyncio.gather(*(_first(service, job) for job in jobs), return_exceptions=True))
    except BaseException:  # cancelled (the client left): nothing may keep running
        await close_jobs(jobs)
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_jobs(jobs)
        raise errors[0]


async def _outcome(work: Awaitable) -> object:
    """What asyncio.gather(work, return_exceptions=True) gives for it: its result or its Exception."""
    try:
        return await work
    except Exception as exc:
        return exc


async def merged(jobs: Sequence[Job]) -> AsyncIterator[tuple[Job, CompletionDelta]]:
    """(job, delta) of every opened job as deltas come, first deltas first; closes all at the end."""
    if len(jobs) == 1:  # the common case reads its one stream directly: no task and queue hop per delta
        async with contextlib.aclosing(_single(jobs[0])) as items:  # closed (its request aborted) with this one
            async for item in items:
                yield item
        return
    queue: asyncio.Queue[tuple[Job, CompletionDelta | BaseException | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            if not job.first.finished:
                async for delta in job.stream:
                    job.count(delta)
                    await queue.put((job, delta))
                    if delta.finished:
                        break
            await queue.put((job, None))
        except Exception as exc:
            job.code = outcome_of(exc)[0].grpc_code.name
            await queue.put((job, exc))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        for job in jobs:
            yield job, job.first
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        await close_jobs(jobs)


async def _single(job: Job) -> AsyncIterator[tuple[Job, CompletionDelta]]:
    """merged() of one job."""
    try:
        yield job, job.first
        if not job.first.finished:
            async for delta in job.stream:
                job.count(delta)
                yield job, delta
                if delta.finished:
                    break
    except Exception as exc:
        job.code = outcome_of(exc)[0].grpc_code.name
        raise
    finally:
        await close_jobs([job])


async def collect(jobs: Sequence[Job]) -> None:
    """Run every opened job to its end; each job's deltas land in job.pieces."""
    async for job, delta in merged(jobs):
        job.pieces.append(delta)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable):
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


class Drain:
    """The server's drain deadline: `expire()` when --drain-seconds have passed; the streams and
    requests still open then end with an error (503 / an error event, then [DONE])."""

    MESSAGE = "the server is shutting down: the drain time (--drain-seconds) is over; retry on another server"

    def __init__(self) -> None:
        self.expired = asyncio.Event()

    def expire(self) -> None:
        self.expired.set()

    def error(self) -> UnavailableError:
        return UnavailableError(self.MESSAGE)

    async def unless_expired(self, work: Awaitable):
        """`work`'s result, or (with `work` cancelled) UnavailableError once the drain time is over.

        `work` runs in this task, and the drain's end cancels it (as asyncio.timeout does): a
        task for it would hand its result back through the loop's ready queue, behind every
        other ready task (the running streams' writes of the same BATCH), which a stream's first
        token then waits for."""
        if self.expired.is_set():
            if inspect.iscoroutine(work):
                work.close()
            raise self.error()
        task = asyncio.current_task()
        fired = False

        def expire(watch: asyncio.Future) -> None:
            nonlocal fired
            if not watch.cancelled():
                fired = True
                task.cancel()

        watch = asyncio.ensure_future(self.expired.wait())
        watch.add_done_callback(expire)
        try:
            return await work
        except asyncio.CancelledError:
            if fired and task.uncancel() == 0:  # ours, not a cancellation from outside as well
                raise self.error() from None
            raise
        finally:
            watch.remove_done_callback(expire)
            watch.cancel()


class SSEResponse(StreamingResponse):
    """text/event-stream whose body is cancelled (and closed) as soon as the client disconnects;
    when the drain time is over, the body stops and the stream ends with an error event and [DONE]."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], jobs: Sequence[Job], *, drain: Drain | None = None,
                 error_event=None) -> None:
        """error_event(exc) -> the event's bytes (OpenAI's error shape) sent when the drain time is over."""
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs = jobs
        self.drain = drain
        self.error_event = error_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = drained = ended = False
        keys = [job.request_id for job in self.jobs] if hop_trace.enabled() else ()  # its writes' trace keys

        async def sending(message) -> None:
            nonlocal started, ended
            started = True
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            hop_trace.mark("http.write" if message["type"] == "http.response.body" else "http.head", *keys)
            await send(message)

        try:
            async with anyio.create_task_group() as group:
                async def disconnected() -> None:
                    await _wait_disconnect(receive)
                    group.cancel_scope.cancel()

                async def deadline() -> None:
                    nonlocal drained
                    await self.drain.expired.wait()
                    drained = True
                    group.cancel_scope.cancel()

                group.start_soon(disconnected)
                if self.drain is not None:
                    group.start_soon(deadline)
                with contextlib.suppress(OSError):  # the body in this task, its first chunk at once
                    await self.stream_response(sending)
                group.cancel_scope.cancel()
            if drained and not ended:
                await self._end_drained(send, started)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            await close_jobs(self.jobs)  # also when the body never started

    async def _end_drained(self, send: Send, started: bool) -> None:
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.error_event(self.drain.error()) + b"data: [DONE]\n\n"
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": body, "more_body": False})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
