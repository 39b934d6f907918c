"""One choice's output as chat message parts: content and tool calls, whole or as stream deltas.

Streaming (OpenAI's shape): a call's first delta carries its index, id, type, function name and
the arguments so far; later deltas carry the index and more of the arguments. A named
function's arguments stream as they are generated (the whole output is the arguments); a
`required` output (a JSON array) and an `auto` call in the model's own format are sent whole
once the output ends (their text is not a call until it parses); content before an `auto`
call streams as it comes, holding back only what may be the start of the call's marker.
"""

from __future__ import annotations

from typing import Any

from meshserve.api.tools.choice import ToolCall, ToolMode, ToolRequest, new_call_id
from meshserve.api.tools.parsers import ToolParser


def split_output(tools: ToolRequest, parser: ToolParser | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished choice; content None when the output was only calls."""
    if tools.mode in (ToolMode.NAMED, ToolMode.REQUIRED):
        calls = tools.constrained_calls(text)
        return (None, calls) if calls else (text, [])
    if tools.mode is ToolMode.AUTO and parser is not None:
        content, calls = parser.parse(text)
        return (content or None, calls) if calls else (content, [])
    return text, []


class ToolStream:
    """Feed a choice's text deltas; get the chat `delta` objects to send."""

    def __init__(self, tools: ToolRequest, parser: ToolParser | None) -> None:
        self.tools = tools
        self.parser = parser if tools.mode is ToolMode.AUTO else None
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of `text` sent as content (auto) or arguments (named)
        self.in_call = False  # auto: a call began; the rest waits for the end
        self.num_calls = 0
        self._named_id = new_call_id()

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        mode = self.tools.mode
        if mode is ToolMode.NAMED:
            out = []
            if self.num_calls == 0:
                self.num_calls = 1
                out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.tools.named, "arguments": ""}}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            self.sent = len(self.text)
            return out
        if mode is ToolMode.REQUIRED:
            return []
        if self.parser is None:
            self.sent = len(self.text)
            return [{"content": delta}] if delta else []
        if not self.in_call:
            start = self.parser.start(self.text)
            if start is not None:
                self.in_call = True
                end = start
            else:
                end = len(self.text) - self.parser.hold(self.text)
            if end > self.sent:
                piece, self.sent = self.text[self.sent:end], end
                return [{"content": piece}]
        return []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the choice ended."""
        mode = self.tools.mode
        if mode is ToolMode.NAMED:
            return [] if self.num_calls else self.feed("")
        if mode is ToolMode.AUTO and self.parser is None or mode is ToolMode.NONE:
            return []
        content, calls = split_output(self.tools, self.parser, self.text)
        if not calls:  # not a call after all (or cut short): the rest is content
            rest, self.sent = (content or "")[self.sent:], len(self.text)
            return [{"content": rest}] if rest else []
        self.num_calls = len(calls)
        out = []
        if mode is ToolMode.AUTO and content and len(content) > self.sent:  # (content after a held-back marker)
            out.append({"content": content[self.sent:]})
        out.append({"tool_calls": [c.to_openai(index=i) for i, c in enumerate(calls)]})
        return out
