"""Streaming text for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 and most current models).

With a `ByteLevel` decoder every token stands for a fixed byte string (its vocabulary string
read through GPT-2's byte alphabet, or, for an added token whose characters are outside that
alphabet, its UTF-8 bytes), and the text of a token sequence is the UTF-8 decoding of the
concatenation (invalid bytes become U+FFFD), special tokens left out when skipped: what
`tokenizers` does in its ByteLevel decoder. A stream then needs a table lookup and one
`bytes.decode` per step, where `tokenizers.decoders.DecodeStream` decodes a window of ids twice
behind a Python call (1.26 us a call on the 2-core CI machine, this 0.33 us once a token's bytes
are in the table).

`ByteStream` keeps DecodeStream's contract, `step(tokenizer, ids) -> new text or None`: text is
held back while it ends in U+FFFD (an incomplete character) and released whole once it does not.
tests/unit/cluster/test_token_bytes.py compares the two chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence


def _char_bytes() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: the printable character standing for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]  # the others map to 256, 257, ...
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class TokenBytes:
    """Each token's bytes for one byte-level tokenizer, computed on first use and kept."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._char_bytes = _char_bytes()
        self._special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._kept: dict[int, bytes] = {}  # special tokens as their text
        self._skipped: dict[int, bytes] = {}  # special tokens as b""

    @classmethod
    def of(cls, tokenizer) -> TokenBytes | None:
        """The table of a `tokenizers.Tokenizer` whose decoder is ByteLevel; None for any other."""
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import ByteLevel
        except ImportError:
            return None
        if not isinstance(tokenizer, Tokenizer) or not isinstance(tokenizer.decoder, ByteLevel):
            return None
        return cls(tokenizer)

    def table(self, skip_special_tokens: bool) -> dict[int, bytes]:
        """token id -> bytes, for the tokens seen so far (`bytes_of` fills it)."""
        return self._skipped if skip_special_tokens else self._kept

    def bytes_of(self, token: int, skip_special_tokens: bool) -> bytes:
        table = self.table(skip_special_tokens)
        data = table.get(token)
        if data is None:
            data = table[token] = self._compute(token, skip_special_tokens)
        return data

    def _compute(self, token: int, skip_special_tokens: bool) -> bytes:
        if skip_special_tokens and token in self._special:
            return b""
        text = self.tokenizer.id_to_token(token)
        if text is None:  # an id outside the vocabulary (a padded LM head): decode leaves it out
            return b""
        char_bytes = self._char_bytes
        if all(c in char_bytes for c in text):
            return bytes(char_bytes[c] for c in text)
        return text.encode()


class ByteStream:
    """DecodeStream's contract over a TokenBytes table (see the module docstring)."""

    __slots__ = ("_table", "_bytes", "_skip", "_held")

    def __init__(self, token_bytes: TokenBytes, *, skip_special_tokens: bool) -> None:
        self._table = token_bytes.table(skip_special_tokens)
        self._bytes = token_bytes
        self._skip = skip_special_tokens
        self._held = b""  # bytes whose text ends in an incomplete character

    def step(self, tokenizer, ids: Sequence[int]) -> str | None:
        """The text `ids` complete, or None while it would end in U+FFFD. (`tokenizer` is unused:
        the argument keeps DecodeStream's signature.)"""
        table = self._table
        if len(ids) == 1:
            data = table.get(ids[0]) or self._bytes.bytes_of(ids[0], self._skip)
        else:
            data = b"".join([table.get(t) or self._bytes.bytes_of(t, self._skip) for t in ids])
        held = self._held + data if self._held else data
        text = held.decode("utf-8", "replace")
        if not text or text[-1] == "\ufffd":
            self._held = held
            return None
        self._held = b""
        return text
