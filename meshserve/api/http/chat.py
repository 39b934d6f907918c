"""Chat templates: the checkpoint's Jinja template rendered the way HF transformers renders it.

Where the template comes from, first found wins: `--chat-template FILE`, the checkpoint's
`chat_template.jinja`, the `chat_template` of its `tokenizer_config.json` (a string, or a list
of named templates of which "default" is used). The environment is the one transformers
builds for `apply_chat_template`: a sandbox (ImmutableSandboxedEnvironment) with trim_blocks
and lstrip_blocks, loop controls, a `tojson` that does not escape HTML, `raise_exception`,
`strftime_now`; the special tokens of tokenizer_config.json (bos_token, eos_token, ...) are
variables, and request keywords (`chat_template_kwargs`) override them.

The rendered text holds the template's own special tokens (a Llama-3 template starts with
bos_token), so it is tokenized without the tokenizer adding its own: `prompt_ids` drops the
ids that tokenizing an empty string gives (what the post-processor adds), as transformers'
`apply_chat_template(tokenize=True)` does with add_special_tokens=False.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshserve.api.tools.parsers import ToolParser, detect_parser, parser_named
from meshserve.errors import ConfigError, check

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks in training) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError("chat_template", f"<template: line {exc.lineno}>",
                          f"a valid Jinja2 template ({exc})") from None


def _special_token(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out in full
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_config(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    source: str
    origin: str  # where it came from, for messages
    special_tokens: dict[str, str] = field(default_factory=dict)
    tool_call_parser: str | None = None  # --tool-call-parser; None: detected from the template's source

    def __post_init__(self) -> None:
        object.__setattr__(self, "_template", compile_template(self.source))
        if self.tool_call_parser is not None:
            parser_named(self.tool_call_parser)  # refuse an unknown name at start-up

    @property
    def tool_parser(self) -> ToolParser | None:
        """How this model's tool calls are parsed (tool_choice auto); None: they are not."""
        if self.tool_call_parser is not None:
            return parser_named(self.tool_call_parser)
        return detect_parser(self.source)

    @classmethod
    def load(cls, checkpoint: str | Path | None, *, override: str | Path | None = None,
             tool_call_parser: str | None = None) -> ChatTemplate | None:
        """The template of a checkpoint folder (None when it has none and no override is given)."""
        folder = Path(checkpoint) if checkpoint is not None else None
        config: dict = {}
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        specials = {k: v for k in SPECIAL_TOKENS if (v := _special_token(config.get(k))) is not None}
        if override is not None:
            path = Path(override)
            check(path.is_file(), "chat_template", str(override), "an existing Jinja2 template file")
            return cls(path.read_text(), str(path), specials, tool_call_parser)
        if folder is not None and (folder / "chat_template.jinja").is_file():
            path = folder / "chat_template.jinja"
            return cls(path.read_text(), str(path), specials, tool_call_parser)
        source = _from_config(config)
        if source is None:
            return None
        return cls(source, f"{folder / 'tokenizer_config.json'}", specials, tool_call_parser)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None, **kwargs) -> str:
        """The prompt text for `messages` (dicts with role and content)."""
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=list(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or a template bug
            raise ConfigError("messages", f"<{len(messages)} messages>",
                              f"a conversation the model's chat template accepts ({exc})") from None

    async def prompt_ids(self, text: str, tokenize: Callable[[str], object]) -> list[int]:
        """Token ids of rendered text without the tokenizer's own special tokens (see the module doc)."""
        added = await tokenize("")
        ids = await tokenize(text)
        if added and ids[: len(added)] == added:
            ids = ids[len(added):]
        return ids
