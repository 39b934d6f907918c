"""The served /openapi.json describes every POST body, and what it describes is what the server takes.

The oracles are independent of FastAPI and pydantic: openapi-spec-validator checks the document
against the OpenAPI 3.1 specification, jsonschema checks each body schema (Draft 2020-12) and
the bodies sent here against it, and the live server (the demo model, in-process) must accept a
body holding every documented field and refuse, naming the field, what the schema refuses.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest
from openapi_spec_validator import validate

from meshserve.api.http.chat import ChatTemplate
from meshserve.api.http.server import HttpServer
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.integration.api_harness import ServerLoop, demo_service

pytestmark = pytest.mark.timeout(240)

# What each POST route needs besides the documented defaults (max_tokens small: the bodies run).
REQUIRED = {
    "/v1/completions": {"prompt": "The for statement is used to", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "An exception is raised when"}],
                             "max_tokens": 2},
    "/v1/embeddings": {"input": "Python supports"},
    "/tokenize": {"prompt": "Python supports"},
    "/detokenize": {"tokens": [5, 6, 7]},
}


@pytest.fixture(scope="module")
def server():
    service = demo_service(max_model_len=128, num_kv_blocks=32)
    loop = ServerLoop()
    loop.run(service.start())
    http = HttpServer(loop.front(service), port=0, chat_template=ChatTemplate.load(DEMO_MODEL_DIR))
    loop.run(http.start())
    document = json.loads(urllib.request.urlopen(f"{http.url}/openapi.json", timeout=30).read())
    yield {"url": http.url, "document": document}
    loop.run(http.stop(grace=0))
    loop.close(service)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _body_schema(document: dict, path: str) -> dict:
    """The route's body schema, resolvable on its own (its references point into the components)."""
    content = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return {**content["schema"], "components": document["components"]}


def _model(document: dict, path: str) -> dict:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _properties(document: dict, path: str) -> dict:
    return _model(document, path)["properties"]


def test_the_document_is_valid_openapi_and_describes_every_post_body(server):
    document = server["document"]
    validate(document)  # the OpenAPI 3.1 specification
    posts = {path for path, ops in document["paths"].items() if "post" in ops}
    assert posts == set(REQUIRED)
    for path in posts:
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["required"] is True
        schema = _body_schema(document, path)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert _properties(document, path), path
        assert "422" not in operation["responses"]  # the server answers 400 in OpenAI's shape, never 422
        error = operation["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    completions = _properties(document, "/v1/completions")
    assert {"prompt", "truncate_prompt_tokens", "prompt_logprobs", "structured_outputs", "best_of"} <= set(completions)
    assert {"messages", "tools", "tool_choice", "chat_template_kwargs"} <= set(_properties(document,
                                                                                          "/v1/chat/completions"))


@pytest.mark.parametrize("path", sorted(REQUIRED))
def test_a_body_of_every_documented_field_is_accepted(server, path):
    """Every documented field, at its documented default (the required ones as above), in one body:
    valid for the schema, and the server takes it (an embeddings body is parsed, then refused for
    the model's task: the demo model generates)."""
    document = server["document"]
    required = set(_model(document, path).get("required", ()))
    assert required <= set(REQUIRED[path])
    # (an optional field documented without a default defaults to null: the schema must allow it)
    body = {name: prop.get("default") for name, prop in _properties(document, path).items() if name not in required}
    body.update(REQUIRED[path])
    assert set(body) == set(_properties(document, path))  # no field left out
    jsonschema.validate(body, _body_schema(document, path))
    status, reply = _post(server["url"] + path, body)
    if path == "/v1/embeddings":
        assert (status, reply["error"]["param"]) == (400, "model"), reply
    else:
        assert status == 200, reply


@pytest.mark.parametrize("path, change, field", [
    ("/v1/completions", {"bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"n": "two"}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ("/v1/embeddings", {"encoding_format": "int8"}, "encoding_format"),
    ("/detokenize", {"tokens": "5 6"}, "tokens"),
])
def test_what_the_schema_refuses_the_server_refuses_naming_the_field(server, path, change, field):
    document = server["document"]
    body = {**REQUIRED[path], **change}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, _body_schema(document, path))
    status, reply = _post(server["url"] + path, body)
    assert status == 400 and reply["error"]["param"] == field, reply
