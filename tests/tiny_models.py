"""Tiny random-weight HF checkpoints written by transformers' own `save_pretrained`, plus a tokenizer.

Weights use a larger init range than HF's default so that logits are far from ties: greedy
decoding then has one right answer that a correct implementation must reproduce exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 320
EOS = 0  # "<|endoftext|>" in the tiny tokenizer
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.15,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)
MISTRAL_WINDOW = 7  # shorter than the test prompts: the window must bite

# name -> (config class name, architecture-specific settings)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", dict(sliding_window=MISTRAL_WINDOW)),
}

# Hybrid-attention architectures (alternating sliding/full layers): windows shorter than the
# prompts, soft-caps small enough to bite, learned sinks large enough to matter.
HYBRID_WINDOW = 6
HYBRID_ARCHS: dict[str, tuple[str, dict]] = {
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=HYBRID_WINDOW, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=3.0, final_logit_softcapping=10.0,
                                     num_hidden_layers=3)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=HYBRID_WINDOW, query_pre_attn_scalar=24,
                                         num_hidden_layers=3,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                         rope_parameters={
                                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=HYBRID_WINDOW, intermediate_size=32,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                       "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                       "truncate": False,
                                                       "original_max_position_embeddings": 16})),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello meshserve! Once upon a time there was a tiny model that liked to count: "
    "one two three four five six seven eight nine ten.",
] * 10


def hf_model(name: str, *, seed: int = 0, overrides: dict | None = None):
    """A fresh random HF model of architecture `name` (float32, eval mode); `overrides` change its config."""
    import transformers

    cls_name, extra = {**ARCHS, **HYBRID_ARCHS}[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **(overrides or {})})
    torch.manual_seed(seed)
    # Gemma2's attention soft-cap exists only in HF's eager attention: versions whose default is SDPA
    # silently drop it (seen on the GPU machine's transformers), which would make a wrong oracle.
    kwargs = {"attn_implementation": "eager"} if name.startswith("gemma") else {}
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()
    if name in ("gemma2", "gemma3"):
        with torch.no_grad():  # HF's init makes every (1 + weight) norm scale exactly one
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
            # The tied, sqrt(hidden)-scaled embedding otherwise makes every token predict itself.
            model.model.embed_tokens.weight.mul_(0.15)
    if name == "gpt_oss":
        with torch.no_grad():  # HF's init makes sinks tiny; large ones show whether they are used
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def tiny_tokenizer():
    """A byte-level BPE with exactly VOCAB ids (id 0 = '<|endoftext|>')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def write_checkpoint(path: Path, name: str, *, seed: int = 0, max_shard_size: str | None = None,
                     overrides: dict | None = None):
    """Save architecture `name` with a tokenizer to `path`; returns the HF model for oracles."""
    model = hf_model(name, seed=seed, overrides=overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return model


def prompts(n: int, *, seed: int = 1, min_len: int = 3, max_len: int = 30) -> list[list[int]]:
    """`n` random token-id prompts of different lengths (no EOS inside)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, n).round().int().tolist()
    return [torch.randint(1, VOCAB, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, *, eos: int = EOS) -> list[int]:
    """HF transformers' own greedy generate for one prompt (no padding), stopping at `eos`."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt):].tolist()
