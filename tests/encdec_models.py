"""A tiny random-weight BART checkpoint written by transformers' own `save_pretrained`, and HF's
greedy generation on it: the oracle of the encoder-decoder tests (tests/integration, tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import EOS, VOCAB, tiny_tokenizer

MAX_POS = 64  # the encoder's (and decoder's) position table
START = 2  # decoder_start_token_id


def write_bart(path: Path, *, seed: int = 0):
    """Save a tiny BART (eager attention, float32) with the tiny tokenizer to `path`; returns the HF model."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                     decoder_attention_heads=2, encoder_ffn_dim=96, decoder_ffn_dim=128,
                     max_position_embeddings=MAX_POS, init_std=0.15, eos_token_id=EOS, pad_token_id=1,
                     bos_token_id=None, decoder_start_token_id=START, forced_eos_token_id=None, dropout=0.0,
                     attn_implementation="eager")
    torch.manual_seed(seed)
    hf = BartForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF zeroes it at init; a random one shows whether it is added
        hf.final_logits_bias.normal_(0.0, 0.5)
    hf.save_pretrained(path)
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return hf


def encoder_prompts(lengths=(1, 7, 23, 40), *, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy_encdec(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy generate for one encoder input; the decoder's tokens after the start token."""
    device = hf.device
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=device),
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.int64, device=device),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=1)
    assert out[0, 0].item() == START
    return out[0, 1:].tolist()


def bart_case(path: Path, lengths=(1, 7, 23, 40), *, max_new_tokens: int):
    """(HF model, encoder prompts, HF's greedy tokens per prompt) of a tiny BART saved to `path`."""
    hf = write_bart(path)
    prompts = encoder_prompts(lengths)
    return hf, prompts, [hf_greedy_encdec(hf, p, max_new_tokens) for p in prompts]
