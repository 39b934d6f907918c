"""A front-end process other than the first under `meshserve serve --api-server-count N`
(`python -m meshserve.api.api_server_main`, started by ApiServerGroup in api/api_servers.py).

Its settings (the parsed `serve` flags with the ports process 0 bound), the deployment secret, the
engine channel's address and session come on stdin as one msgpack map. It serves gRPC and HTTP on
the shared ports through its own EngineClient (which does not own the engine: leaving only
disconnects), writes READY on stdout once it serves, drains on SIGTERM, ignores SIGINT, and stops
by itself when process 0 is gone. /metrics here is the whole server's (api/metrics.py); the
separate --metrics-port is process 0's alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading

import msgpack

from meshserve.api import event_loop
from meshserve.api.api_servers import MULTIPROC_ENV, READY, WATCH_PERIOD_S, FrontendProcess

log = logging.getLogger("meshserve.serve")


def _stop_when_parent_is_gone(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(WATCH_PERIOD_S)
        os.kill(os.getpid(), signal.SIGTERM)  # drains like a stop from process 0

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stdout is process 0's pipe for READY alone: whatever else writes to stdout goes to stderr
    ready_fd = os.dup(1)
    os.dup2(2, 1)
    config = msgpack.unpackb(sys.stdin.buffer.read())
    os.environ[MULTIPROC_ENV] = config["metrics_dir"]  # inherited already; before prometheus_client's import
    from meshserve.api.engine_client import EngineClient
    from meshserve.api.generation_defaults import load_sampling_defaults
    from meshserve.api.http.chat import ChatTemplate
    from meshserve.api.serve import configs_of, run_server
    from meshserve.cluster import service_wire as wire
    from meshserve.cluster.logs import configure_logging
    from meshserve.core.secret import ClusterSecret

    args = argparse.Namespace(**config["args"])
    configure_logging(os.environ.get("MESHSERVE_LOG") or "info", args.log_format)
    engine, _, server = configs_of(args)
    chat_template = ChatTemplate.load(engine.model.model, override=server.chat_template,
                                      tool_call_parser=args.tool_call_parser)
    sampling_defaults = load_sampling_defaults(args.generation_config, engine.model.model)
    key = wire.ChannelKey(ClusterSecret(config["key"]), config["session"])
    service = EngineClient(config["address"], key, model_dir=engine.model.model, max_queue=args.max_queue,
                           owns_engine=False)
    if args.served_model_name and len(args.served_model_name) > 1:
        from meshserve.api.served_names import ServedNames

        service = ServedNames(service, args.served_model_name)
    frontend = FrontendProcess(index=config["index"], count=config["count"], metrics_dir=config["metrics_dir"])
    _stop_when_parent_is_gone(config["parent"])

    def ready() -> None:
        os.write(ready_fd, READY)
        os.close(ready_fd)

    event_loop.run(run_server(service, server, max_queue=args.max_queue, drain_seconds=args.drain_seconds,
                              announce=log.info, chat_template=chat_template, sampling_defaults=sampling_defaults,
                              frontend=frontend, on_serving=ready), use_uvloop=args.uvloop)
    if os.getppid() != config["parent"]:  # process 0 was killed: nobody else removes the metrics files
        shutil.rmtree(config["metrics_dir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
