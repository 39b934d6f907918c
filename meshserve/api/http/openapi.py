"""The request bodies of the routes that read their own body, in the OpenAPI document.

/v1/completions, /v1/chat/completions and /v1/embeddings take the raw `Request` and parse it
with body.py: counted as it arrives (a body of a million token ids is refused before it is
decoded) and decoded off the event loop. FastAPI only documents a body it parses itself (a
pydantic parameter, read whole and validated on the loop), so those routes had no
requestBody in /openapi.json. Their pydantic models are the schema: each route's operation
gets a requestBody referring to its model (`openapi_extra`), and the models' JSON schemas join
the document's components when FastAPI first builds it. The hot path is unchanged: the schema
is made once, for the document only.

Errors are documented as they are sent (errors.py): OpenAI's `{"error": {...}}` with a 4XX or
5XX status, never FastAPI's 422 (a body FastAPI parses would otherwise be documented with one).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


class ErrorInfo(BaseModel):
    message: str = Field(description="what is wrong, naming the field, its value and what is allowed")
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "rate_limit_error, service_unavailable_error or internal_error")
    param: str | None = Field(description="the field at fault, when one is")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """OpenAI's error body (docs/http.md, Errors)."""

    error: ErrorInfo


# `responses` of a route that reads a body: its errors as sent (and no 422: FastAPI adds one unless 4XX is given)
ERROR_RESPONSES = {"4XX": {"model": ErrorResponse, "description": "a refused request (docs/http.md, Errors)"},
                   "5XX": {"model": ErrorResponse, "description": "no healthy replica, or a bug"}}


def request_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose handler parses `model` itself: its requestBody."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(api: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make `api`'s OpenAPI document hold the JSON schemas of `models` (and of the models they
    use) under components.schemas, where request_body's references point."""
    build = api.openapi  # FastAPI's: builds the document once and keeps it in api.openapi_schema

    def openapi() -> dict:
        if api.openapi_schema is None:
            document = build()
            _, found = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in found.get("$defs", {}).items():
                schemas.setdefault(name, schema)  # (a model FastAPI documented already keeps its entry)
        return api.openapi_schema

    api.openapi = openapi
