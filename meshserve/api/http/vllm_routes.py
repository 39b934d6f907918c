"""vLLM's utility routes on the OpenAI API port, beside /v1:

    POST /tokenize      {"model"?, "prompt" | "messages", "add_generation_prompt"?} -> {"count", "max_model_len",
                        "tokens"}; messages go through the chat template first, as /v1/chat/completions does
    POST /detokenize    {"model"?, "tokens": [ids]} -> {"prompt": text}
    GET  /version       {"version": meshserve's version}
    GET  /metrics       Prometheus text, every sample labelled model_name (the --metrics-token-file token when set)
    GET  /openapi.json  the schema of every route and request body (FastAPI, with openapi.py's bodies)

/tokenize and /detokenize use the model, so they need the bearer token as /v1 does; /version,
/metrics (its own token) and /openapi.json are open like /health.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field
from starlette.responses import Response

from meshserve.api import convert
from meshserve.api.auth import bearer_of, is_known
from meshserve.api.http.errors import error_response
from meshserve.api.http.openapi import ERROR_RESPONSES
from meshserve.api.http.protocol import ChatMessage, _Body
from meshserve.errors import ConfigError, check

# Paths that need the bearer token besides /v1/... (they read or run the model).
TOKEN_PATHS = ("/tokenize", "/detokenize")


class TokenizeRequest(_Body):
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str = ""
    tokens: list[int] = Field(min_length=0)


def version() -> str:
    try:
        return metadata.version("meshserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def add_vllm_routes(api: FastAPI, frontend, *, metrics_token: str | None = None) -> None:
    """Register the routes above on `api`; `frontend` is the OpenAIFrontend (service, limits, template)."""

    async def tokenize(body: TokenizeRequest) -> dict:
        card = convert.find_model(frontend.service.models(), body.model)
        check((body.prompt is None) != (body.messages is None), "prompt", body.prompt,
              "set, or messages set instead (exactly one of the two)")
        check(body.add_special_tokens, "add_special_tokens", False,
              "true (this server's tokenizer always adds the model's special tokens)")
        tokenize_text = frontend._tokenizer(card, "prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            ids = await tokenize_text(body.prompt)
        else:
            template = frontend.chat_template
            if template is None:
                raise ConfigError("messages", f"<{len(body.messages)} messages>",
                                  f"a model with a chat template: {card.name!r} has none (use prompt)")
            text = template.render([m.for_template() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt,
                                   **(body.chat_template_kwargs or {}))
            ids = await template.prompt_ids(text, tokenize_text)
        return {"count": len(ids), "max_model_len": card.max_model_len, "tokens": ids, "token_strs": None}

    async def detokenize(body: DetokenizeRequest) -> dict:
        card = convert.find_model(frontend.service.models(), body.model)
        ids = convert.token_ids_of(list(body.tokens), card.vocab_size, field="tokens") if body.tokens else []
        return {"prompt": frontend.service.detokenize(ids)}

    async def get_version() -> dict:
        return {"version": version()}

    async def get_metrics(request: Request) -> Response:
        if frontend.metrics is None:
            return error_response(404, "this server keeps no metrics")
        if metrics_token is not None:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
            if not is_known(bearer_of(headers), (metrics_token.encode(),)):
                return error_response(401, "missing or wrong bearer token: send the header 'Authorization: "
                                           "Bearer <token>' (--metrics-token-file)",
                                      headers={"WWW-Authenticate": "Bearer"})
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(frontend.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    api.add_api_route("/tokenize", tokenize, methods=["POST"], responses=ERROR_RESPONSES)
    api.add_api_route("/detokenize", detokenize, methods=["POST"], responses=ERROR_RESPONSES)
    api.add_api_route("/version", get_version, methods=["GET"])
    api.add_api_route("/metrics", get_metrics, methods=["GET"])
