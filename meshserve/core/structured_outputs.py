"""What shape a request's output must have: one grammar kind and its source.

Kinds (vLLM's `structured_outputs` names): `json` (a JSON schema; OpenAI's
response_format json_schema), `json_object` (any JSON object: response_format json_object),
`regex`, `choice` (one of a list of strings), `grammar` (EBNF in xgrammar's dialect, which
reads GBNF-style rules: `root ::= ...`). The grammar engine is xgrammar (docs/structured_outputs.md
says why); this record only names the constraint and checks that its source parses, which
needs no tokenizer, so every front-end refuses a bad schema or regex before anything is queued.
The workers compile it against the model's vocabulary (workers/grammar.py).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any

from meshserve.errors import ConfigError, check

_IMPORT_LOCK = threading.Lock()


def load_xgrammar():
    """The xgrammar module, imported under a lock: it imports transformers, whose lazy attributes
    are not safe to resolve from two threads at once (the API's event loop checks a schema while
    a worker's compile thread builds the vocabulary table: seen as an ImportError of
    PreTrainedTokenizerBase). Imported on first use, not with this module (it takes seconds)."""
    with _IMPORT_LOCK:
        import transformers
        import xgrammar

        transformers.PreTrainedTokenizerFast  # noqa: B018 (resolve the lazy attribute here, under the lock)
        return xgrammar


class GrammarKind(StrEnum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputs:
    """kind: GrammarKind; source: the schema as JSON text (json), the regex (regex), the EBNF
    (grammar), "" (json_object); choices: the strings of `choice` (source "" then).
    whitespace: JSON may hold whitespace between tokens (False: compact JSON only, so a model
    cannot spend its tokens on blanks)."""

    kind: GrammarKind
    source: str = ""
    choices: tuple[str, ...] = ()
    whitespace: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))

    # -- constructors that name the field a bad value came from ---------------------------------

    @classmethod
    def json_schema(cls, schema: Any, *, field: str = "json") -> StructuredOutputs:
        """A JSON schema given as a dict or JSON text; refused unless xgrammar can compile it."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConfigError(field, _short(schema), f"a JSON schema as JSON text ({exc})") from None
        check(isinstance(schema, dict | bool), field, _short(repr(schema)), "a JSON schema (an object)")
        # Key order is kept: it is the order the output's properties come in.
        out = cls(GrammarKind.JSON, json.dumps(schema, separators=(",", ":")))
        out.check(field)
        return out

    @classmethod
    def regex(cls, pattern: str, *, field: str = "regex") -> StructuredOutputs:
        check(isinstance(pattern, str) and pattern != "", field, pattern, "a non-empty regular expression")
        out = cls(GrammarKind.REGEX, pattern)
        out.check(field)
        return out

    @classmethod
    def choice(cls, choices: Any, *, field: str = "choice") -> StructuredOutputs:
        ok = isinstance(choices, list | tuple) and len(choices) > 0 and all(isinstance(c, str) and c for c in choices)
        check(ok, field, choices, "a non-empty list of non-empty strings")
        return cls(GrammarKind.CHOICE, choices=tuple(choices))

    @classmethod
    def ebnf(cls, grammar: str, *, field: str = "grammar") -> StructuredOutputs:
        check(isinstance(grammar, str) and grammar.strip() != "", field, grammar, "a non-empty EBNF grammar")
        out = cls(GrammarKind.GRAMMAR, grammar)
        out.check(field)
        return out

    @classmethod
    def json_object(cls) -> StructuredOutputs:
        return cls(GrammarKind.JSON_OBJECT)

    # -- what the workers compile ---------------------------------------------------------------

    def choice_regex(self) -> str:
        return "|".join(f"({re.escape(c)})" for c in self.choices)

    def grammar(self):
        """The xgrammar.Grammar (tokenizer-free) of this constraint."""
        xgr = load_xgrammar()

        if self.kind is GrammarKind.JSON:
            return xgr.Grammar.from_json_schema(self.source, any_whitespace=self.whitespace, strict_mode=True)
        if self.kind is GrammarKind.JSON_OBJECT:
            # Any JSON object (not a bare value): what OpenAI's json_object mode promises.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=self.whitespace,
                                                strict_mode=False)
        if self.kind is GrammarKind.REGEX:
            return xgr.Grammar.from_regex(self.source)
        if self.kind is GrammarKind.CHOICE:
            return xgr.Grammar.from_regex(self.choice_regex())
        return xgr.Grammar.from_ebnf(self.source)

    def check(self, field: str) -> None:
        """Refuse a source the grammar engine cannot parse, naming `field` and its reason. Checked
        once per distinct constraint (the front-end and the engine's admission both ask)."""
        reason = _reason_refused(self)
        if reason is not None:
            raise ConfigError(field, _short(self.source or repr(self.choices)), f"a valid {self.kind.value} ({reason})")

    def not_compiled(self, reason: str) -> ConfigError:
        """The error of a constraint the driver rank could not compile against the model's
        vocabulary, or not within the scheduler's bound (the tokenizer-free check at the front-end
        had passed), named as the API names it."""
        return ConfigError("structured_outputs", _short(self.source or repr(self.choices)),
                           f"a {self.kind.value} that compiles against this model's vocabulary (response_format / "
                           f"structured_outputs): {reason}")

    @property
    def cache_key(self) -> tuple:
        return self.kind.value, self.source, self.choices, self.whitespace

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "source": self.source, "choices": list(self.choices),
                "whitespace": self.whitespace}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputs:
        check(isinstance(data, dict) and data.get("kind") in {k.value for k in GrammarKind}, "structured_outputs",
              data, f"a dict with kind one of {[k.value for k in GrammarKind]}")
        return cls(GrammarKind(data["kind"]), data.get("source", ""), tuple(data.get("choices", ())),
                   bool(data.get("whitespace", False)))


@lru_cache(maxsize=256)
def _reason_refused(spec: StructuredOutputs) -> str | None:
    try:
        spec.grammar()
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
        return engine_reason(exc)
    return None


def engine_reason(exc: BaseException) -> str:
    """A grammar engine's exception as one short line for a user."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _ENGINE_PREFIX.sub("", reason)[:300]  # "[12:00:00] /project/cpp/x.cc:12: " says nothing to a user


_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"
