"""The request fields that ask for structured output, as every front-end spells them, to one
StructuredOutputs (or None), naming the field a bad value came from.

HTTP: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object": ...}) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one may be given. gRPC: the StructuredOutputs
message (convert.py), which has the same names.
"""

from __future__ import annotations

from typing import Any

from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.errors import check

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def from_response_format(value: dict[str, Any] | None) -> StructuredOutputs | None:
    """OpenAI's response_format: text (None), json_object, or json_schema."""
    if value is None:
        return None
    kind = value.get("type", "text")
    check(kind in ("text", "json_object", "json_schema"), "response_format.type", kind,
          "'text', 'json_object' or 'json_schema'")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs.json_object()
    spec = value.get("json_schema")
    check(isinstance(spec, dict), "response_format.json_schema", spec,
          "an object with 'name' and 'schema' (OpenAI's json_schema response format)")
    schema = spec.get("schema", spec.get("json_schema"))
    check(schema is not None, "response_format.json_schema.schema", None, "a JSON schema")
    return StructuredOutputs.json_schema(schema, field="response_format.json_schema.schema")


def from_fields(fields: dict[str, Any], *, prefix: str) -> StructuredOutputs | None:
    """vLLM's names (json, regex, choice, grammar, json_object), read from `fields`; errors name
    `prefix + name` (prefix "structured_outputs." or "guided_")."""
    given = [k for k in _KINDS if fields.get(k) not in (None, False)]
    check(len(given) <= 1, prefix.rstrip("._") or "structured_outputs", given, "at most one of "
          f"{[prefix + k for k in _KINDS]}")
    if not given:
        return None
    kind = given[0]
    value, field = fields[kind], prefix + kind
    if kind == "json":
        return StructuredOutputs.json_schema(value, field=field)
    if kind == "regex":
        return StructuredOutputs.regex(value, field=field)
    if kind == "choice":
        return StructuredOutputs.choice(value, field=field)
    if kind == "grammar":
        return StructuredOutputs.ebnf(value, field=field)
    return StructuredOutputs.json_object()


def combine(*sources: tuple[str, StructuredOutputs | None]) -> StructuredOutputs | None:
    """The one constraint asked for; refuses two (naming both fields)."""
    given = [(name, spec) for name, spec in sources if spec is not None]
    check(len(given) <= 1, given[1][0] if len(given) > 1 else "", [n for n, _ in given],
          "one way of asking for structured output per request")
    return given[0][1] if given else None
