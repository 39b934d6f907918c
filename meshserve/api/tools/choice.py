"""A chat request's `tools` and `tool_choice`, checked, and what they make the model produce.

- `none` (or no tools): plain text; the tools still reach the chat template unless
  tool_choice is none (OpenAI: the model is told of no tool then).
- `auto`: the model decides; its text goes through the server's tool-call parser
  (parsers.py), which splits it into content and calls.
- `required` / a named function: the output is constrained by the grammar engine, so that the
  arguments always parse and validate against the function's schema, whatever format the
  model's own tool calls have (vLLM does the same):
    named:    the output is the arguments object (the function's `parameters` schema);
    required: the output is a JSON array of at least one {"name": ..., "parameters": {...}},
              each item one of the tools (anyOf over their schemas).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.errors import check

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolMode(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id or new_call_id(), "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    mode: ToolMode
    named: str | None = None  # the function of mode NAMED
    parallel: bool = True  # parallel_tool_calls: more than one call per turn (required)

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, *,
           parallel: bool = True) -> ToolRequest:
        parsed = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
        names = [t.name for t in parsed]
        check(len(set(names)) == len(names), "tools", names, "functions with distinct names")
        if tool_choice is None:
            return cls(parsed, ToolMode.AUTO if parsed else ToolMode.NONE, parallel=parallel)
        if isinstance(tool_choice, str):
            check(tool_choice in ("none", "auto", "required"), "tool_choice", tool_choice,
                  "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
            check(tool_choice == "none" or parsed, "tool_choice", tool_choice, "'none' or unset without tools")
            return cls(parsed, ToolMode(tool_choice), parallel=parallel)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        check(tool_choice.get("type") == "function" and isinstance(name, str), "tool_choice", tool_choice,
              "{'type': 'function', 'function': {'name': NAME}}")
        check(name in names, "tool_choice.function.name", name, f"one of the tools: {names}")
        return cls(parsed, ToolMode.NAMED, name, parallel)

    @property
    def tool(self) -> Tool:
        return next(t for t in self.tools if t.name == self.named)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's shape), None when the model is told of none."""
        if self.mode is ToolMode.NONE or not self.tools:
            return None
        return [{"type": "function", "function": {"name": t.name, "parameters": t.parameters,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools]

    def grammar(self) -> StructuredOutputs | None:
        """The constraint of required / named; None for auto and none."""
        if self.mode is ToolMode.NAMED:
            return StructuredOutputs.json_schema(self.tool.parameters, field=f"tools[{self.named}].parameters")
        if self.mode is ToolMode.REQUIRED:
            items = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                      "required": ["name", "parameters"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs.json_schema(schema, field="tools")
        return None

    def constrained_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in the output of a required / named request; None when the text does not
        parse (the output was cut short by max_tokens)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.mode is ToolMode.NAMED:
            return [ToolCall(self.named, json.dumps(value, ensure_ascii=False))]
        return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]


def _tool(value: Any, i: int) -> Tool:
    field = f"tools[{i}]"
    check(isinstance(value, dict) and value.get("type", "function") == "function", field, value,
          "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    fn = value.get("function")
    check(isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"], f"{field}.function", fn,
          "an object with a non-empty 'name'")
    params = fn.get("parameters") or ANY_OBJECT
    check(isinstance(params, dict), f"{field}.function.parameters", params, "a JSON schema object")
    StructuredOutputs.json_schema(params, field=f"{field}.function.parameters")  # a schema the engine can compile
    return Tool(fn["name"], params, fn.get("description"))
