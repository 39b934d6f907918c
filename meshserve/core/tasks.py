"""Ending asyncio tasks on shutdown.

    await cancel_and_wait(reader, poller)   # each cancelled, each ended, their errors dropped

`task.cancel()` then `with suppress(CancelledError): await task` is the usual spelling, and it
has two faults: it also swallows a cancel of the caller (which then goes on as if nothing
happened), and it waits on a task that drops its cancel for as long as that task runs (on
Python 3.11, `asyncio.wait_for` drops a cancel that arrives in the turn its awaitable completes;
meshserve bans it, pyproject.toml). Here the caller's own cancel reaches the caller, and the
tasks' outcomes (cancelled, failed or returned) are read, so none is logged as never retrieved.
"""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    tasks = tuple(t for t in tasks if t is not None)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # read: an error of a task being shut down is not news
