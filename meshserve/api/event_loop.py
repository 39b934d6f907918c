"""The event loop of `meshserve serve`'s processes: uvloop (libuv, in C) where it is installed,
unless --no-uvloop; asyncio's own loop otherwise.

Everything that runs on these loops works on both: uvicorn (both HTTP protocols), grpc.aio (its
completion-queue poller reads a socket pair through `loop.add_reader`, which uvloop has), the
engine channel on zmq.asyncio (`add_reader` on the zmq fd), the replica's step thread handing
results back with `call_soon_threadsafe`, signal handlers. The serving tests run with the
default, uvloop; docs/performance.md has what it changes ("uvloop", CPU).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("meshserve.serve")
T = TypeVar("T")


def loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop maker if asked for and installed; None: asyncio's default loop."""
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        log.debug("uvloop is not installed: asyncio's event loop")
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool) -> T:
    """asyncio.run(main) on the loop `loop_factory` picks (asyncio.Runner: Python 3.11 has no
    loop_factory argument to asyncio.run)."""
    with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
        log.debug("event loop: %s", type(runner.get_loop()).__module__)
        return runner.run(main)
