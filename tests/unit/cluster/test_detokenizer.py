"""Incremental detokenization equals decoding everything at once; stop strings cut and hold back."""

import pytest

from meshserve.cluster.detokenizer import IncrementalDetokenizer
from tests.tiny_models import tiny_tokenizer

TEXT = "héllo wörld € the quick brown fox jumps 🦊 over the lazy dog"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _stream(detok, ids, step=1):
    pieces = []
    for i in range(0, len(ids), step):
        detok.push(ids[i:i + step])
        pieces.append(detok.take())
        if detok.stopped_on:
            break
    detok.flush()
    pieces.append(detok.take(final=True))
    return pieces


@pytest.mark.parametrize("step", [1, 2, 5])
def test_incremental_text_equals_full_decode(tok, step):
    prompt = tok.encode("Once upon a time").ids
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = _stream(detok, ids, step)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_string_cuts_text_and_is_never_half_sent(tok):
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, [], stop=("jumps", "nowhere"))
    pieces = _stream(detok, ids)
    assert "".join(pieces) == TEXT[: TEXT.index("jumps")]
    assert detok.stopped_on == "jumps"
    assert not any("jum" in p for p in pieces)
    kept = IncrementalDetokenizer(tok, [], stop=("fox",), include_stop_str_in_output=True)
    assert "".join(_stream(kept, ids, 3)) == TEXT[: TEXT.index("fox") + 3]


def test_earliest_stop_string_wins(tok):
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, [], stop=("lazy", "quick"))
    assert "".join(_stream(detok, ids, 4)) == TEXT[: TEXT.index("quick")]
    assert detok.stopped_on == "quick"
