"""Incremental detokenization and stop strings.

Text is produced as tokens arrive, without re-decoding the whole output each step: a short
window of earlier tokens is decoded twice (with and without the new tokens) and the difference
is the new text. Decoding from the same starting token on both sides keeps tokenizer quirks
(a SentencePiece leading space, a byte-level character split over two tokens) out of the
delta; text ending in U+FFFD (an incomplete UTF-8 character) is held back until it completes.

Stop strings: the output is cut where a stop string first appears. While streaming, the last
(longest stop string - 1) characters are held back, so a stop string is never half-sent.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 6  # tokens of earlier context decoded with each delta


class IncrementalDetokenizer:
    """One request's text. `push(token_ids)` returns the newly visible text."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - WINDOW, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # full output text so far (after any stop-string cut)
        self.sent = 0  # characters of `text` already handed out
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped_on: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> None:
        """Add tokens; detects stop strings (see `stopped_on`)."""
        if self.stopped_on is not None:
            return
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # nothing complete yet
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(len(self.text) - self.hold, 0)  # a stop string may straddle old and new text
        self.text += delta
        self._find_stop(start)

    def flush(self) -> None:
        """At the end: decode held-back tokens even when their last character is incomplete."""
        if self.stopped_on is None and self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            after = self._decode(self.ids[self.prefix_offset:])
            start = max(len(self.text) - self.hold, 0)
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_on = s

    def take(self, *, final: bool = False) -> str:
        """Text not yet handed out; all of it when `final` (or once a stop string ended it)."""
        end = len(self.text) if final or self.stopped_on is not None else max(len(self.text) - self.hold, 0)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out
