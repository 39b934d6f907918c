"""The byte-table stream (engine/token_bytes.py) against tokenizers' own DecodeStream and decode:
the same text piece by piece, on random ids (byte tokens that end inside a character, special
and added tokens), several ids per step, with and without skipping special tokens."""

import random

import pytest
from tokenizers import AddedToken
from tokenizers.decoders import DecodeStream, Metaspace

from meshserve.core.checkpoint_files import load_tokenizer
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.detokenizer import IncrementalDetokenizer
from meshserve.engine.token_bytes import ByteStream, TokenBytes
from tests.tiny_models import tiny_tokenizer

TEXT = "héllo wörld € the quick brown fox jumps 🦊 over the lazy dog"


def _tiny_with_added():
    tok = tiny_tokenizer()  # id 0 is the special '<|endoftext|>'
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("ünïcode wörd", special=False), AddedToken("plain", special=False)])
    return tok


@pytest.fixture(scope="module", params=["tiny", "demo"])
def tok(request):
    return _tiny_with_added() if request.param == "tiny" else load_tokenizer(str(DEMO_MODEL_DIR))


def test_only_byte_level_tokenizers_get_a_table(tok):
    assert TokenBytes.of(tok) is not None
    other = tiny_tokenizer()
    other.decoder = Metaspace()
    assert TokenBytes.of(other) is None
    assert TokenBytes.of(object()) is None


@pytest.mark.parametrize("skip", [True, False])
def test_every_token_alone_decodes_as_the_library_does(tok, skip):
    """Each id's bytes, decoded with replacement, equal the library's decode of that id."""
    table = TokenBytes(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for t in range(vocab + 3):  # ids past the vocabulary too (decode leaves them out)
        assert table.bytes_of(t, skip).decode("utf-8", "replace") == tok.decode([t], skip_special_tokens=skip), t


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip", [True, False])
def test_byte_stream_equals_decode_stream_piece_by_piece(tok, seed, skip):
    rng = random.Random(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    text_ids = tok.encode(TEXT).ids
    table = TokenBytes(tok)
    for trial in range(40):
        ids = text_ids if trial % 5 == 0 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        if trial % 3 == 1:  # special and added tokens between words
            ids = [x for t in ids for x in ((t,) if rng.random() < 0.8 else (t, rng.randrange(vocab - 4, vocab)))]
        ours, theirs = ByteStream(table, skip_special_tokens=skip), DecodeStream(skip_special_tokens=skip)
        i = 0
        while i < len(ids):
            step = ids[i:i + rng.choice([1, 1, 1, 2, 3])]
            i += len(step)
            assert ours.step(tok, step) == theirs.step(tok, step), (trial, i)


@pytest.mark.parametrize("seed", range(3))
def test_detokenizer_on_the_byte_table_equals_the_decode_stream_one(tok, seed):
    """IncrementalDetokenizer with the replica's table, stepped as EngineCore steps it, against the
    same without (DecodeStream, push then take): prompts of every length, stop strings, flush."""
    rng = random.Random(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    text_ids = tok.encode(TEXT * 2).ids
    table = TokenBytes.of(tok)
    streamed = 0
    for trial in range(40):
        prompt = text_ids[: rng.randrange(0, 40)] if trial % 2 else [rng.randrange(vocab) for _ in range(8)]
        ids = text_ids if trial % 3 == 0 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        stop = ("fox", "zz") if trial % 4 == 1 else ()
        fast = IncrementalDetokenizer(tok, prompt, stop=stop, token_bytes=table)
        slow = IncrementalDetokenizer(tok, prompt, stop=stop)
        assert (fast._stream is None) == (slow._stream is None)
        streamed += isinstance(fast._stream, ByteStream)
        pieces = []
        for t in ids:
            slow.push([t])
            pieces.append((fast.step([t]), slow.take()))  # step: push + take in one call (EngineCore's)
        fast.flush()
        slow.flush()
        pieces.append((fast.take(final=True), slow.take(final=True)))
        assert all(a == b for a, b in pieces), trial
        assert fast.stopped_on == slow.stopped_on
    assert streamed >= 20
