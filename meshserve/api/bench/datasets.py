"""Where a run's prompts come from: random token ids (the default), or a ShareGPT-format JSON file.

ShareGPT (the file vLLM's and SGLang's benchmarks read, e.g. ShareGPT_V3_unfiltered_cleaned_split.json):
a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}.
As `vllm bench serve` does: the conversations with at least two turns are shuffled with the
seed; a request's prompt is the first turn, its output length the second turn's token count
(tokenized by the server under test, so the counts are its model's); pairs under 4 tokens
either way, prompts over 1024 tokens, pairs over 2048 tokens or over the model's context are
skipped. `output_len`, when given, replaces every reply's length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

from meshserve.api.bench.loadgen import BenchRequest
from meshserve.errors import ConfigError, check

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with two turns or more, in file order."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("dataset", str(path), "an existing ShareGPT-format JSON file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("dataset", str(path), f"a readable JSON file ({exc})") from None
    check(isinstance(data, list), "dataset", str(path), "a JSON list of {'conversations': [...]} entries (ShareGPT)")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(first, str) and isinstance(second, str) and first and second:
            pairs.append((first, second))
    check(bool(pairs), "dataset", str(path), "a ShareGPT file with at least one conversation of two turns")
    return pairs


async def sharegpt_requests(path: str | Path, *, count: int, seed: int, max_model_len: int,
                            tokenize: Callable[[str], Awaitable[list[int]]],
                            output_len: int | None = None) -> list[BenchRequest]:
    """`count` requests from the file (fewer when it has fewer usable conversations: an error if none)."""
    pairs = read_sharegpt(path)
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == count:
            break
        prompt_len = len(await tokenize(prompt))
        reply_len = output_len or len(await tokenize(reply))
        if prompt_len < MIN_TOKENS or reply_len < MIN_TOKENS:
            continue
        if prompt_len > MAX_PROMPT_TOKENS or prompt_len + reply_len > min(MAX_TOTAL_TOKENS, max_model_len):
            continue
        out.append(BenchRequest(prompt, reply_len, seed * 1_000_003 + len(out), prompt_tokens=prompt_len))
    check(bool(out), "dataset", str(path), f"conversations that fit: {MIN_TOKENS} to {MAX_PROMPT_TOKENS} prompt "
                                           f"tokens and at most {min(MAX_TOTAL_TOKENS, max_model_len)} in all")
    return out
