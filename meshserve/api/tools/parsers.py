"""Parsers of the tool-call formats models write (tool_choice auto), by name as vLLM's
`--tool-call-parser`, or detected from the chat template's source.

  hermes       Hermes, Qwen 2.5 / 3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  llama3_json  Llama 3.1 / 3.2 / 3.3: [<|python_tag|>]{"name": ..., "parameters": {...}}, several joined by ";"
  deepseek_v3  DeepSeek V3 / R1 / V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>[function<｜tool▁sep｜>NAME
               ```json ARGS```| NAME<｜tool▁sep｜>ARGS]<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  openai       GPT-OSS (harmony): <|channel|>commentary to=functions.NAME [<|constrain|>json]<|message|>ARGS<|call|>,
               the answer in <|channel|>final<|message|>TEXT. Parsed on the text: openai-harmony's own
               parser needs its tiktoken vocabulary, which it downloads, and nothing here reaches the network.

Each parser splits a finished output into (content, calls) (content: the text itself when it
holds no calls, except harmony's, whose content is its final channel); `start` says where calls begin in
text still streaming, so that content before it can be sent while the rest is held back. The
markers are special tokens in those models' vocabularies: requests parsed here keep special
tokens in their text (skip_special_tokens=False).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from meshserve.api.tools.choice import ToolCall
from meshserve.errors import check


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_of(obj) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ToolCall(obj["name"], _arguments(obj.get("arguments", obj.get("parameters"))))


def _json_values(text: str) -> list:
    """Consecutive JSON values in text, separated by blanks or ';' (Llama's separator)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= len(text):
            return out
        value, i = decoder.raw_decode(text, i)
        out.append(value)


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    start: Callable[[str], int | None]  # where calls begin in (partial) text, None: not (yet)
    markers: tuple[str, ...]  # what a template that writes this format mentions

    def hold(self, text: str) -> int:
        """How many trailing characters may be the beginning of a marker (not sent yet)."""
        for k in range(min(max(map(len, self.markers), default=0), len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0


# -- hermes -----------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call_of(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # not a call after all: the text is content
        calls.append(call)
    content = text[:text.find("<tool_call>")] if calls else text
    return content.strip() if calls else content, calls


def _start_hermes(text: str) -> int | None:
    i = text.find("<tool_call>")
    return None if i < 0 else i


# -- llama3_json --------------------------------------------------------------------------------------

def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        calls = [_call_of(v) for v in _json_values(body)]
    except json.JSONDecodeError:
        return text, []
    if not calls or None in calls:
        return text, []
    return "", calls


def _start_llama3(text: str) -> int | None:
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
        return 0
    return None


# -- deepseek_v3 ----------------------------------------------------------------------------------------

_DS_BEGIN, _DS_CALL = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
_DS_SEP, _DS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_V3 = re.compile(r"^\s*function\s*$")
_DS_FENCE = re.compile(r"^\s*(\S+)\s*\n```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _parse_deepseek(text: str) -> tuple[str, list[ToolCall]]:
    begin = text.find(_DS_BEGIN)
    if begin < 0:
        return text, []
    calls = []
    for part in text[begin:].split(_DS_CALL)[1:]:
        part = part.split(_DS_END)[0]
        kind, _, rest = part.partition(_DS_SEP)
        if _DS_V3.match(kind):  # V3 / R1: function<sep>NAME\n```json\nARGS\n```
            m = _DS_FENCE.match(rest)
            if m is None:
                return text, []
            name, args = m.group(1), m.group(2)
        else:  # V3.1: NAME<sep>ARGS
            name, args = kind.strip(), rest.strip()
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return text, []
        calls.append(ToolCall(name, args))
    return text[:begin].strip(), calls


# -- openai (harmony) ---------------------------------------------------------------------------------

_HARMONY_MSG = re.compile(r"(?:<\|start\|>\w*)?<\|channel\|>(\w+)([^<]*)(?:<\|constrain\|>\w+)?<\|message\|>(.*?)"
                          r"(?=<\|call\|>|<\|end\|>|<\|return\|>|<\|start\|>|<\|channel\|>|$)", re.S)
_TO_FUNCTION = re.compile(r"to=functions\.([\w.-]+)")


def _parse_harmony(text: str) -> tuple[str, list[ToolCall]]:
    if "<|channel|>" not in text:
        return text, []
    content, calls = [], []
    for channel, header, body in _HARMONY_MSG.findall(text):
        target = _TO_FUNCTION.search(header)
        if target is not None:
            calls.append(ToolCall(target.group(1), body.strip()))
        elif channel == "final":
            content.append(body)
    return "".join(content), calls


def _start_harmony(text: str) -> int | None:
    """Harmony text is messages on channels (analysis, commentary, final), not content with calls
    inside: it is held until the end, when the final channel's text becomes the content."""
    return 0 if text.lstrip()[:2] in ("<|", "") else None


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", _parse_hermes, _start_hermes, ("<tool_call>",)),
    "llama3_json": ToolParser("llama3_json", _parse_llama3, _start_llama3, ("<|python_tag|>",)),
    "deepseek_v3": ToolParser("deepseek_v3", _parse_deepseek, lambda t: (i if (i := t.find(_DS_BEGIN)) >= 0 else None),
                              (_DS_BEGIN,)),
    "openai": ToolParser("openai", _parse_harmony, _start_harmony, ("<|channel|>",)),
}


def parser_named(name: str) -> ToolParser:
    check(name in PARSERS, "tool_call_parser", name, f"one of {sorted(PARSERS)}")
    return PARSERS[name]


def detect_parser(template_source: str) -> ToolParser | None:
    """The parser whose markers the chat template writes (None: the template shows no tool format)."""
    if "<tool_call>" in template_source:
        return PARSERS["hermes"]
    if "tool▁calls▁begin" in template_source:
        return PARSERS["deepseek_v3"]
    if "<|channel|>" in template_source:
        return PARSERS["openai"]
    if "<|python_tag|>" in template_source or ("ipython" in template_source and "parameters" in template_source):
        return PARSERS["llama3_json"]
    return None
