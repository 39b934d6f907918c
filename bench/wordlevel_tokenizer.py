"""A WordLevel tokenizer over a whole vocabulary, for random-weight checkpoints.

Every id 0..vocab_size-1 is one word ("t<id>"; the BOS and EOS ids are special tokens), so any
token id a random model samples decodes to non-empty text and encodes back to itself: the
serving path's detokenizer and SSE framing do the same work per token as with a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_TEXT, EOS_TEXT = "<|begin_of_text|>", "<|end_of_text|>"


def write_wordlevel_tokenizer(path: str | Path, vocab_size: int, *, bos_token_id: int, eos_token_id: int) -> None:
    """tokenizer.json (+ tokenizer_config.json) with one word per id, next to a checkpoint in `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = {bos_token_id: BOS_TEXT, eos_token_id: EOS_TEXT}
    vocab = {special.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TEXT))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens([BOS_TEXT, EOS_TEXT])
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS_TEXT, "eos_token": EOS_TEXT, "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
