"""Incremental detokenization and stop strings.

Text is produced as tokens arrive, without re-decoding the whole output each step: a short
window of earlier tokens is decoded twice (with and without the new tokens) and the difference
is the new text. Decoding from the same starting token on both sides keeps tokenizer quirks
(a SentencePiece leading space, a byte-level character split over two tokens) out of the
delta; text ending in U+FFFD (an incomplete UTF-8 character) is held back until it completes.
With a `tokenizers.Tokenizer`, the library's own `DecodeStream` does the same windowed
decoding in one native call per step instead of two (this is on every step's path: about a
fifth of the time of a decode step at batch 256); it is primed with a prompt suffix that
decodes to complete characters, so none of the prompt's text leaks into the output.

Stop strings: the output is cut where a stop string first appears. While streaming, the last
(longest stop string - 1) characters are held back, so a stop string is never half-sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshserve.engine.token_bytes import ByteStream, TokenBytes

WINDOW = 6  # tokens of earlier context decoded with each delta


class IncrementalDetokenizer:
    """One request's text. `push(token_ids)` returns the newly visible text."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 token_bytes: TokenBytes | None = None) -> None:
        """token_bytes: the tokenizer's byte table when it is byte-level (token_bytes.py), shared
        by the requests of a replica: the stream then runs on it instead of a DecodeStream."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - WINDOW, 0)
        self.read_offset = len(self.ids)
        # Output text not handed out yet (after any stop-string cut); what was handed out is
        # dropped, so a step's work does not grow with the length of the output.
        self.pending = ""
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped_on: str | None = None
        self._stream = _decode_stream(tokenizer, self.ids, skip_special_tokens, token_bytes)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> None:
        """Add tokens; detects stop strings (see `stopped_on`)."""
        if self.stopped_on is not None or not token_ids:
            return
        self.ids.extend(token_ids)
        if self._stream is not None:
            delta = self._stream.step(self.tokenizer, token_ids if token_ids.__class__ is list else list(token_ids))
            if not delta:
                return  # nothing complete yet
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)  # for flush
            self._add(delta)
            return
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # nothing complete yet
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._add(delta)

    def step(self, token_ids: list[int]) -> str:
        """`push(token_ids)` then `take()`: a streaming step's new text, in one call on the path
        every decode step takes (a stream and no stop strings: nothing is held back)."""
        stream = self._stream
        if stream is None or self.stop or not token_ids:
            self.push(token_ids)
            return self.take()
        self.ids.extend(token_ids)
        delta = stream.step(self.tokenizer, token_ids)
        if not delta:
            return ""  # nothing complete yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)  # for flush
        if self.pending:
            delta, self.pending = self.pending + delta, ""
        return delta

    def replay(self, token_ids: Sequence[int]) -> None:
        """Become the detokenizer of a stream that was sent these tokens one step at a time and
        whose text was handed out (a migrated request: the client has it). One push per token,
        as the stream had them: a push of all at once would hold every token's text back when
        the last one ends inside a character, and hand it out again later."""
        for t in token_ids:
            self.push([t])
            self.take()

    def flush(self) -> None:
        """At the end: decode held-back tokens even when their last character is incomplete."""
        if self.stopped_on is None and self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            after = self._decode(self.ids[self.prefix_offset:])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._add(after[len(before):])

    def _add(self, delta: str) -> None:
        """Append new text and cut it at the first stop string. A stop string may straddle old
        and new text; the last `hold` characters are never handed out, so it lies in `pending`."""
        if not self.stop:
            self.pending += delta
            return
        start = max(len(self.pending) - self.hold, 0)
        self.pending += delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.pending.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.pending = self.pending[: i + len(s)] if self.include_stop else self.pending[:i]
            self.stopped_on = s

    def take(self, *, final: bool = False) -> str:
        """Text not yet handed out; all of it when `final` (or once a stop string ended it)."""
        pending = self.pending
        n = len(pending) if final or self.stopped_on is not None else max(len(pending) - self.hold, 0)
        self.pending = pending[n:]
        return pending[:n]


def _decode_stream(tokenizer, prompt_ids: list[int], skip_special_tokens: bool, token_bytes: TokenBytes | None):
    """A `tokenizers.decoders.DecodeStream` primed with the prompt's last tokens, or None when the
    tokenizer is not a `tokenizers.Tokenizer`. The suffix is the shortest of WINDOW..4*WINDOW (or all)
    tokens whose text has no incomplete character, so the priming step leaves nothing pending that the
    first output token would release. With `token_bytes`, a ByteStream instead, under the same
    condition (which is what lets it start with nothing held)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(tokenizer, Tokenizer):
        return None
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    if token_bytes is not None:
        stream = ByteStream(token_bytes, skip_special_tokens=skip_special_tokens)
    if not prompt_ids:
        return stream
    for n in range(min(len(prompt_ids), WINDOW), min(len(prompt_ids), 4 * WINDOW) + 1):
        suffix = prompt_ids[-n:]
        if not tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            break
    else:
        return None  # no clean suffix (binary-like prompt): the windowed decoding above handles it
    if token_bytes is None:
        stream.step(tokenizer, suffix)
    return stream
