"""The event loop of `meshserve serve`'s processes: asyncio's own, or with `serve --uvloop`
uvloop's (libuv, in C; not a dependency: `pip install uvloop`).

Everything that runs on these loops works on both: uvicorn (both HTTP protocols), grpc.aio (its
completion-queue poller reads a socket pair through `loop.add_reader`, which uvloop has), the
engine channel on zmq.asyncio (`add_reader` on the zmq fd), the replica's step thread handing
results back with `call_soon_threadsafe`, signal handlers, TLS (the API tests pass on uvloop:
MESHSERVE_TEST_UVLOOP=1, tests/integration/api_harness.py). It is not the default because on
the 2-core CPU it shortened a lone request's HTTP hops but not those of a request arriving among
15 decoding streams, the case issue 41's TTFT target is about (docs/performance.md, "HTTP parser
and event loop"); the GPU host, where Python runs slower, may decide otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("meshserve.serve")
T = TypeVar("T")


def loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop maker if asked for (ImportError where it is not installed: `serve` checks
    the flag first); None: asyncio's default loop."""
    if not use_uvloop:
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool) -> T:
    """asyncio.run(main) on the loop `loop_factory` picks (asyncio.Runner: Python 3.11 has no
    loop_factory argument to asyncio.run)."""
    with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
        log.debug("event loop: %s", type(runner.get_loop()).__module__)
        return runner.run(main)
