"""Logging for the cluster runtime: quiet by default, `MESHSERVE_LOG=debug` tells each request's story.

Every process (driver, rank subprocess, Ray actor) calls `configure_logging()` once. Request
events go through `request_event(request_id, event, **fields)` as one structured line each:
    meshserve.request req-7 routed replica=prefill-0 cached_tokens=32
so `grep req-7` over the driver's and the ranks' logs gives the whole life of a request.
"""

from __future__ import annotations

import logging
import os
import sys

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_request_log = logging.getLogger("meshserve.request")


def configure_logging(level: str | None = None) -> None:
    """Level from `level`, else MESHSERVE_LOG (debug, info, warning, error; default warning).

    Adds one stderr handler to the "meshserve" logger (once per process); other libraries'
    loggers are left alone.
    """
    name = (level or os.environ.get("MESHSERVE_LOG") or "warning").lower()
    root = logging.getLogger("meshserve")
    root.setLevel(_LEVELS.get(name, logging.WARNING))
    if not any(getattr(h, "_meshserve", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        handler._meshserve = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False


def request_event(request_id: str, event: str, **fields: object) -> None:
    """One debug line about a request: its id, what happened, and key=value details."""
    if _request_log.isEnabledFor(logging.DEBUG):
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        _request_log.debug("%s %s %s", request_id, event, details)
