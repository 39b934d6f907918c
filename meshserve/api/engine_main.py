"""The engine process's main (`python -m meshserve.api.engine_main`, started by EngineProcess in
api/engine_process.py): read its settings from stdin, build the service `meshserve serve` would
build in process, and serve it to the front-ends (cluster/service_endpoint.py) until SHUTDOWN,
SIGTERM, or its parent is gone. SIGINT is ignored (see api/engine_process.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

import msgpack

from meshserve.cluster import service_wire as wire
from meshserve.core.secret import ClusterSecret

log = logging.getLogger("meshserve.engine_process")
PARENT_CHECK_S = 0.5


async def _serve(config: dict) -> int:
    from meshserve.api.preflight import check_layout_fits_model
    from meshserve.api.serve import build_service, configs_of, pool_parallel_of
    from meshserve.cluster.service_endpoint import ServiceEndpoint

    args = argparse.Namespace(**config["args"])
    engine, pools, _ = configs_of(args)
    per_pool = pool_parallel_of(args, pools)
    check_layout_fits_model(engine.model.model, engine.parallel, per_pool)
    service = build_service(engine, pools, model_name=config["model_name"], device=args.device,
                            progress=sys.stderr.isatty(),
                            block_size=args.block_size, prefill_parallel=per_pool["prefill"],
                            decode_parallel=per_pool["decode"])
    key = wire.ChannelKey(ClusterSecret(config["key"]), config["session"])
    endpoint = ServiceEndpoint(service, config["address"], key)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, endpoint.stop)
    parent = config["parent"]

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_CHECK_S)
        endpoint.stop()

    watcher = loop.create_task(watch_parent())
    code = 0
    try:
        await endpoint.run(start=True)
    except Exception as exc:
        log.error("the engine failed to start: %s: %s", type(exc).__name__, exc)
        code = 1  # the front-ends were told why too (STATE "failed")
    finally:
        watcher.cancel()
        with contextlib.suppress(Exception):
            await service.shutdown(drain=False)
        await endpoint.close()
    return code


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = msgpack.unpackb(sys.stdin.buffer.read())
    from meshserve.cluster.logs import configure_logging

    configure_logging(os.environ.get("MESHSERVE_LOG") or "info", config["args"].get("log_format"))
    from meshserve.api import event_loop

    return event_loop.run(_serve(config), use_uvloop=config["args"]["uvloop"])


if __name__ == "__main__":
    sys.exit(main())
