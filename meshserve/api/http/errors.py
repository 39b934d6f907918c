"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

The HTTP status comes from api/status.py (the table gRPC uses too); `param` is the field a
ConfigError names. A body that does not parse, or a field of the wrong type, is a 400 naming
the field (FastAPI's 422 is not what OpenAI clients expect).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from meshserve.api.status import outcome_of
from meshserve.errors import ConfigError, MeshserveError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


def error_body(status: int, message: str, *, error_type: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type or _TYPES.get(status, "internal_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, *, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param), status_code=status, headers=headers)


def error_of(exc: BaseException) -> tuple[int, dict]:
    """HTTP status and body for an error a route raised (the same table as gRPC's status codes)."""
    outcome, message = outcome_of(exc)
    param = exc.field if isinstance(exc, ConfigError) else None
    return outcome.http_status, error_body(outcome.http_status, message, error_type=outcome.error_type, param=param)


# pydantic names the member of a union a value failed in the error's location (`prompt.str`,
# `prompt.list[int]`): that is no field of the body, so the field named is the one above it.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "literal", "nullable",
                            "function-after", "function-before", "function-wrap", "tagged-union", "union"})


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and p.split("[", 1)[0] in _UNION_MEMBERS)]
    return ".".join(parts) or "body"


async def _meshserve_error(request: Request, exc: MeshserveError) -> JSONResponse:
    status, body = error_of(exc)
    seconds = getattr(exc, "retry_after_s", None)  # a per-caller limit: when to come back
    return JSONResponse(body, status_code=status, headers=None if seconds is None else {"Retry-After": str(seconds)})


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    field = _field(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg')}", param="body")
    value = first.get("input")
    if isinstance(value, bytes):  # a body that is not JSON (or not sent as application/json)
        value = value.decode("utf-8", "replace")
    shown = json.dumps(value, default=repr)[:80] if first.get("type") != "missing" else "missing"
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    return error_response(400, f"{field}={shown} is not allowed: {first.get('msg')}{more}", param=field)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    status, body = error_of(exc)
    return JSONResponse(body, status_code=status)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(MeshserveError, _meshserve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
