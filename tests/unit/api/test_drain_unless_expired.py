"""Drain.unless_expired (api/http/streams.py): the work runs in the caller's task and the drain's
end cancels it, as asyncio.timeout would. Oracle: asyncio's own cancellation semantics; the work's
`finally` must run (a stream's request is aborted there) and a cancellation from outside must stay
a cancellation (the client left), not turn into the drain's 503."""

from __future__ import annotations

import asyncio

import pytest

from meshserve.api.http.streams import Drain
from meshserve.errors import UnavailableError


def test_the_work_runs_in_the_callers_task_and_gives_its_result():
    async def main():
        caller = asyncio.current_task()

        async def work():
            assert asyncio.current_task() is caller  # no task of its own (no hop through the loop)
            await asyncio.sleep(0)
            return 7

        return await Drain().unless_expired(work())

    assert asyncio.run(main()) == 7


def test_the_drains_end_cancels_the_work_and_raises_unavailable():
    cleaned = []

    async def main():
        drain = Drain()

        async def work():
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.append(True)

        asyncio.get_running_loop().call_later(0.05, drain.expire)
        with pytest.raises(UnavailableError, match="drain time"):
            await drain.unless_expired(work())
        assert asyncio.current_task().cancelling() == 0  # nothing left pending on the caller

    asyncio.run(main())
    assert cleaned == [True]


def test_a_cancellation_from_outside_stays_a_cancellation():
    async def main():
        drain = Drain()
        started = asyncio.Event()

        async def work():
            started.set()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(drain.unless_expired(work()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        drain.expire()  # afterwards: nothing of the finished call reacts
        await asyncio.sleep(0.01)

    asyncio.run(main())


def test_an_expired_drain_refuses_at_once_without_running_the_work():
    ran = []

    async def main():
        drain = Drain()
        drain.expire()

        async def work():
            ran.append(True)

        with pytest.raises(UnavailableError):
            await drain.unless_expired(work())

    asyncio.run(main())
    assert ran == []
