"""Logging for every meshserve process: one format, quiet by default, `MESHSERVE_LOG=debug` tells
each request's story.

Every process (driver, rank subprocess, Ray actor) calls `configure_logging()` once. It puts
one stderr handler on the root logger, in one of two formats (MESHSERVE_LOG_FORMAT, or
`meshserve serve --log-format`):
    text  2026-12-02 10:00:00,123 4242 meshserve.request DEBUG req-7 routed replica=prefill-0
    json  {"ts": "2026-12-02T10:00:00.123+00:00", "level": "DEBUG", "logger": "meshserve.request",
           "pid": 4242, "message": "req-7 routed replica=prefill-0", "request_id": "req-7", ...}
The "meshserve" loggers take the MESHSERVE_LOG level; every other library (uvicorn, ray,
urllib3, filelock, ...) stays at WARNING even under debug, so debug output is meshserve's own.
Request events go through `request_event(request_id, event, **fields)` as one line each, so
`grep req-7` over the driver's and the ranks' logs gives the whole life of a request (in json,
the fields are keys of their own).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

from meshserve.errors import check

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
_request_log = logging.getLogger("meshserve.request")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, pid, message, exception, and request fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "pid": record.process,
               "message": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Level from `level`, else MESHSERVE_LOG (debug, info, warning, error; default warning);
    format from `fmt`, else MESHSERVE_LOG_FORMAT (text or json; default text).

    Idempotent: a second call changes level and format, it does not add a handler.
    """
    name = (level or os.environ.get("MESHSERVE_LOG") or "warning").lower()
    check(name in LEVELS, "MESHSERVE_LOG", name, "one of debug, info, warning, error")
    style = (fmt or os.environ.get("MESHSERVE_LOG_FORMAT") or "text").lower()
    check(style in FORMATS, "log_format", style, "text or json")
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_meshserve", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._meshserve = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if style == "json" else logging.Formatter(TEXT_FORMAT))
    root.setLevel(logging.WARNING)  # third-party libraries: warnings and errors only
    ours = logging.getLogger("meshserve")
    ours.setLevel(LEVELS[name])
    ours.propagate = True
    for stale in [h for h in ours.handlers if getattr(h, "_meshserve", False)]:
        ours.removeHandler(stale)


def request_event(request_id: str, event: str, **fields: object) -> None:
    """One debug line about a request: its id, what happened, and key=value details."""
    if _request_log.isEnabledFor(logging.DEBUG):
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        _request_log.debug("%s %s %s", request_id, event, details,
                           extra={"fields": {"request_id": request_id, "event": event, **fields}})
