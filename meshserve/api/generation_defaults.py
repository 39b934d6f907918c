"""--generation-config: sampling defaults from a checkpoint's generation_config.json, as vLLM applies them.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the
checkpoint's value (model authors tune these: a model meant for temperature 0.6 gets 0.6, not
OpenAI's 1.0); a chat request without max_tokens / max_completion_tokens gets max_new_tokens.
Whatever the request sets wins. Like vLLM, `do_sample` is not read: greedy is temperature 0.

    auto   the generation_config.json beside the weights (the default)
    vllm   none: the API's own defaults
    DIR    the generation_config.json in DIR
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

from meshserve.errors import ConfigError

_FILE = "generation_config.json"
# generation_config.json key -> request field
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # chat requests only (completions keep OpenAI's 16)

    def as_dict(self) -> dict:
        return dict(self._set)

    @cached_property  # (frozen: computed once, not per request)
    def _set(self) -> tuple[tuple[str, object], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None)

    def apply(self, body):
        """`body` (a request model) with its unset sampling fields filled in; the same object when none apply."""
        if getattr(body, "use_beam_search", False):  # beam search takes no sampling settings
            return body
        unset = lambda name: name in type(body).model_fields and name not in body.model_fields_set
        update = {name: value for name, value in self.as_dict().items()
                  if name != "max_tokens" and unset(name) and getattr(body, name) is None}
        if (self.max_tokens is not None and "max_completion_tokens" in type(body).model_fields
                and body.max_tokens is None and body.max_completion_tokens is None):
            update["max_tokens"] = self.max_tokens
        return body.model_copy(update=update) if update else body

    def apply_proto(self, sampling):
        """A gRPC SamplingParams message with its unset sampling fields filled in (a copy; the same
        message when none apply). max_tokens stays the API's default: gRPC has no chat requests."""
        update = {name: value for name, value in self._set if name != "max_tokens" and not sampling.HasField(name)}
        if not update:
            return sampling
        filled = type(sampling)()
        filled.CopyFrom(sampling)
        for name, value in update.items():
            setattr(filled, name, value)
        return filled


def load_sampling_defaults(source: str, model_dir: str | Path) -> SamplingDefaults:
    """The defaults --generation-config `source` asks for, the checkpoint being `model_dir`."""
    if source == "vllm":
        return SamplingDefaults()
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / _FILE
    if not path.is_file():
        if source == "auto":
            return SamplingDefaults()  # a checkpoint without one: nothing to apply
        raise ConfigError("generation_config", source, f"auto, vllm, or a directory holding {_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("generation_config", source, f"a readable JSON {_FILE} ({exc})") from None
    values = {field: config[key] for key, field in _SAMPLING_KEYS.items() if config.get(key) is not None}
    for name, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError("generation_config", f"{path}: {name}={value!r}", "a number")
    max_new = config.get("max_new_tokens")
    if max_new is not None and not (isinstance(max_new, int) and max_new >= 1):
        raise ConfigError("generation_config", f"{path}: max_new_tokens={max_new!r}", "an integer >= 1")
    return SamplingDefaults(**values, max_tokens=max_new)
