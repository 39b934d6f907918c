"""Reading a JSON request body without letting it take the event loop (or the memory).

The body is counted while it arrives: bytes (the guard's --max-message-bytes, 413), and its
JSON shape, chunk by chunk at C speed (`bytes.split`/`count`): the strings in it and the values
outside strings (commas). A body of 500k short prompts, or millions of token ids, passes
either count long before it is read whole and is refused then (413 naming the limit): nothing
of it is decoded, so it costs neither time on the loop nor memory beyond the chunks read.

A body within the counts is decoded (json.loads) and validated (pydantic) in a worker
thread: bounded by the counts, that work is short, and the loop serves other streams
meanwhile. A small body (INLINE_BODY_BYTES) is decoded on the loop: its decoding takes less
than the hop to a worker thread and back (~0.3 ms of a request's time to first token on the
2-core CPU; docs/performance.md "Served time to first token, hop by hop"). A lone UTF-16
surrogate escape ("\\ud800"), which JSON allows but no tokenizer takes, is a 400 naming the
field.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from meshserve.errors import ConfigError

_ESCAPE = re.compile(rb"\\.", re.S)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
INLINE_BODY_BYTES = 1 << 13  # up to this size a body is decoded on the event loop


@dataclass(frozen=True)
class ShapeLimits:
    """What one body may hold (see docs/api.md): JSON strings (keys included), and other values
    (numbers and the like, counted by the commas between them outside strings)."""

    max_strings: int
    max_values: int


class JsonShapeCounter:
    """Counts strings and values of a JSON text fed in chunks; HTTPException(413) past a limit."""

    def __init__(self, limits: ShapeLimits) -> None:
        self.limits = limits
        self.in_string = False
        self.quotes = 0
        self.values = 0
        self._held = b""  # a trailing backslash whose escaped byte is in the next chunk

    def feed(self, chunk: bytes) -> None:
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if b"\\" in chunk:  # escapes (\" above all) are not quotes: blank them out
            chunk = _ESCAPE.sub(b"__", chunk)
            if chunk.endswith(b"\\"):
                chunk, self._held = chunk[:-1], b"\\"
        parts = chunk.split(b'"')
        outside = parts[1::2] if self.in_string else parts[0::2]
        self.values += sum(part.count(b",") for part in outside)
        self.quotes += len(parts) - 1
        if (len(parts) - 1) % 2:
            self.in_string = not self.in_string
        self._check()

    def _check(self) -> None:
        strings, limits = self.quotes // 2, self.limits
        if strings > limits.max_strings:
            raise HTTPException(413, f"the body holds more than {limits.max_strings} JSON strings: a request "
                                     "of at most max_prompts_per_request prompts needs far fewer (docs/api.md)")
        if self.values > limits.max_values:
            raise HTTPException(413, f"the body holds more than {limits.max_values} JSON values: more token ids "
                                     "than max_prompts_per_request prompts of max_model_len tokens (docs/api.md)")


async def read_body(request: Request, limits: ShapeLimits) -> bytes:
    """The whole body, counted as it comes (the guard counts its bytes)."""
    counter = JsonShapeCounter(limits)
    chunks = []
    async for chunk in request.stream():
        if chunk:
            counter.feed(chunk)
            chunks.append(chunk)
    return b"".join(chunks)


def _surrogate_path(value, path: str) -> str | None:
    """The field of the first string in `value` that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _surrogate_path(key, path) is not None:
            return f"{path}.{key[:40]}" if path else key[:40]
        found = _surrogate_path(item, f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key))
        if found is not None:
            return found
    return None


def _decode(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """(In a worker thread) JSON -> the body model; errors as the route's handlers expect."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": str(exc)[:200]}]) from None
    if _SURROGATE_ESCAPE.search(raw) is not None and (field := _surrogate_path(data, "")) is not None:
        raise ConfigError(field, "<text with a lone UTF-16 surrogate>",
                          "text of Unicode characters (a lone surrogate such as \\ud800 is not one)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def parse_body(request: Request, model: type[BaseModel], limits: ShapeLimits) -> BaseModel:
    """The body as `model`: read with the counts, decoded and validated (off the event loop unless small)."""
    raw = await read_body(request, limits)
    if len(raw) <= INLINE_BODY_BYTES:
        return _decode(raw, model)
    return await asyncio.to_thread(_decode, raw, model)
