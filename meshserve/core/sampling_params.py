"""How to pick each next token and when to stop: one frozen, validated record per request.

Processing order in the sampler (HF `generate` order): repetition / presence / frequency
penalties, then the constraints (logit_bias added; tokens outside allowed_token_ids, ending a
bad word, ending the output before min_tokens, or refused by the grammar of
structured_outputs get -inf: workers/constraints.py), then temperature, top-k, top-p, min-p,
then a draw. temperature == 0 is greedy (argmax after the penalties and constraints).
Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
penalties, constraints and temperature), as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.errors import check

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_SAMPLES = 256  # n / best_of: sequences of one request (also bounded by max_num_seqs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature        >= 0; 0 = greedy
    top_k              None (off) or an integer >= 1: keep the k most likely tokens
    top_p              (0, 1]: keep the smallest set whose probability reaches top_p
    min_p              [0, 1]: drop tokens below min_p * (probability of the most likely)
    seed               None or an integer in [0, 2**63): the same seed gives the same tokens
    repetition_penalty > 0; 1 = off. Tokens seen in prompt or output: logit / p if > 0 else * p
    presence_penalty   [-2, 2]: subtracted once from every token already generated
    frequency_penalty  [-2, 2]: subtracted per occurrence of a token already generated
    max_tokens         >= 1: generated tokens at most
    stop               strings that end the output (not included unless include_stop_str_in_output)
    stop_token_ids     token ids that end the output (included in token_ids, not in text)
    ignore_eos         keep going past the model's EOS tokens
    logprobs           None, or 0..20: also return the sampled token's logprob and the top-n
    n                  1..MAX_SAMPLES: completions returned for the prompt (indexes 0..n-1)
    best_of            None (= n) or an integer in [n, MAX_SAMPLES]: sequences sampled; the n with the
                       highest cumulative logprob are returned. The sequences share the prompt's KV
                       blocks; with a seed, sequence i draws with seed + i (reproducible).
    min_tokens         0..max_tokens: EOS and stop_token_ids cannot end the output before this many
                       tokens (stop strings still can, as in vLLM)
    logit_bias         (token id, bias in [-100, 100]) pairs added to the logits (a dict is accepted)
    allowed_token_ids  None, or the only token ids that may be drawn (non-empty)
    bad_words          words never generated: the token that would complete one (as it tokenizes
                       alone and after a space) gets -inf
    structured_outputs None, or a grammar the output must follow (core/structured_outputs.py)
    truncate_prompt_tokens None, or k >= 1: only the prompt's last k tokens are used
    prompt_logprobs    None, or 0..20: also return each prompt token's logprob (from the second on)
                       and the top-n at its position, once per request (with n / best_of > 1 they
                       are computed once, by the group's prompt: engine/sample_group.py). Such a
                       request takes no prefix-cache hit (every position's logits are computed)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_outputs: StructuredOutputs | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple((k, v) for k, v in self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputs.from_dict(self.structured_outputs))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
              "a finite number >= 0 (0 = greedy)")
        check(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1), "top_k", self.top_k,
              "None (off) or an integer >= 1")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed", self.seed,
              "None or an integer in [0, 2**63)")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              self.repetition_penalty, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_num(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
              "an integer >= 1")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
              "integers >= 0")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        check(_is_int(self.n) and 1 <= self.n <= MAX_SAMPLES, "n", self.n, f"an integer in [1, {MAX_SAMPLES}]")
        check(self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_SAMPLES), "best_of",
              self.best_of, f"None (= n) or an integer in [n={self.n}, {MAX_SAMPLES}]")
        check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
              f"an integer in [0, max_tokens={self.max_tokens}]")
        check(all(_is_int(t) and t >= 0 and _is_num(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
              "logit_bias", dict(self.logit_bias), f"token ids >= 0 mapped to numbers in [-{MAX_LOGIT_BIAS:g}, "
              f"{MAX_LOGIT_BIAS:g}]")
        check(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            _is_int(t) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids", self.allowed_token_ids,
              "None or a non-empty list of token ids >= 0")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", self.bad_words,
              "strings with at least one non-blank character")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
              "structured_outputs", type(self.structured_outputs).__name__, "None or a StructuredOutputs")
        check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                      and self.truncate_prompt_tokens >= 1),
              "truncate_prompt_tokens", self.truncate_prompt_tokens, "None or an integer >= 1")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                               and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", self.prompt_logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")

    @cached_property  # (read per request per step by the sampler: computed once)
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences sampled for the request: best_of, or n."""
        return self.best_of or self.n

    @cached_property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @cached_property
    def has_constraints(self) -> bool:
        """The sampler changes this request's logits beyond penalties (workers/constraints.py)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.structured_outputs is not None)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model cannot produce."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias]),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            for t in ids:
                check(t < vocab_size, name, t, f"token ids in [0, {vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack-able); tuples become lists. (A shallow copy: every field that
        is not a scalar is converted below; dataclasses.asdict's deep copy cost ~20 us of a served
        request's time to first token, issue 41.)"""
        out = {name: getattr(self, name) for name in _FIELD_NAMES}
        out["stop"], out["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        out["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        out["allowed_token_ids"] = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        out["bad_words"] = list(self.bad_words)
        out["structured_outputs"] = None if self.structured_outputs is None else self.structured_outputs.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(data).difference(_FIELD_NAMES))
        check(not unknown, "sampling_params", unknown, f"known fields: {sorted(_FIELD_NAMES)}")
        return cls(**data)


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
