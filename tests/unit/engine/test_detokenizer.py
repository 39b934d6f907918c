"""Incremental detokenization equals decoding everything at once; stop strings cut and hold back."""

import random

import pytest

from meshserve.engine.detokenizer import IncrementalDetokenizer
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


class _PlainTokenizer:
    """Only `decode`: the detokenizer falls back to its own windowed decoding (the oracle here)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("seed", range(3))
def test_decode_stream_path_equals_windowed_decoding(tok, seed):
    """The native DecodeStream path against the two-decode window on the same tokens: random
    ids (incomplete characters, byte tokens), prompts of every length, several tokens per push,
    stop strings; piece by piece, not only the whole text."""
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    text_ids = tok.encode(TEXT * 3).ids
    used = 0
    for trial in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        if trial % 2:  # a prompt of real text (random ones often end inside a character: no stream)
            prompt = text_ids[: rng.randrange(0, 40)]
        ids = text_ids if trial % 3 == 0 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        stop = ("fox", "zz") if trial % 4 == 1 else ()
        step = rng.choice([1, 1, 2, 5])
        fast = IncrementalDetokenizer(tok, prompt, stop=stop)
        slow = IncrementalDetokenizer(_PlainTokenizer(tok), prompt, stop=stop)
        assert slow._stream is None
        used += fast._stream is not None
        assert _stream(fast, ids, step) == _stream(slow, ids, step)
        assert fast.stopped_on == slow.stopped_on
    assert used >= 30


@pytest.mark.parametrize("seed", range(3))
def test_a_replayed_detokenizer_continues_exactly_where_the_stream_stopped(tok, seed):
    """A migrated request (EngineCore.adopt): a fresh detokenizer replays the tokens the client
    already has; the text it hands out afterwards is exactly the rest of the original stream's,
    also when the replayed tokens end inside a character (random ids: byte tokens)."""
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    text_ids = tok.encode(TEXT).ids
    checked = 0
    for trial in range(40):
        prompt = text_ids[: rng.randrange(0, 20)]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(2, 60))]
        stop = ("zz", "e ") if trial % 3 == 0 else ()
        k = rng.randrange(1, len(ids))
        whole = IncrementalDetokenizer(tok, prompt, stop=stop)
        pieces = _stream(whole, ids)
        if len(pieces) <= k:
            continue  # a stop string ended it within the first k tokens: nothing to continue
        moved = IncrementalDetokenizer(tok, prompt, stop=stop)
        moved.replay(ids[:k])
        assert "".join(pieces[:k]) + "".join(_stream(moved, ids[k:])) == "".join(pieces)
        checked += 1
    assert checked >= 25
